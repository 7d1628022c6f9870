"""A forked child never finalises the parent's objects: the garbage collector is frozen across fork.

DataLoader workers are forked. A DALI pipeline owns native threads (its executor and thread pool);
dropped by the parent, it can sit in a reference cycle until the parent's next collection. A child
forked meanwhile inherits that garbage but not the threads, and the first collection in the child
runs the pipeline's finaliser: `Pipeline.Shutdown` -> `Executor2::Shutdown` -> `std::thread::join`
on a thread that does not exist there, and the worker dies of SIGSEGV ("DataLoader worker ... is
killed by signal: Segmentation fault"; nvidia/dali/libdali.so, seen in a core dump of the worker).
Any native object that owns threads (or locks held by them) has the same hazard.

So, around every fork (`os.register_at_fork`, which covers multiprocessing's fork start method):
the parent calls `gc.freeze()` just before it, which moves every object it tracks into the
permanent generation, and `gc.unfreeze()` just after, so its own collector sees them again. The
child keeps them frozen: its collector only ever looks at objects the child made, and the parent's
garbage is finalised in the parent, where its threads are. Freezing and unfreezing move list heads
(O(1)); Python's gc documentation recommends the same freeze before fork for copy-on-write memory.

A forked child must also never call glibc's `__cxa_atexit`: glibc's fork does not reset
`__exit_funcs_lock` in the child (stdlib/cxa_atexit.c, posix/fork.c), so if any thread of the
parent was registering an exit handler at that moment, the child's first registration waits on
the lock forever (a DataLoader worker at 0% CPU, its rank waiting for its first batch, the other
rank timing out in a collective). C++ registers one on the first use of each function-local static
with a destructor: every PyTorch Python binding's argument parser (torch/csrc/autograd/generated/
python_*_functions.cpp, `static PythonArgParser parser`), every operator's handle
(at::_ops::NAME::call), caffe2's thread pool (`caffe2::pthreadpool()`, first reached through
`at::set_num_threads` in torch/utils/data/_utils/worker.py, `_worker_loop`). `warm_before_fork`
makes them here, before the loader forks, so a worker finds them made.

On Python 3.10 and 3.11 a forked child must also never be forked while another thread holds CPython's
runtime lock (`HEAD_LOCK`, `_PyRuntime.interpreters.mutex`): `PyOS_AfterFork_Child` (Modules/posixmodule.c)
takes it in `_PyEval_ReInitThreads` -> `_PyThreadState_DeleteExcept` before `_PyRuntimeState_ReInitThreads`
makes it new (3.12 swapped the two), so the child waits on it forever inside `os.fork()`. A thread holds it
without the GIL while it makes its thread state: torch's gloo threads do, each time they drop a tensor that
has a Python object (c10d ProcessGroupGloo::runLoop -> ~AsyncWork -> TensorImpl::decref_pyobject ->
pybind11::gil_scoped_acquire -> PyThreadState_New), so a loader forked just after a collective could hang.
`install` registers pthread_atfork handlers that take the lock just before the fork (waiting for such a
thread, with the GIL held, so no other can start) and give it back on both sides just after, before the
child's `PyOS_AfterFork_Child`. The handlers are C calls only (ctypes functions bound by functools.partial):
no Python bytecode runs in the child before CPython has remade its GIL. They assume the forking thread
holds the GIL, as every fork Python makes does (`os.fork`, `_posixsubprocess`; vfork runs no handlers).
"""
from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
import weakref

import torch

_installed = False
_warmed: tuple[int, weakref.WeakSet] | None = None
_fork_handlers: tuple | None = None  # the ctypes callbacks pthread_atfork holds: they must stay alive


