"""`bench gpu --groups trace`: the decode thread's CPU time in each of its ranges, against their wall time.

A thread that waits in `cudaStreamSynchronize` under CUDA's default scheduling spins on its core when the process
has fewer contexts than the machine has CPUs (cudaDeviceScheduleAuto, cuda_runtime_api.h, `cudaSetDeviceFlags`),
so "a busy core" may be a wait. `time.thread_time()` (CLOCK_THREAD_CPUTIME_ID: the calling thread's CPU time)
read at a range's start and end, beside `time.perf_counter()`, says how much of the range that thread was on a
core; the trace says how much of it was spent in CUDA's waits. The blocking-sync arm (trace_ab.py) tells them
apart for good: there a wait sleeps.

The ranges are the `record_function` calls of the datamodules package (device_decode.py's JPEG_RANGE and
RESIZE_RANGE): while `RangeClock.installed()` is active, each module of `datamodules` that holds torch's
`record_function` (torch/autograd/profiler.py) holds a timed one instead, which enters and leaves the real one, so
the profiler still sees every range.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

import torch


class RangeClock:
    """Per range name: how many times it ran, and its wall and thread-CPU seconds, summed over every thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}  # name -> [count, wall s, cpu s]
        self.modules: list[str] = []  # the modules whose record_function was timed

    def add(self, name: str, wall: float, cpu: float) -> None:
        with self._lock:
            total = self._totals.setdefault(name, [0, 0.0, 0.0])
            total[0] += 1
            total[1] += wall
            total[2] += cpu

    def snapshot(self) -> dict[str, tuple[int, float, float]]:
        with self._lock:
            return {name: (int(t[0]), t[1], t[2]) for name, t in self._totals.items()}

    @contextlib.contextmanager
    def installed(self) -> Iterator[RangeClock]:
        real = torch.autograd.profiler.record_function
        clock = self

        class Timed:
            def __init__(self, name: str, args: str | None = None) -> None:
                self.name, self.inner = name, real(name, args)

            def __enter__(self):
                self.t0 = (time.perf_counter(), time.thread_time())
                return self.inner.__enter__()

            def __exit__(self, *exc) -> None:
                self.inner.__exit__(*exc)
                clock.add(self.name, time.perf_counter() - self.t0[0], time.thread_time() - self.t0[1])

        patched = [m for name, m in list(sys.modules.items())
                   if name.startswith("datamodules.") and getattr(m, "record_function", None) is real]
        self.modules = sorted(m.__name__ for m in patched)
        for module in patched:
            module.record_function = Timed
        try:
            yield self
        finally:
            for module in patched:
                module.record_function = real


def per_batch(before: dict[str, tuple[int, float, float]], after: dict[str, tuple[int, float, float]]
              ) -> dict[str, dict]:
    """Per range name between two snapshots: batches, and wall and CPU ms per batch, and CPU / wall."""
    out = {}
    for name, (count, wall, cpu) in after.items():
        c0, w0, p0 = before.get(name, (0, 0.0, 0.0))
        n, wall, cpu = count - c0, wall - w0, cpu - p0
        if n:
            out[name] = {"batches": n, "wall_ms": wall / n * 1e3, "cpu_ms": cpu / n * 1e3,
                         "cpu_share": cpu / wall if wall > 0 else None}
    return out
