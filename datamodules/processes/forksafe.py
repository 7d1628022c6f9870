"""A worker forked from the training process never finalises its objects nor waits on its exit-handler lock.

Under `--data.worker_start fork`, DataLoader workers are forked from the training process. A DALI
pipeline owns native threads (its executor and thread pool); dropped by the parent, it can sit in a
reference cycle until the parent's next collection. A child forked meanwhile inherits that garbage
but not the threads, and the first collection in the child
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

Both matter only where a worker is forked from the training process: `--data.worker_start fork`
(datamodules/processes/start.py); `_loader` (datamodules/loaders.py) warms up only then. Under the default,
forkserver, a worker is forked from the fork server, which has no thread of the training process, no
DALI pipeline and no held lock; the server itself is started by fork + exec in C (`_posixsubprocess`,
no Python runs in that child). The collector is still frozen across every fork of this process (two
list moves), for `fork` and for any library that forks it.

CPython 3.10/3.11 have a third hazard under `fork`, left unpatched: a child forked while another thread holds
the runtime lock (`HEAD_LOCK`; gloo's threads take it without the GIL as they drop a tensor,
~AsyncWork -> decref_pyobject -> PyThreadState_New) waits on it for ever in `PyOS_AfterFork_Child`
(Modules/posixmodule.c; 3.12 remakes the lock first). It was once patched here by pthread_atfork handlers
that took the lock at a hard-coded offset of `_PyRuntime`; those could themselves deadlock when a native
thread without a Python thread state forked, and they protect nothing under forkserver. `--data.worker_start
fork` on 3.10/3.11 prints one start-up warning naming the hazard instead.
"""
from __future__ import annotations

import gc
import os
import weakref

import torch

_installed = False
_warmed: tuple[int, weakref.WeakSet] | None = None


def install() -> None:
    """Freeze the collector across every fork of this process (idempotent)."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork"):
        return
    # A process that froze objects itself finds them unfrozen after a fork: still correct, only less
    # memory shared with later children.
    os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
    _installed = True


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