def install() -> None:
    """Freeze the collector across every fork of this process (idempotent)."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork"):
        return
    # A process that froze objects itself finds them unfrozen after a fork: still correct, only less
    # memory shared with later children.
    os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
    if sys.platform.startswith("linux"):  # a no-op where the lock is not laid out as checked (3.12+ needs none)
        hold_runtime_lock_across_fork()
    _installed = True


# Where `_PyRuntimeState.interpreters` {mutex, head, main} starts (Include/internal/pycore_runtime.h):
# after four ints and `_finalizing` in 3.10, after five ints and `_finalizing` in 3.11.
_INTERPRETERS_OFFSET = {(3, 10): 0x18, (3, 11): 0x20}


def runtime_lock() -> ctypes.c_void_p | None:
    """CPython's `_PyRuntime.interpreters.mutex` as a live view (its value is read at each use), or None
    where this interpreter is not laid out as checked: `interpreters.main` must be `PyInterpreterState_Main()`."""
    offset = _INTERPRETERS_OFFSET.get(sys.version_info[:2])
    if offset is None:
        return None
    try:
        runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
        main = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyInterpreterState_Main", ctypes.pythonapi))()
    except (AttributeError, ValueError):
        return None
    if main is None or ctypes.c_void_p.from_address(runtime + offset + 16).value != main:
        return None
    return ctypes.c_void_p.from_address(runtime + offset)


def hold_runtime_lock_across_fork() -> bool:
    """Take CPython's runtime lock in every fork's prepare step and give it back in the parent and the
    child (see the module doc). False where the lock cannot be found (the fork stays as it was)."""
    global _fork_handlers
    lock = runtime_lock()
    if lock is None:
        return False
    api = ctypes.pythonapi  # PyDLL: the GIL stays held during these calls
    acquire = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)(("PyThread_acquire_lock", api))
    release = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(("PyThread_release_lock", api))
    handler = ctypes.CFUNCTYPE(None)
    prepare = handler(functools.partial(acquire, lock, 1))
    parent = child = handler(functools.partial(release, lock))
    libc = ctypes.CDLL(None)
    try:  # glibc keeps pthread_atfork in libc_nonshared.a; it calls __register_atfork(..., dso_handle=NULL)
        register = libc.__register_atfork
        register.argtypes = [handler, handler, handler, ctypes.c_void_p]
        status = register(prepare, parent, child, None)
    except AttributeError:  # musl exports pthread_atfork itself
        register = libc.pthread_atfork
        register.argtypes = [handler, handler, handler]
        status = register(prepare, parent, child)
    if status != 0:
        return False
    _fork_handlers = (prepare, parent, child)
    return True


def warm_before_fork(dataset: object) -> None:
    """Run, in this process, the C++ first uses a loader worker of `dataset` would (see the module doc).

    Once per process and dataset; only a dataset with a `warm_up()` (datamodules/sample/dataset.py) runs
    samples. The RNG state of this process is left as it was.
    """
    global _warmed
    if _warmed is None or _warmed[0] != os.getpid():
        _warmed = (os.getpid(), weakref.WeakSet())
        # The worker sets 1 thread (torch/utils/data/_utils/worker.py, `_worker_loop`); the same count here
        # changes nothing (OpenMP backend: omp/mkl counts and caffe2's pool, which drops its inherited
        # threads in a child, caffe2/utils/threadpool/pthreadpool-cpp.cc `child_atfork`; native backend:
        # no-op for an unchanged count, aten/src/ATen/ParallelNative.cpp `set_num_threads`).
        torch.set_num_threads(torch.get_num_threads())
        # What every worker runs besides the dataset: torch's and torchdata's `_worker_loop` make a
        # torch.Generator; a batch is pickled by torch/multiprocessing/reductions.py `reduce_tensor`
        # (size, stride, storage_offset); SampleDataset.state_dict and load_state_dict (torchdata) go through
        # numpy, frombuffer and set_rng_state, here with this process's own state.
        torch.Generator()
        state = torch.get_rng_state()
        state.size(), state.stride(), state.storage_offset()
        torch.set_rng_state(torch.frombuffer(bytearray(state.numpy().tobytes()), dtype=torch.uint8))
    if dataset in _warmed[1] or not hasattr(dataset, "warm_up"):
        return
    with torch.random.fork_rng(devices=[]):
        dataset.warm_up()
    _warmed[1].add(dataset)
