"""What the tests share that is not a fixture (the fixtures are in tests/conftest.py), a module a subject:

- trees: image trees on disk (make_tree, make_odd_tree, make_slow_tree, copy_tree), odd images, jpeg/png bytes;
- cli: `python main.py` as a user runs it (run_main), the flags of a small run (quick_args), a checkpoint fitted
  in-process (train_checkpoint);
- processes: a free port, processes started for multi-process tests, a function run in a forked child;
- callbacks: what tests add to real runs with --trainer.callbacks+=tests.helpers.callbacks.X, and readers of what
  those write;
- streaming: a StreamingDataModule that records the ids of each batch (--data.class_path), and its reader;
- s3: S3Server, a real S3 endpoint on 127.0.0.1 (the fixtures s3, s3_session and shared_s3 wrap it);
- event_files: what TensorBoard shows of a run folder;
- checkpoints: a crafted checkpoint that runs code when unpickled;
- imports: the import graph of our packages, read from their source, and its circles.
"""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
