"""Imported by the fork server of --data.worker_start forkserver (datamodules/processes/start.py, PRELOAD): there, it
leaves the stop signals to the training process, as the workers do (datamodules/processes/loader_workers.py).

The server is the training process's child, in its process group: a stop signal to the group (`kill -TERM -PGID`,
SLURM's signals to a job step) reaches it too. It ignores SIGINT itself, not SIGTERM nor SIGUSR1
(multiprocessing/forkserver.py, `main`), and the training process learns its workers' exit codes from the server:
with the server gone, each of its workers reads as ended (Popen.poll gives 255, multiprocessing/popen_forkserver.py)
and the loader fails with "DataLoader worker (pid(s) ...) exited unexpectedly" before the trainer can save.
The server ends when every holder of its alive pipe's write end has closed it (`main` reads end-of-file): the
training process, each worker (`_serve_one` keeps the end it was sent), and any process forked from one of them
since. A process forked by Python forgets it (datamodules/processes/start.py, `_forget_the_parents_server`), but a
native library forking its own loader runs no Python at-fork handler: its child keeps the write end, and the server
(with the training process's stdout) outlived the script by as long as that child lived. So the server also asks
for a signal when its parent ends (prctl(PR_SET_PDEATHSIG), man 2 prctl) and then ends, whoever else
holds the pipe; its workers end with the training process by their own watch (loader_workers.py). The signal comes
when the *thread* that started the server ends, so the handler checks that the parent is gone (this process was
re-parented) before it ends the server; in a worker forked from the server the signal keeps its default action.

Anywhere else the import does nothing: it acts only while `multiprocessing.forkserver.main` imports it.
"""
from __future__ import annotations

import os
import signal
import sys

from datamodules.processes.loader_workers import STOP_SIGNALS


def in_fork_server_preload() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


PARENT_GONE = signal.SIGUSR2  # not one of STOP_SIGNALS, which the server ignores


def end_with_the_parent() -> None:
    """In the fork server, as early as it can: end it the moment the process that started it ends."""
    import ctypes

    server, parent = os.getpid(), os.getppid()

    def parent_gone(signum: int, frame) -> None:
        if os.getpid() != server:  # a worker forked from the server: the signal's default action, as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif os.getppid() != parent:
            os._exit(0)  # nothing to flush or clean: `main`'s own end on end-of-file runs no handler of its state

    signal.signal(PARENT_GONE, parent_gone)
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, PARENT_GONE)
    if os.getppid() != parent:  # the parent ended before the request: no signal will come
        os._exit(0)


if in_fork_server_preload():
    end_with_the_parent()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
