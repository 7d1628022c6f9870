"""Loader workers started while another thread holds CPython's runtime lock must still deliver their batches, under
the default start method (forkserver, datamodules/processes/start.py) on Python 3.10 and 3.11.

There a child forked from the training process while a thread holds the lock waits on it for ever inside
`os.fork()` (`PyOS_AfterFork_Child`, Modules/posixmodule.c; datamodules/processes/forksafe.py). The child script takes
the lock itself and leaves its release to a thread that never holds the GIL, as torch's gloo threads do while they make
a thread state: a POSIX timer's SIGEV_THREAD calls `PyThread_release_lock` one second later. Its loaders, made with
--data.worker_start unset, start their workers within that second. Under forkserver no worker is forked from this
process (the server is started by fork + exec in C, and forks the workers from its own single thread), so they
deliver; a loader that fell back to forking from this process hangs its workers (the test then fails at 60 s).
`--data.worker_start fork` keeps that hazard, named by a start-up warning.
"""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.processes import finish, start_command

SCRIPT = r"""
import ctypes, sys
from datamodules import ImageFolderDataModule


def runtime_lock():
    # `_PyRuntime.interpreters.mutex` (Include/internal/pycore_runtime.h): after four ints and `_finalizing` in
    # 3.10, five in 3.11; checked by `interpreters.main`, which must be PyInterpreterState_Main().
    offset = {(3, 10): 0x18, (3, 11): 0x20}[sys.version_info[:2]]
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    main = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyInterpreterState_Main", ctypes.pythonapi))()
    assert main is not None and ctypes.c_void_p.from_address(runtime + offset + 16).value == main
    return ctypes.c_void_p.from_address(runtime + offset).value


dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=8, num_workers=2, image_size=16,
                           persistent_workers=False)
dm.setup("fit")
loaders = [dm.train_dataloader(), dm.val_dataloader()]
assert all(loader.multiprocessing_context.get_start_method() == "forkserver" for loader in loaders)
lock = runtime_lock()
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


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 10), (3, 11)), reason="CPython 3.12 remakes the runtime lock in "
                    "a forked child before it takes it (PyOS_AfterFork_Child): no hazard to show")
def test_default_workers_started_while_the_runtime_lock_is_held_deliver(tiny_data):
    proc = start_command([sys.executable, "-c", SCRIPT, str(tiny_data)], {**os.environ, "PYTHONPATH": str(REPO),
                          "PYTHONUNBUFFERED": "1"}, session=True)
    # about 10 s when it passes; a hung worker fails it at 60 s with every process's stack (finish, stop_tree)
    code, out = finish(proc, timeout=60)
    assert code == 0 and "first batches" in out, out[-3000:]
