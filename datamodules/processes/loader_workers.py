"""Loader worker processes leave stop signals to the training process.

A signal to the whole process group (`timeout`, `kill -TERM -PGID`, a container stop, SLURM's signals to a job
step, Ctrl-C) reaches every loader worker too. torch's worker handler for SIGTERM ends the worker
(torch/utils/data/_utils/signal_handling.py, `_set_worker_signal_handlers`, installed before `worker_init_fn` runs in
_utils/worker.py), and the training process then fails with "DataLoader worker (pid N) is killed by signal:
Terminated" before it can save. Ignoring SIGTERM, SIGINT and SIGUSR1 in the workers leaves the decision to the
training process (lightning_app/callbacks/stop_signals.py), which stops its loaders itself: DataLoader's shutdown
sets the workers' done event and joins them (dataloader.py, `_shutdown_workers`), and a worker whose parent is gone
ends at its next check (worker.py, `ManagerWatchdog`).

A worker dies with the training process (`die_with_the_trainer`) under every start method
(datamodules/processes/start.py). Forked or spawned, the worker is the training process's child: PR_SET_PDEATHSIG,
set here, kills it when the thread that started it ends. Under forkserver it is the fork server's child, and both
checks of the parent watch the server: PR_SET_PDEATHSIG, and torch's `ManagerWatchdog`, which compares
`os.getppid()` with the parent pid it saw at the worker's start (worker.py). The server outlives the training
process: it ends when every holder of its "alive" pipe has closed it (multiprocessing/forkserver.py, `main`), and
each worker it forked holds one (`_serve_one` keeps `_forkserver_alive_fd`), so a SIGKILLed trainer left its
workers running for ever. There a thread of the worker waits on `multiprocessing.parent_process().sentinel`, the
read end of a pipe whose write end only the training process holds (multiprocessing/popen_forkserver.py keeps
`_parent_w`), and SIGKILLs the worker when it reads end-of-file. Such a worker sets no PR_SET_PDEATHSIG: a stop
signal to the process group ends the fork server (multiprocessing/forkserver.py ignores SIGINT only), and with
it every worker that watched the server, before the training process could save.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_JOIN_S = 2.0  # what a worker gets to end by itself when the training process exits
_exit_guard = False


def leave_stop_signals_to_the_trainer(worker_id: int | None = None) -> None:
    """A DataLoader's `worker_init_fn` (or the first call of a worker's callback): ignore the stop signals.

    Lightning adds its own `pl_worker_init_function` (each worker's seed) only to a loader without a
    `worker_init_fn` (lightning_fabric/utilities/data.py, `_auto_add_worker_init_fn`): called here instead.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # and dies with the training process: one SIGKILLed (by its tool, the OOM killer, a scheduler) would otherwise
    # leave its workers running until torch's watchdog notices, up to 5 s later (worker.py, MP_STATUS_CHECK_INTERVAL)
    from datamodules.processes.exits import die_with_parent

    if not die_with_the_trainer():  # this worker is the training process's own child
        die_with_parent()
    if worker_id is not None and int(os.environ.get("PL_SEED_WORKERS", "0")):
        from lightning_fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id)


class WorkerInit:
    """The `worker_init_fn` of every loader the datamodules make: the training process's environment and Pillow
    pixel limit as of the loader's making, then `leave_stop_signals_to_the_trainer`.

    A worker forked from the fork server (--data.worker_start forkserver) inherits the server's environment, which
    is the training process's as of the server's start (datamodules/processes/start.py), not as of the loader's: a
    variable set since (credentials for an object store, PL_SEED_WORKERS) would be missing in the worker.
    """

    def __init__(self) -> None:
        from PIL import Image

        self.environ = dict(os.environ)
        self.max_image_pixels = Image.MAX_IMAGE_PIXELS  # --data.max_image_pixels (datamodules/sample/pixel_limit.py)

    def __call__(self, worker_id: int | None = None) -> None:
        from PIL import Image

        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        leave_stop_signals_to_the_trainer(worker_id)


def die_with_the_trainer() -> bool:
    """In a worker whose parent is not the process that started it (a fork server's child): SIGKILL this worker
    when that process ends (see the module doc). True when a watch was started."""
    trainer = multiprocessing.parent_process()
    if trainer is None or trainer.pid == os.getppid() or trainer.sentinel is None:
        return False
    threading.Thread(target=_kill_self_at_end_of, args=(trainer.sentinel,), name="watch-trainer", daemon=True).start()
    return True


def _kill_self_at_end_of(sentinel: int) -> None:
    wait([sentinel])  # end-of-file: every holder of the write end (the training process alone) has ended
    os.kill(os.getpid(), signal.SIGKILL)


def end_stuck_workers_at_exit() -> None:
    """In the training process: at exit, a loader worker still alive after EXIT_JOIN_S is SIGKILLed.

    multiprocessing's own exit handler ends daemonic children with SIGTERM, then joins them without a timeout
    (multiprocessing/util.py, `_exit_function`), and so does DataLoader's shutdown for a worker that does not end
    (dataloader.py, `_shutdown_workers`): a worker that ignores SIGTERM and is stuck in a read would hold the exit
    for ever. atexit runs the handlers last registered first, so this runs before multiprocessing's.
    """
    global _exit_guard
    if not _exit_guard:
        _exit_guard = True
        atexit.register(_end_stuck_workers)


def _end_stuck_workers() -> None:
    deadline = time.monotonic() + EXIT_JOIN_S
    for child in multiprocessing.active_children():
        if child.daemon:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()


class InWorkersOnly:
    """Calls `leave_stop_signals_to_the_trainer` once in any process other than the one that made it: for a
    callback that a library runs in worker processes of its own (DALI's parallel external source)."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.done_in: int | None = None

    def __call__(self) -> None:
        pid = os.getpid()
        if pid != self.owner and self.done_in != pid:
            leave_stop_signals_to_the_trainer()
            self.done_in = pid
