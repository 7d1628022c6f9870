"""How loader workers start: one explicit policy (`--data.worker_start`) for every DataLoader we make.

No loader may fall back to the interpreter's default start method: Python 3.14 made it forkserver on Linux
(3.13 and older: fork), which would change, silently and for every loader at once, what a worker costs (the
dataset pickled to each worker instead of shared copy-on-write), which process a worker's PR_SET_PDEATHSIG
watches, and which fork hazards apply. So the loaders of `datamodules/` take `multiprocessing_context=` from
`worker_context(name)`, and the start-up line names the method.

- forkserver (the default): workers are forked from one single-threaded server process that imported the
  worker's modules once (`set_forkserver_preload`). No native thread of the training process (gloo, DALI,
  torch's pools) exists there, so no lock they hold is copied into a worker; each worker gets the dataset
  pickled (datamodules/index.py keeps the Index compact for that). The server reads, at each start, the
  training process's sys.path, working folder and main module (multiprocessing/spawn.py, `prepare`), but its
  environment is the training process's as of the server's start (the data's setup; `WorkerInit` gives each worker
  the environment of its loader's making).
- fork: workers are forked from the training process itself (copy-on-write, no pickling, the fastest start),
  with the hazards datamodules/forksafe.py names; on Python 3.10/3.11 a thread holding CPython's runtime lock
  at the fork hangs the worker (warned once at start-up).
- spawn: a fresh interpreter per worker: the slowest start, every import paid by each worker.

A worker dies with the training process under each method (datamodules/processes/loader_workers.py,
`die_with_the_trainer`), and takes the training process's environment as of its loader's making (`WorkerInit`).
"""
from __future__ import annotations

import multiprocessing
import sys
from multiprocessing.context import BaseContext
from typing import Literal

from datamodules.errors import DataError

WorkerStart = Literal["forkserver", "fork", "spawn"]
START_METHODS: tuple[str, ...] = ("forkserver", "fork", "spawn")
DEFAULT_START: WorkerStart = "forkserver"
# Imported once by the fork server, so a worker forked from it finds them imported (torch alone is ~1 s).
# The first ignores the stop signals, in the server only (datamodules/processes/fork_server.py).
PRELOAD = ("datamodules.processes.fork_server", "torch", "datamodules", "datamodules.base",
           "datamodules.processes.loader_workers")
_warned_fork = False


def check_start(name: str) -> str:
    if name not in START_METHODS:
        raise DataError(f"data.worker_start must be one of {', '.join(START_METHODS)}, got {name!r}.")
    return name


def worker_context(name: str, preload: tuple[str, ...] = ()) -> BaseContext:
    """The multiprocessing context loader workers start with. For forkserver, the modules the server imports
    before its first fork (only the first call of a process counts: the server starts once)."""
    ctx = multiprocessing.get_context(check_start(name))
    if name == "forkserver":
        ctx.set_forkserver_preload(list(dict.fromkeys(PRELOAD + tuple(preload))))
    elif name == "fork":
        from datamodules import forksafe

        forksafe.install()  # the collector frozen across the training process's forks (forksafe.py)
        warn_fork_hazard()
    return ctx


def start_server_early(name: str, preload: tuple[str, ...] = ()) -> None:
    """Under forkserver, start the fork server now, so that its imports (torch, datamodules: seconds) run while the
    training process scans its data and builds the model, not while it waits for its first batch.
    `ensure_running` returns once the server is launched, before it has imported anything
    (multiprocessing/forkserver.py); the first worker's start waits for it then."""
    if name == "forkserver":
        from multiprocessing import forkserver

        worker_context(name, preload)
        forkserver.ensure_running()


def fork_hazard() -> str | None:
    """The start-up warning of `--data.worker_start fork` where this Python has the hazard (3.10, 3.11)."""
    if sys.version_info[:2] not in ((3, 10), (3, 11)):
        return None
    return ("data.worker_start fork: on Python 3.10/3.11 a loader worker forked while another thread of the "
            "training process holds CPython's runtime lock (gloo's threads take it as they drop a tensor) hangs "
            "for ever inside os.fork(); --data.worker_start forkserver (the default) forks workers from a "
            "single-threaded server instead.")


def warn_fork_hazard() -> None:
    global _warned_fork
    said = fork_hazard()
    if said and not _warned_fork:
        _warned_fork = True
        from pytorch_lightning.utilities import rank_zero_warn

        rank_zero_warn(said)
