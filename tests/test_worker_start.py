"""--data.worker_start: every loader we make starts its workers by the named method, never the interpreter's default
(datamodules/processes/start.py), and a worker dies with the training process under each method
(datamodules/processes/loader_workers.py, `die_with_the_trainer`)."""
from __future__ import annotations

import json
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


LIKE_PY314 = ("import multiprocessing, runpy, sys\n"
              "multiprocessing.set_start_method('forkserver')  # Python 3.14's default on Linux, before anything else\n"
              "sys.argv = ['main.py', *sys.argv[1:]]\n"
              "runpy.run_path('main.py', run_name='__main__')\n")


@pytest.mark.slow
def test_a_forkserver_interpreter_default_changes_nothing(tiny_data, tmp_path):
    """A fit in an interpreter whose default start method is forkserver (as Python 3.14's on Linux), with
    --data.worker_start unset, starts its workers as the default run does and trains to the same losses."""
    from tests.helpers.cli import quick_args
    from tests.helpers.processes import finish_all

    def args(name: str) -> list[str]:
        return ["fit", *quick_args(tiny_data, tmp_path / name, epochs=1, batch=32), "--data.num_workers", "2",
                "--data.image_size", "16", "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0",
                "--checkpoint.monitor", "null", "--model.pictures", "[]",
                "--trainer.callbacks+=tests.helpers.callbacks.LossRecorder",
                f"--trainer.callbacks.out_dir={tmp_path / name / 'losses'}"]

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    procs = [start_command([sys.executable, "main.py", *args("default")], env),
             start_command([sys.executable, "-c", LIKE_PY314, *args("like314")], env)]
    codes, outs = finish_all(procs, timeout=300)
    assert codes == [0, 0], "\n---\n".join(out[-3000:] for out in outs)
    default, like314 = (json.loads((tmp_path / name / "losses" / "rank0.json").read_text())
                        for name in ("default", "like314"))
    assert default["start"] == like314["start"] == "forkserver"
    assert len(default["losses"]) == 7 and like314["losses"] == default["losses"]


GROUP_SIGNAL = r"""
import os, signal, sys
from datamodules import ImageFolderDataModule

got = []
signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))  # the training process decides (stop_signals.py)
dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=2, image_size=16, worker_start=sys.argv[2],
                           persistent_workers=False)
dm.setup("fit")
batches = iter(dm.train_dataloader())
next(batches)
os.killpg(0, signal.SIGTERM)
for _ in range(8):
    next(batches)
print("8 batches after", got)
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_deliver_after_a_stop_signal_to_the_group(tiny_data, method):
    """Under forkserver the fork server is in the group too: it must outlive the signal, or every worker reads as
    ended (its exit codes come from the server) and the loader fails before the trainer can save."""
    proc = start_command([sys.executable, "-c", GROUP_SIGNAL, str(tiny_data), method],
                         {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, session=True)
    code, out = finish(proc, timeout=120)
    assert code == 0 and "8 batches after ['SIGTERM']" in out, out[-3000:]


def test_an_index_reaches_a_worker_as_shared_memory_not_as_its_samples():
    """What a forkserver or spawned worker receives of a 200,000-sample Index (multiprocessing's ForkingPickler, with
    torch's reductions): its arrays' shared memory, a few KiB whatever the dataset's size; it reads the same
    samples, from the same pages."""
    from multiprocessing.reduction import ForkingPickler

    from datamodules.index import Index

    samples = [(f"train/n{c:08d}/n{c:08d}_{k}.JPEG", c) for c in range(100) for k in range(2000)]
    index = Index("/data", "train", [f"n{c:08d}" for c in range(100)], samples)
    sent = ForkingPickler.dumps(index)
    assert len(sent) < 16 * 1024, len(sent)  # the samples' paths alone are 5 MiB
    got = ForkingPickler.loads(sent)
    assert got == index and got.path(123_456) == "/data/" + samples[123_456][0]
    assert got.names.ctypes.data == index.names.ctypes.data  # in this process: the very same pages


def test_the_memory_plan_counts_each_workers_own_memory_and_the_fork_server():
    """A spawned worker is a whole interpreter with torch; the plan counts it, and caps the workers to the host
    budget; a forked or fork-server worker shares its pages."""
    from datamodules.budget.memory import FORK_SERVER_BYTES, GIB, WORKER_OWN_BYTES, Budget, plan_memory

    budget = Budget.from_gib(2, 4, 8)
    plans = {start: plan_memory(batch=32, train_size=224, val_size=224, workers=16, pin=True, budget=budget,
                                worker_start=start) for start in ("fork", "forkserver", "spawn")}
    assert all(p.host <= 8 * GIB for p in plans.values())
    assert plans["fork"].processes == 32 * WORKER_OWN_BYTES["fork"]  # train and val, 16 each
    assert plans["forkserver"].processes == 32 * WORKER_OWN_BYTES["forkserver"] + FORK_SERVER_BYTES
    spawned = plans["spawn"].loader("train").workers
    assert spawned < 16 and "memory budget" in plans["spawn"].describe()
    assert plans["spawn"].processes == 2 * spawned * WORKER_OWN_BYTES["spawn"]


class ReadsTheEnvironment:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> str:
        return os.environ.get("FIC_SET_AFTER_THE_SERVER", "unset")


def test_a_forkserver_worker_sees_a_variable_set_after_the_server_started(monkeypatch):
    """The fork server's children inherit its environment, as of its start (the data's setup); a variable set since
    (an object store's credentials in a notebook, a sweep's trial) reaches the worker through WorkerInit."""
    from torch.utils.data import DataLoader

    from datamodules.processes.loader_workers import WorkerInit
    from datamodules.processes.start import start_server_early, worker_context

    start_server_early("forkserver")
    monkeypatch.setenv("FIC_SET_AFTER_THE_SERVER", "seen")
    loader = DataLoader(ReadsTheEnvironment(), batch_size=2, num_workers=1, worker_init_fn=WorkerInit(),
                        multiprocessing_context=worker_context("forkserver"))
    assert next(iter(loader)) == ["seen", "seen"]


UNGUARDED = """
import sys
from datamodules import ImageFolderDataModule

dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=1, image_size=16)
if __name__ == "__main__":  # its loaders under the guard, its DataModule not (one unguarded all through starts its
    dm.setup("fit")         # workers by fork instead: tests/test_stdin_script.py)
    next(iter(dm.train_dataloader()))
"""


def test_a_script_without_a_main_guard_is_told_why_its_workers_end(tiny_data, tmp_path):
    """A forkserver worker imports the main script by its path; one that builds its DataModule outside
    `if __name__ == "__main__":` builds it again inside the worker. Without the paragraph, multiprocessing's
    RuntimeError about "bootstrapping" was all the worker said."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    proc = start_command([sys.executable, str(script), str(tiny_data)],
                         {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    code, out = finish(proc, timeout=120)
    assert code != 0
    assert f"A loader worker ran {script} again" in out and 'if __name__ == "__main__":' in out, out[-3000:]
    assert "bootstrapping phase" not in out, out[-3000:]


@pytest.mark.parametrize("backend", ["imagefolder", "downscaled-in-memory", "lmdb"])
def test_a_forkserver_worker_unpickles_each_backends_dataset_without_lightning(backend, tiny_data, tmp_path):
    """The fork server preloads torch and the sample path only (start.py, PRELOAD): a dataset that named a DataModule's
    module would make each worker import Lightning too, about 2 s on a 2-CPU machine."""
    from torch.utils.data import DataLoader

    from datamodules import DownscaledDataModule, LMDBDataModule
    from datamodules.processes.loader_workers import WorkerInit
    from datamodules.processes.start import worker_context
    from tests.helpers.worker_probe import lightning_imported

    common = {"batch_size": 8, "num_workers": 1, "image_size": 16}
    dm = {"imagefolder": lambda: ImageFolderDataModule(data_dir=str(tiny_data), **common),
          "downscaled-in-memory": lambda: DownscaledDataModule(str(tiny_data), max_size=24, in_memory=True,
                                                               cache_dir=str(tmp_path / "small"), **common),
          "lmdb": lambda: LMDBDataModule(str(tiny_data), cache_dir=str(tmp_path / "tiny.lmdb"), **common)}[backend]()
    dm.setup("fit")
    loader = DataLoader(dm.datasets["train"], batch_size=2, num_workers=1, collate_fn=lightning_imported,
                        worker_init_fn=WorkerInit(), multiprocessing_context=worker_context("forkserver"))
    assert next(iter(loader)) is False


FORKED_AFTER_THE_SERVER = r"""
import sys
from datamodules import ImageFolderDataModule
from datamodules.processes.start import start_server_early
from tests.helpers.processes import in_fork


def first_batch_shape(data):
    dm = ImageFolderDataModule(data_dir=data, batch_size=8, num_workers=1, image_size=16)
    dm.setup("fit")
    return list(next(iter(dm.train_dataloader()))[0].shape)


start_server_early("forkserver")
print("shape", in_fork(first_batch_shape, sys.argv[1]))
"""


def test_a_process_forked_after_the_server_started_starts_its_own(tiny_data):
    """A forked child inherits the parent's fork server's pid, which is not its child: without forgetting it at the
    fork, the child's first loader failed with ChildProcessError (a forked DDP rank, Lightning's ddp_fork).

    Forked from a fresh interpreter, not from pytest's: on 3.10/3.11 a fork waits for ever on a lock that another
    thread held at that instant (fork_hazard), and the pytest process holds the threads of the tests before it
    (sample pools, moto's server, tqdm's monitor); a child forked from it hung once in CI's quick tests."""
    proc = start_command([sys.executable, "-c", FORKED_AFTER_THE_SERVER, str(tiny_data)])
    code, out = finish(proc, timeout=180)
    assert code == 0 and "shape [8, 3, 16, 16]" in out, out[-3000:]
