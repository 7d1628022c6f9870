"""--data.worker_start: every loader we make starts its workers by the named method, never the interpreter's default
(datamodules/processes/start.py), and a worker dies with the training process under each method
(datamodules/processes/loader_workers.py, `die_with_the_trainer`)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from datamodules import DataError, ImageFolderDataModule
from datamodules.processes.start import START_METHODS, fork_hazard
from tests.helpers import REPO
from tests.helpers.processes import finish, start_command


@pytest.mark.parametrize("method", START_METHODS)
def test_every_loader_takes_the_start_method(tiny_data, method):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=1, image_size=16,
                               worker_start=method, predict_dir=str(tiny_data / "val"))
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.predict_dataloader()):
        assert loader.multiprocessing_context.get_start_method() == method


def test_a_loader_without_workers_takes_no_context(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=0, image_size=16)
    dm.setup("fit")
    assert dm.train_dataloader().multiprocessing_context is None


def test_an_unknown_start_method_is_one_line(tiny_data):
    with pytest.raises(DataError, match="data.worker_start must be one of forkserver, fork, spawn"):
        ImageFolderDataModule(data_dir=str(tiny_data), worker_start="threads")


def test_the_fork_hazard_is_named_where_it_applies():
    said = fork_hazard()
    if sys.version_info[:2] in ((3, 10), (3, 11)):
        assert "runtime lock" in said and "forkserver" in said
    else:
        assert said is None


KILLED = r"""
import sys, time
from datamodules import ImageFolderDataModule

dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=2, image_size=16, worker_start=sys.argv[2])
dm.setup("fit")
loader = dm.train_dataloader()
batches = iter(loader)
next(batches)
print("workers", *[w.pid for w in loader._iterator._workers], flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_die_with_a_sigkilled_training_process(tiny_data, method):
    """Under forkserver a worker's parent is the fork server, which outlives a SIGKILLed trainer while any worker
    holds its alive pipe: without the worker's watch of the trainer, the workers ran on for ever."""
    proc = start_command([sys.executable, "-c", KILLED, str(tiny_data), method],
                         {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, session=True)
    try:
        line = ""
        while not line.startswith("workers"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"ended before its first batch: {proc.stdout.read()[-3000:]}"
        workers = [int(pid) for pid in line.split()[1:]]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 4
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if _alive(pid)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session: the trainer, a fork server, any worker left
        finish(proc, timeout=30)
    assert not left, f"workers {left} outlived the training process by 4 s ({method})"
