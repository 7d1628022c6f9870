"""A DataLoader worker forked while another thread holds CPython's runtime lock must still deliver its batches
(Python 3.10 and 3.11: datamodules/forksafe.py, `hold_runtime_lock_across_fork`).

The child script takes the lock itself and leaves its release to a thread that never holds the GIL, as torch's
gloo threads do while they make a thread state: a POSIX timer's SIGEV_THREAD calls `PyThread_release_lock`
one second later. Its loaders fork their workers within that second. Without the fork handlers each worker
waits on its copy of the lock inside `os.fork()` forever; with them the fork waits for the release, so the
result does not depend on timing.
"""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.processes import finish, start_command

SCRIPT = r"""
import ctypes, sys
from datamodules import ImageFolderDataModule, forksafe

dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=2, image_size=16,
                           persistent_workers=False)
dm.setup("fit")
loaders = [dm.train_dataloader(), dm.val_dataloader()]
lock = forksafe.runtime_lock().value
libc = ctypes.CDLL(None)
acquire = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)(("PyThread_acquire_lock", libc))

class SigEvent(ctypes.Structure):  # struct sigevent with SIGEV_THREAD (glibc, x86_64 and aarch64)
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("pad", ctypes.c_char * 32)]

class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", ctypes.c_long * 2), ("value", ctypes.c_long * 2)]

release = ctypes.cast(libc.PyThread_release_lock, ctypes.c_void_p).value
event, timer = SigEvent(value=lock, notify=2, function=release), ctypes.c_void_p()  # 2: SIGEV_THREAD
assert libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0  # 1: CLOCK_MONOTONIC
assert acquire(lock, 1) == 1
assert libc.timer_settime(timer, 0, ctypes.byref(ITimerSpec(value=(1, 0))), None) == 0
for loader in loaders:
    next(iter(loader))
print("first batches")
"""


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 remakes the runtime lock in a forked "
                    "child before it takes it (PyOS_AfterFork_Child): nothing to hold across the fork")
def test_workers_forked_while_the_runtime_lock_is_held_deliver(tiny_data):
    proc = start_command([sys.executable, "-c", SCRIPT, str(tiny_data)], {**os.environ, "PYTHONPATH": str(REPO),
                          "PYTHONUNBUFFERED": "1"}, session=True)
    # about 6 s when it passes; a hung worker fails it at 60 s with every process's stack (finish, stop_tree)
    code, out = finish(proc, timeout=60)
    assert code == 0 and "first batches" in out, out[-3000:]
