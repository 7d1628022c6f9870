"""A stop signal to the whole process group (`timeout`, `kill -TERM -PGID`, a container stop, SLURM's signals to a
job step) reaches every loader worker too. The workers leave it to the training process
(datamodules/processes/loader_workers.py), which saves last.ckpt and exits 0; `--ckpt_path last` resumes. Each
backend with 2 loader workers, and a DDP run of 2 processes whose group gets the signal.

Without it, torch's worker handler ends each worker and the fit fails with "DataLoader worker (pid N) is killed by
signal: Terminated" (exit 1), with or without a checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cli import quick_args
from tests.helpers.optional import needs_dali
from tests.helpers.processes import finish, start_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _signal_group_at(epoch: int, batch: int, sig: str = "SIGTERM") -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.sig={sig}", "--trainer.callbacks.group=true"]


def _backend(name: str, data: Path, tmp: Path) -> list[str]:
    if name == "imagefolder":
        return []
    if name == "streaming":
        from datamodules.shards.pack import pack

        shards = tmp / "shards"
        if not shards.exists():
            pack(data, str(shards), progress=False)
        return ["--config", "configs/data/streaming.yaml", "--data.data_dir", str(shards),
                "--data.cache_dir", str(tmp / "chunks")]
    if name == "dali-lmdb":  # DALI's parallel external source: worker processes of DALI's own
        from datamodules.lmdb.datamodule import pack

        db = tmp / "db.lmdb"
        if not db.exists():
            pack(data, db, progress=False)
        return ["--config", "configs/data/dali.yaml", "--data.source", "lmdb", "--data.lmdb_path", str(db)]
    return ["--config", f"configs/data/{name}.yaml", "--data.cache_dir", str(tmp / name)]


def _fit(data: Path, root: Path, *extra: str) -> tuple[int, str]:
    args = ["fit", *quick_args(data, root, epochs=2, batch=40), "--data.num_workers", "2",
            "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]", *extra]
    return finish(start_main(args, session=True), timeout=600)


def _step(root: Path) -> int:
    return torch.load(root / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)["global_step"]


SIGNALS = {"SIGTERM": (0, "SIGTERM: saved"), "SIGINT": (130, "Ctrl-C (SIGINT): saved")}  # docs/clusters.md, "Faults"


# DALI's workers ignore the three stop signals in one handler (datamodules/processes/loader_workers.py,
# InWorkersOnly), and its fits are the slowest here (spawned workers, one pipeline build each): SIGTERM alone
# stands for it.
@pytest.mark.parametrize(("backend", "sig"), [
    *((backend, sig) for backend in ("imagefolder", "lmdb", "downscaled", "streaming") for sig in SIGNALS),
    pytest.param("dali-lmdb", "SIGTERM", marks=needs_dali)])
def test_a_stop_signal_to_the_group_saves_and_resumes(backend, sig, tiny_data, tmp_path):
    root = tmp_path / "logs"
    data = _backend(backend, tiny_data, tmp_path)
    code, out = _fit(tiny_data, root, *data, *_signal_group_at(1, 1, sig))
    status, said = SIGNALS[sig]
    assert code == status, out[-4000:]
    assert said in out and "killed by signal" not in out and "Traceback" not in out, out[-4000:]
    assert _step(root) == 6 + 2  # 240 images at batch 40: the second batch of the second epoch finished
    code, out = _fit(tiny_data, root, *data, "--ckpt_path", "last")
    assert code == 0 and "Done: best val/acc1" in out, out[-4000:]
    assert _step(root) == 12


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_stop_signal_to_the_group_saves_and_resumes_imagefolder_under_each_worker_start(method, tiny_data, tmp_path):
    """ImageFolder and SIGTERM with the workers forked from the training process or spawned (the test above: the
    default, forkserver, whose workers are the fork server's children, in the same process group)."""
    root = tmp_path / "logs"
    start = ["--data.worker_start", method]
    code, out = _fit(tiny_data, root, *start, *_signal_group_at(1, 1))
    assert code == 0, out[-4000:]
    assert "SIGTERM: saved" in out and "killed by signal" not in out and "Traceback" not in out, out[-4000:]
    assert _step(root) == 6 + 2
    code, out = _fit(tiny_data, root, *start, "--ckpt_path", "last")
    assert code == 0 and "Done: best val/acc1" in out, out[-4000:]
    assert _step(root) == 12


@pytest.mark.parametrize("decode", [
    [],
    # each rank's decode thread, its workers decoding a balanced share (datamodules/sample/balance.py)
    pytest.param(["--data.decode", "gpu", "--data.cpu_decode_share", "null"], marks=pytest.mark.slow, id="gpu-share"),
], ids=lambda d: "cpu" if d == [] else None)
def test_sigterm_to_the_group_of_a_two_process_run_saves_once_and_resumes(tiny_data, tmp_path, decode):
    """ImageFolder; DALI's workers are covered by the one-process test above (its 2-process run took 3 min)."""
    root = tmp_path / "logs"
    # the ranks agree on logging steps: the signal in global step 8 is agreed at the end of step 9, so the loaders
    # (and their workers, which got the signal too) must deliver one more batch after it
    ddp = ["--config", "configs/ddp.yaml", "--trainer.devices", "2",
           "--trainer.log_every_n_steps", "3", *decode]
    code, out = _fit(tiny_data, root, *ddp, *_signal_group_at(1, 1))
    assert code == 0, out[-4000:]
    assert out.count("SIGTERM: saved") == 1 and "killed by signal" not in out and "Traceback" not in out, out[-4000:]
    assert _step(root) == 9
    code, out = _fit(tiny_data, root, *ddp, "--ckpt_path", "last")
    assert code == 0 and "Done: best val/acc1" in out, out[-4000:]
    assert _step(root) == 12
