"""CPU time per image: what a loader row and a decode ceiling cost, read from the kernel's accounts of their processes.

On a machine others share, a wall-clock rate moves with their load from one round to the next; the CPU time a row's
processes spend per image moves far less (it grows only with what the load costs in caches and context switches).
A row's processes: the timing process itself (it receives and moves the batches) and its loader's workers; a
decode ceiling's: its pool of decoding processes. Each row's rate, its CPU time per image, and the rows' ratios
(`paired.py`) are all reported.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (every thread), from /proc/<pid>/stat (fields 14 and 15,
    utime and stime, proc(5)); a process already gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def worker_pids(loader: Any) -> list[int] | None:
    """The pids of a torch DataLoader's worker processes while its iterator holds them (persistent workers between
    epochs), else None (no workers yet, none at all, or not a torch loader: its CPU time is not measured)."""
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None)
    return [w.pid for w in workers] if workers else None


class CpuClock:
    """CPU seconds of this process and of `pids` since it was made (None for `pids` None: not measured)."""

    def __init__(self, pids: list[int] | None) -> None:
        self.pids = pids
        self.start = None if pids is None else time.process_time() + process_cpu(pids)

    def seconds(self) -> float | None:
        return None if self.start is None else time.process_time() + process_cpu(self.pids) - self.start
