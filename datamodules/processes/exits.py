"""How every command-line tool ends (`python -m datamodules.*`, `python -m bench`): bad input in one paragraph with
exit status 2, Ctrl-C in one line with exit status 130, SIGTERM in one line with exit status 143, never a traceback.

Ctrl-C reaches the whole process group: the tool's worker processes ignore it (`ignore_stop_signals`, a pool's
initializer), so the tool's own process stops once and tears its pools down as the KeyboardInterrupt unwinds
through their `with` blocks (multiprocessing's Pool.terminate sends SIGTERM, which ends a worker at once).
SIGTERM does not unwind: raising an exception from a SIGTERM handler at an arbitrary point was seen to be swallowed
inside a lock release and to leave the tool waiting on workers the same signal had killed. Its handler
(`_end_on_sigterm`) takes no lock and waits for nothing: it SIGKILLs the tool's descendants (found in /proc), writes
its line with os.write and leaves by os._exit(143). What the tools write is written atomically (a temporary name
renamed into place, or a packer's resumable partial state), so a rerun never uses half of it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from datamodules.errors import DataError

EXIT_BAD_INPUT = 2
QUIET_S = 0.25  # no descendant seen for this long: none is being forked any more


def ignore_stop_signals() -> None:
    """For a worker process: Ctrl-C and SIGHUP are the main process's to decide, and SIGTERM ends the worker at
    once, without a traceback (SIGTERM is also how multiprocessing's Pool.terminate stops its workers). The worker
    dies with the tool (`die_with_parent`): one a pool forks in place of a dead one while the tool is ending
    would otherwise outlive it."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (prctl(PR_SET_PDEATHSIG), man 2 prctl), even by
    SIGKILL, which no handler sees. For a child: a pool's initializer, or a subprocess's preexec_fn."""
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def run_tool(name: str, main: Callable[[], int | None], on_stop: str = "",
             bad_input: tuple[type[BaseException], ...] | None = None) -> int:
    """Run a tool's `main` and return its exit status; `on_stop` says what a rerun does after a stop. Bad input:
    `bad_input`, by default the data's DataError and a file system error (naming its path)."""
    if bad_input is None:
        bad_input = (DataError, OSError)
    try:
        with _sigterm_ends(name, on_stop):
            return int(main() or 0)
    except KeyboardInterrupt as stop:
        # Ctrl-C, or a signal a tool turns into KeyboardInterrupt("SIGTERM") to unwind (bench nodes)
        said = str(stop.args[0]) if stop.args else ""
        signum = signal.Signals[said] if said in signal.Signals.__members__ else signal.SIGINT
        print(f"{name}: stopped by {signum.name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}"
              f"{'; ' + on_stop if on_stop else ''}.", file=sys.stderr, flush=True)
        return 128 + signum
    except bad_input as error:
        print(f"{name}: {describe(error)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


def tool(name: str, on_stop: str = "") -> Callable:
    """Decorates a tool's `main(argv)`: `run_tool` around it, then SystemExit with its status unless that is 0."""

    def wrap(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], None]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> None:
            code = run_tool(name, lambda: main(argv), on_stop)
            if code:
                raise SystemExit(code)

        return run

    return wrap


def describe(error: BaseException) -> str:
    """The paragraph for bad input: the error's own message, or for a file system error the path and the reason."""
    if isinstance(error, (FileExistsError, NotADirectoryError)) and error.filename:
        return f"cannot make a folder at or under {error.filename}: a file of that name is in the way."
    if isinstance(error, OSError) and error.filename:
        return f"cannot use {error.filename}: {error.strerror or error}."
    return str(error).strip() or type(error).__name__


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children first), read from /proc/<pid>/stat's ppid field (man 5 proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
        except OSError:  # ended meanwhile
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # after the command name, which may hold spaces
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


@contextlib.contextmanager
def _sigterm_ends(name: str, on_stop: str) -> Iterator[None]:
    """While a tool runs in the main thread: SIGTERM ends it in one line with exit status 143 (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    tool_pid = os.getpid()
    line = f"{name}: stopped by SIGTERM{'; ' + on_stop if on_stop else ''}.\n".encode()

    def _end_on_sigterm(signum: int, _frame: object) -> None:
        if os.getpid() != tool_pid:  # a forked child that kept this handler: the default action, silently
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # again until none has been left for QUIET_S: a pool's thread forks a worker in place of a dead one
        # (multiprocessing/pool.py, _handle_workers -> _maintain_pool), and one forked after the last look would
        # write into the pipe of a tool that is gone and print a BrokenPipeError traceback
        deadline, quiet_since = time.monotonic() + 2.0, None
        while time.monotonic() < deadline:
            found = descendants(tool_pid)
            for pid in found:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            now = time.monotonic()
            quiet_since = None if found else (quiet_since or now)
            if quiet_since is not None and now - quiet_since >= QUIET_S:
                break
            time.sleep(0.02)
        os.write(2, line)
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _end_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
