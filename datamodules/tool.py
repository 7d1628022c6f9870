"""How every command-line tool ends (`python -m datamodules.*`, `python -m bench`): bad input in one paragraph with
exit status 2, a stop signal in one line with 128 + its number (130 for Ctrl-C, 143 for SIGTERM), never a traceback.

The tool's own process decides: its worker processes ignore the stop signals (`ignore_stop_signals`, a pool's
initializer), so a signal sent to the whole process group (`timeout`, `kill -TERM -PGID`, a container stop) ends
the tool once, and its pools and servers are torn down as the exception unwinds through their `with` blocks.
"""
from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread where it arrived: unwinds like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def ignore_stop_signals() -> None:
    """For a worker process: the tool's main process decides what a stop signal means."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def run_tool(name: str, main: Callable[[], int | None], on_stop: str = "",
             bad_input: tuple[type[BaseException], ...] | None = None) -> int:
    """Run a tool's `main` and return its exit status; `on_stop` says what a rerun does after a stop. Bad input:
    `bad_input`, by default the data's DataError and a file system error (naming its path)."""
    if bad_input is None:
        from datamodules.index import DataError  # here: index.py itself imports the packing helpers

        bad_input = (DataError, OSError)
    saved = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return int(main() or 0)
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"{name}: stopped by {signal.Signals(signum).name}{'; ' + on_stop if on_stop else ''}.",
              file=sys.stderr, flush=True)
        return 128 + signum
    except bad_input as error:
        print(f"{name}: {describe(error)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


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
