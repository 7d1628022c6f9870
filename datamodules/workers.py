"""Loader worker processes leave stop signals to the training process.

A signal to the whole process group (`timeout`, `kill -TERM -PGID`, a container stop, SLURM's signals to a job
step, Ctrl-C) reaches every loader worker too. torch's worker handler for SIGTERM ends the worker
(torch/utils/data/_utils/signal_handling.py, `_set_worker_signal_handlers`, installed before `worker_init_fn` runs in
_utils/worker.py), and the training process then fails with "DataLoader worker (pid N) is killed by signal:
Terminated" before it can save. Ignoring SIGTERM, SIGINT and SIGUSR1 in the workers leaves the decision to the
training process (lightning_app/callbacks/stop_signals.py), which stops its loaders itself: DataLoader's shutdown
sets the workers' done event and joins them (dataloader.py, `_shutdown_workers`), and a worker whose parent is gone
ends at its next check (worker.py, `ManagerWatchdog`).
"""
from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def leave_stop_signals_to_the_trainer(_worker_id: int | None = None) -> None:
    """A DataLoader's `worker_init_fn` (or the first call of a worker's callback): ignore the stop signals."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


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
