"""What every suite's command shares: the --out/--machine/--note flags, the columns epilog and `BenchError`."""
from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOTE_HELP = "a line printed in bold above the table (e.g. 'contended smoke run, not a result')"

AddCommon = Callable[[argparse.ArgumentParser], None]
Subparsers = Any  # what ArgumentParser.add_subparsers returns (argparse has no public name for its type)


class BenchError(Exception):
    """A suite cannot run as asked: `python -m bench` prints the message on stderr and exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def data_dir_problem(data_dir: str | None) -> str | None:
    """What is wrong with a --data-dir that is not a folder, in one paragraph; None when it is one or unset."""
    if data_dir and not Path(data_dir).is_dir():
        return (f"--data-dir {data_dir} is not a folder: give an ImageFolder root holding train/<class>/ and "
                "val/<class>/, or leave --data-dir out to use the built-in dataset.")
    return None


def add_common(p: argparse.ArgumentParser) -> None:
    """--out, --machine and --note: where every suite writes its results, and under which name."""
    p.add_argument("--out", default="bench/out", help="folder for <machine>.<kind>.md/.json/.png and the "
                   "combined <machine>.md (default: bench/out, ignored by git; the committed results are "
                   "updated only with --out bench/results)")
    p.add_argument("--machine", default=None, help="file name for this machine (default: derived from CPU/GPU model)")
    p.add_argument("--note", default=None, help=NOTE_HELP)


def columns_epilog(columns: dict[str, str]) -> str:
    """A suite's table columns explained, for the end of its --help."""
    return "columns:\n" + "\n".join(
        textwrap.fill(f"{k}: {v}", width=100, initial_indent="  ", subsequent_indent="      ")
        for k, v in columns.items()
    )
