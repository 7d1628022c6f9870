"""What the data tools share: a parallel, ordered decode pool with a progress display.

`parallel_imap` runs a picklable function over many files in worker processes and yields the
results in input order (so a writer can number them), while `progress` shows images/s and MB/s:
a tqdm bar on a terminal, a plain line every 10% in a log file (no redraws, no escapes).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from datamodules.errors import DataError
from datamodules.processes import forksafe
from datamodules.processes.exits import ignore_stop_signals


def _mp_context() -> mp.context.BaseContext:
    # fork where it exists: the jobs touch only files, PIL and numpy, and spawn would
    # re-import the caller's __main__. The collector frozen across the fork, as for a forked loader worker
    # (datamodules/processes/forksafe.py): a child never finalises the parent's objects (their threads are not there).
    forksafe.install()
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


class LineProgress:
    """The part of tqdm's interface the tools use, printing `desc: n/total unit (p%), rate, postfix`
    to stderr at every `every` fraction of the total and at the end."""

    def __init__(self, total: int, desc: str = "", unit: str = "it", every: float = 0.1, file=None,
                 quiet: bool = False) -> None:
        self.total, self.desc, self.unit, self.quiet = total, desc, unit, quiet
        self.n = 0
        self.postfix = ""
        self.file = file or sys.stderr
        self._t0 = time.perf_counter()
        self._step = max(1, int(total * every)) if total else 0
        self._next = self._step
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._step and self.n >= self._next and self.n < self.total:
            self._next = (self.n // self._step + 1) * self._step
            self._print()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def _print(self) -> None:
        if self.quiet:
            return
        seconds = time.perf_counter() - self._t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = f", {self.n / seconds:,.1f} {self.unit}/s" if seconds > 0 else ""
        post = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}{pct}{rate}{post}, {seconds:.1f} s",
              file=self.file, flush=True)

    def close(self) -> None:
        if not self._closed and self.n:
            self._print()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_display(total: int, desc: str = "", unit: str = "it", disable: bool = False, **tqdm_kwargs: Any):
    """A tqdm bar when stderr is a terminal, LineProgress otherwise; nothing shown when disabled."""
    if not disable and sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, **tqdm_kwargs)
    return LineProgress(total, desc, unit, quiet=disable)


def default_workers(workers: int | None) -> int:
    if workers:
        return max(1, workers)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def parallel_imap(
    fn: Callable[[Any], Any],
    items: list,
    *,
    workers: int | None = None,
    desc: str = "",
    nbytes: Callable[[Any], int] | None = None,
    progress: bool = True,
    chunksize: int = 8,
) -> Iterator:
    """`fn(item)` for every item, in order, computed by `workers` processes (1 = in this process).

    `nbytes(result)` gives the bytes a result stands for (source bytes read), shown as MB/s.
    """
    workers = min(default_workers(workers), max(1, len(items)))
    t0 = time.perf_counter()
    done_bytes = 0
    with progress_display(total=len(items), unit="img", desc=desc, disable=not progress, mininterval=0.5) as bar:
        if workers == 1:
            results: Iterable = map(fn, items)
            pool = None
        else:
            pool = _mp_context().Pool(workers, initializer=ignore_stop_signals)  # the tool decides (processes/exits.py)
            results = pool.imap(fn, items, chunksize=chunksize)
        try:
            last = t0
            for n, result in enumerate(results, 1):
                if nbytes is not None:
                    done_bytes += nbytes(result)
                now = time.perf_counter()
                if nbytes is not None and (now - last > 0.5 or n == len(items)):
                    last = now
                    bar.set_postfix_str(f"{done_bytes / 1e6 / max(now - t0, 1e-9):.1f} MB/s", refresh=False)
                bar.update(1)
                yield result
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()


def list_bad(bad: list[tuple[str, str]], limit: int = 50) -> str:
    lines = "\n".join(f"  {p}: {why}" for p, why in bad[:limit])
    more = f"\n  ... and {len(bad) - limit} more" if len(bad) > limit else ""
    return lines + more


def source_size(paths: Iterable[str]) -> int:
    total = 0
    for p in paths:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total


def require_source(src: Path) -> None:
    """A packer's --src must be an ImageFolder root: say so, naming the flag, before anything else."""
    if not Path(src).is_dir():
        raise DataError(f"--src {src} is not a folder: give the ImageFolder root that holds train/<class>/ and "
                        "val/<class>/ (e.g. --src data/builtin/small, made by python -m datamodules.builtin).")
