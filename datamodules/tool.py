"""How every command-line tool ends (`python -m datamodules.*`, `python -m bench`): bad input in one paragraph with
exit status 2, Ctrl-C in one line with exit status 130, never a traceback.

Ctrl-C reaches the whole process group: the tool's worker processes ignore it (`ignore_stop_signals`, a pool's
initializer), so the tool's own process stops once and tears its pools down as the KeyboardInterrupt unwinds
through their `with` blocks (multiprocessing's Pool.terminate sends SIGTERM, which ends a worker at once).
SIGTERM keeps its default action here: raising an exception from a SIGTERM handler at an arbitrary point was seen
to be swallowed inside a lock release and to leave the tool waiting on workers the same signal had killed.
"""
from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2


def ignore_stop_signals() -> None:
    """For a worker process: Ctrl-C and SIGHUP are the main process's to decide, and SIGTERM ends the worker at
    once, without a traceback (SIGTERM is also how multiprocessing's Pool.terminate stops its workers)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_tool(name: str, main: Callable[[], int | None], on_stop: str = "",
             bad_input: tuple[type[BaseException], ...] | None = None) -> int:
    """Run a tool's `main` and return its exit status; `on_stop` says what a rerun does after a stop. Bad input:
    `bad_input`, by default the data's DataError and a file system error (naming its path)."""
    if bad_input is None:
        from datamodules.index import DataError  # here: index.py itself imports the packing helpers

        bad_input = (DataError, OSError)
    try:
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
