"""A DataLoader worker forked while a thread of the training process holds glibc's `__exit_funcs_lock` must
still deliver its batches: under --data.worker_start fork it must never call `__cxa_atexit`
(datamodules/processes/forksafe.py, `warm_before_fork`); under forkserver it is never forked from the training process.

A helper thread of the child script keeps the lock held almost all the time: glibc's `__cxa_finalize` walks
every registered exit handler under the lock (stdlib/cxa_finalize.c), and half a million handlers of a dummy
"DSO" make each walk long next to the gap between walks. Without the warm-up nearly every worker is forked
with the lock held and waits on it forever at its first C++ static (a worker at 0% CPU, a loader waiting for
its first batch); with it, a worker never takes the lock, so the result does not depend on timing.
"""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.processes import finish, start_command

SCRIPT = r"""
import ctypes, sys, threading
from datamodules import ImageFolderDataModule

dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=2, image_size=16,
                           persistent_workers=False, worker_start=sys.argv[2])
dm.setup("fit")
loaders = [dm.train_dataloader(), dm.val_dataloader()]
libc = ctypes.CDLL(None)
register, finalize = libc.__cxa_atexit, libc.__cxa_finalize
register.argtypes = [ctypes.c_void_p] * 3
finalize.argtypes = [ctypes.c_void_p]
handler = ctypes.cast(libc.getpid, ctypes.c_void_p)  # run at exit: harmless
dso, nobody = ctypes.create_string_buffer(1), ctypes.create_string_buffer(1)
for _ in range(500_000):
    register(handler, None, ctypes.addressof(dso))
done = threading.Event()

def hold():
    while not done.is_set():
        finalize(ctypes.addressof(nobody))  # no handler belongs to `nobody`: a walk under the lock, nothing run

sys.setswitchinterval(1e-5)  # the walker gets the GIL back at once between walks
threading.Thread(target=hold, daemon=True).start()
for loader in loaders:
    next(iter(loader))
done.set()
print("first batches")
"""


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_forked_while_the_exit_handler_lock_is_held_deliver(tiny_data, method):
    """fork: the warm-up keeps the workers off the lock; forkserver (the default): no worker is forked from this
    process, and the training process runs no warm-up (datamodules/base.py, `_loader`)."""
    proc = start_command([sys.executable, "-c", SCRIPT, str(tiny_data), method], {**os.environ, "PYTHONPATH": str(REPO),
                          "PYTHONUNBUFFERED": "1"}, session=True)
    # about 5 s when it passes; a hung worker fails it at 60 s with every process's stack (finish, stop_tree)
    code, out = finish(proc, timeout=60)
    assert code == 0 and "first batches" in out, out[-3000:]
