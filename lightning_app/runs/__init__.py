"""One folder per run: `ROOT/version_N/` holds run.json, the TensorBoard events, config.yaml, checkpoints/.

The modules, in the order a command meets them: one pass, top to bottom (plan.plan_run), each entered once
(tests/helpers/runs_trace.py counts it), but folders, the leaf the others write through.
- launch: this process as its launcher started it, read once (the one launch-rank-zero process that makes a run
  folder and takes its lock; its SLURM job, torchrun worker group, sweep trial, command line)
- resolve: `--ckpt_path last|hpc|FILE` -> a plain answer: one run, one checkpoint, the lines saying why (never an
  older run instead), from
  - identity: run.json's training settings compared with this config's; IGNORED, the one list of what `last` ignores
  - signature: what a checkpoint holds, read once without running its code: readable, fits this model, fingerprint
- plan: the folder a subcommand writes to and what it loads, each said in one line (`RunPlan.lines`); it makes
  or takes the folder and writes run.json
  - lock: `version_N/.lock`, linked into place, with a heartbeat; the temp files of dead writers removed
- folders: run folders' paths, made atomically; atomic writes
Later, after the trainer is made:
- flags_over_checkpoint: flags win over a checkpoint, except what builds the network
- guard: every rank on the same run (a fit-stage setup), atomic checkpoints, logs flushed before a save; the one
  module here that needs torch and Lightning, so this package does not import it (cli.py does)
- predict_data: a predict of the val split refuses other data than its checkpoint's run trained on
"""
from lightning_app.runs.folders import CHECKPOINTS, LAST, new_run, run_dirs, run_of_checkpoint, write_atomically
from lightning_app.runs.identity import IGNORED, RUN_JSON, read_run
from lightning_app.runs.launch import is_launch_rank_zero
from lightning_app.runs.lock import LOCK_NAME, RunLock
from lightning_app.runs.plan import RunPlan, plan_run
from lightning_app.runs.signature import ModelSignature, check_compatible, mismatch

__all__ = ["CHECKPOINTS", "IGNORED", "LAST", "LOCK_NAME", "RUN_JSON", "ModelSignature", "RunLock", "RunPlan",
           "check_compatible", "is_launch_rank_zero", "mismatch", "new_run", "plan_run", "read_run",
           "run_dirs", "run_of_checkpoint", "write_atomically"]
