"""How loader workers start: one explicit policy (`--data.worker_start`) for every DataLoader we make.

No loader may fall back to the interpreter's default start method: Python 3.14 made it forkserver on Linux
(3.13 and older: fork), which would change, silently and for every loader at once, what a worker costs (the
dataset pickled to each worker instead of shared copy-on-write), which process a worker's PR_SET_PDEATHSIG
watches, and which fork hazards apply. So the loaders of `datamodules/` take `multiprocessing_context=` from
`worker_context(name)`, and the start-up line names the method.

- forkserver (the default): workers are forked from one single-threaded server process that imported the
  worker's modules once (`set_forkserver_preload`). No native thread of the training process (gloo, DALI,
  torch's pools) exists there, so no lock they hold is copied into a worker; each worker gets the dataset
  pickled (the Index's arrays as shared memory, datamodules/index.py). The server reads, at each start, the
  training process's sys.path, working folder and main module (multiprocessing/spawn.py, `prepare`), but its
  environment is the training process's as of the server's start (the data's setup; `WorkerInit` gives each worker
  the environment of its loader's making).
- fork: workers are forked from the training process itself (copy-on-write, no pickling, the fastest start),
  with the hazards datamodules/processes/forksafe.py names; on Python 3.10/3.11 a thread holding CPython's runtime lock
  at the fork hangs the worker (warned once at start-up).
- spawn: a fresh interpreter per worker: the slowest start, every import paid by each worker.

A worker dies with the training process under each method (datamodules/processes/loader_workers.py,
`die_with_the_trainer`), and takes the training process's environment as of its loader's making (`WorkerInit`).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
from multiprocessing.context import BaseContext
from typing import Literal

from datamodules.errors import DataError

WorkerStart = Literal["forkserver", "fork", "spawn"]
START_METHODS: tuple[str, ...] = ("forkserver", "fork", "spawn")
DEFAULT_START: WorkerStart = "forkserver"
# Imported once by the fork server, so a worker forked from it finds them imported: torch, the sample path and the
# worker's loop, what every dataset of ours needs to unpickle. Not Lightning nor the DataModules (2 s more on a 2-CPU
# machine): a worker needs neither, as its dataset names only these modules (tests/test_worker_start.py checks it).
# The first module ignores the stop signals, in the server only (datamodules/processes/fork_server.py).
PRELOAD = ("datamodules.processes.fork_server", "torch", "datamodules.sample.dataset",
           "datamodules.processes.loader_workers", "torchdata.stateful_dataloader")
_warned_fork = False
_forgets_in_children = False


def check_start(name: str) -> str:
    if name not in START_METHODS:
        raise DataError(f"data.worker_start must be one of {', '.join(START_METHODS)}, got {name!r}.")
    leave_a_worker_rerunning_the_main_script()
    return name


def leave_a_worker_rerunning_the_main_script() -> None:
    """In a loader worker that is running the user's main script again: say why, and end it.

    A forkserver or spawned worker imports the main script by its path before it unpickles its dataset, so that
    names defined there resolve (multiprocessing/spawn.py, `prepare` -> `_fixup_main_from_path`). A script whose
    code is not under `if __name__ == "__main__":` then builds its DataModule again inside the worker; multiprocessing
    refuses to start processes from there with a RuntimeError per worker, and the loader says only that its workers
    "exited unexpectedly". `_inheriting` is the flag multiprocessing sets for that phase (`spawn._main`)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        main = _script_being_run() or "the main script"
        sys.stderr.write(
            f"A loader worker ran {main} again: with --data.worker_start forkserver (the default) or spawn, each "
            "worker imports the main script, and this one builds its DataModule at import. Put the script's code "
            "under `if __name__ == \"__main__\":`, or pass --data.worker_start fork (worker_start=\"fork\").\n")
        sys.stderr.flush()
        os._exit(2)


def worker_context(name: str) -> BaseContext:
    """The multiprocessing context loader workers start with. For forkserver, the modules the server imports
    before its first fork (only the first call of a process counts: the server starts once)."""
    global _forgets_in_children
    name = check_start(name)
    if name != "fork" and (main_not_a_file() is not None or unguarded_main() is not None):
        name = "fork"  # the one start that does not import the main script again
        warn_main_not_a_file()
    ctx = multiprocessing.get_context(name)
    if name == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
        if not _forgets_in_children:
            os.register_at_fork(after_in_child=_forget_the_parents_server)
            _forgets_in_children = True
    elif name == "fork":
        from datamodules.processes import forksafe

        forksafe.install()  # the collector frozen across the training process's forks (forksafe.py)
        warn_fork_hazard()
    return ctx


def start_server_early(name: str) -> None:
    """Under forkserver, start the fork server now, so that its imports (torch, datamodules: seconds) run while the
    training process scans its data and builds the model, not while it waits for its first batch.
    `ensure_running` returns once the server is launched, before it has imported anything
    (multiprocessing/forkserver.py); the first worker's start waits for it then."""
    if name == "forkserver" and main_not_a_file() is None and unguarded_main() is None:
        from multiprocessing import forkserver

        worker_context(name)
        forkserver.ensure_running()


def _forget_the_parents_server() -> None:
    """In a process forked from one that had started the fork server (Lightning's ddp_fork, a forked test rank): it
    inherits that server's pid, socket and "alive" pipe, and `ensure_running` would `waitpid` a process that is not
    its child and fail with ChildProcessError (multiprocessing/forkserver.py). It forgets them, and starts a server
    of its own when it needs one; its lock is made new too, as another thread may have held it at the fork."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    server._lock = threading.Lock()
    alive = server._forkserver_alive_fd
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)  # the parent's server ends with the parent, not with this process


def _script_being_run() -> str | None:
    """The file of the outermost module-level frame that is a script (not runpy's, not frozen)."""
    frame, scripts = sys._getframe(1), []
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and code.co_filename.endswith(".py") and "runpy" not in code.co_filename:
            scripts.append(code.co_filename)
        frame = frame.f_back
    return scripts[-1] if scripts else None


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


def main_not_a_file() -> str | None:
    """The main module's `__file__` when it names no file a worker could import again (`python - <<EOF`: '<stdin>'),
    else None. A forkserver or spawned worker runs the main module from that path (multiprocessing/spawn.py,
    `get_preparation_data` -> `_fixup_main_from_path`), which fails in every worker with FileNotFoundError."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if isinstance(path, str) and not os.path.isfile(path) else None


_warned_main = False


def warn_main_not_a_file() -> None:
    global _warned_main
    if not _warned_main:
        _warned_main = True
        import warnings

        not_a_file = main_not_a_file()
        why = (f"The main script is {not_a_file}, not a file, which a forkserver or spawned loader worker would "
               "import again and cannot" if not_a_file else
               f"{unguarded_main()} makes its loaders at import, outside `if __name__ == \"__main__\":`, and a "
               "forkserver or spawned loader worker imports the main script again: it would make them again")
        warnings.warn(f"{why}: its loader workers start by fork instead. To keep the fork server, run the script from "
                      "a file with its code under `if __name__ == \"__main__\":`; worker_start=\"fork\" chooses fork.",
                      stacklevel=3)


def unguarded_main() -> str | None:
    """The main script's path when the code running now was called from its module level outside an
    `if __name__ == "__main__":` block (read from the script's syntax tree), else None: a forkserver or spawned
    worker would run that code again as it imports the script (leave_a_worker_rerunning_the_main_script)."""
    import ast

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") ==
                                     "__main__" and frame.f_code.co_filename == frame.f_globals.get("__file__")):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, "rb") as script:
            tree = ast.parse(script.read())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            return None
    return path
