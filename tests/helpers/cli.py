"""`python main.py` as a user runs it, the flags that keep a run small, and a checkpoint fitted in-process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.processes import stack_env, stop_tree


def run_main(args: list[str], env: dict | None = None, timeout: int = 300, check: bool = True):
    """`python main.py ARGS` in a subprocess, as a user runs it: without the seed an earlier test's
    pl.seed_everything left in this process's environment (PL_GLOBAL_SEED, PL_SEED_WORKERS), which Lightning reads as
    a seeded run's (lightning_fabric/utilities/seed.py) and which a user's shell does not hold; `env` may set them."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    full_env = stack_env({**inherited, "PYTHONUNBUFFERED": "1", **(env or {})})
    cmd = [sys.executable, "main.py", *args]
    with subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            e.add_note(stop_tree(popen))  # where each process of the run stood
            raise
        except BaseException:
            popen.kill()
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, err)  # the caller decides what a failure means
    if check and proc.returncode != 0:
        raise AssertionError(f"main.py {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


# Flags that keep a CLI run small and quiet; every test run writes only under its tmp dir.
def quick_args(data_dir: Path, root: Path, epochs: int = 1, batch: int = 32, width: int | None = 8) -> list[str]:
    return [
        "--data.data_dir", str(data_dir),
        "--data.batch_size", str(batch),
        "--data.num_workers", "0",
        "--trainer.max_epochs", str(epochs),
        "--trainer.default_root_dir", str(root),
        "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false",
        *(["--model.arch_kwargs", f"{{width: {width}}}"] if width else []),
    ]


def train_checkpoint(data_dir: Path, root: Path, *, epochs: int, batch: int, **model_kwargs):
    """(trainer, model, datamodule, checkpoint path): conv11 width 8 fitted on `data_dir` at 32 px, in-process."""
    import pytorch_lightning as pl

    from datamodules import ImageFolderDataModule
    from lightning_app.module import ImageClassifier

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=batch, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=batch,
                            arch_kwargs={"width": 8}, pictures=[], **model_kwargs)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, dm)
    path = root / "model.ckpt"
    trainer.save_checkpoint(path)
    return trainer, model, dm, path
