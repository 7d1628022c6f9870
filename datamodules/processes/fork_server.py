"""Imported by the fork server of --data.worker_start forkserver (datamodules/processes/start.py, PRELOAD): there, it
leaves the stop signals to the training process, as the workers do (datamodules/processes/loader_workers.py).

The server is the training process's child, in its process group: a stop signal to the group (`kill -TERM -PGID`,
SLURM's signals to a job step) reaches it too. It ignores SIGINT itself, not SIGTERM nor SIGUSR1
(multiprocessing/forkserver.py, `main`), and the training process learns its workers' exit codes from the server:
with the server gone, each of its workers reads as ended (Popen.poll gives 255, multiprocessing/popen_forkserver.py)
and the loader fails with "DataLoader worker (pid(s) ...) exited unexpectedly" before the trainer can save.
The server still ends when the training process and its workers have (its alive pipe reads end-of-file).

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


if in_fork_server_preload():
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
