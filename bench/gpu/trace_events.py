"""`bench gpu --groups trace`, the arithmetic over a profiler trace: its events read from the chrome JSON, each
decode batch's range split by the CUDA calls inside it, the streams' busy time, every device item's queue delay
matched to its launch by correlation id, and the allocation calls counted.

What the trace holds (kineto, libkineto/src/CuptiActivity.h and CuptiActivityProfiler.cpp; torch 2.14's own
exporter writes the same fields, torch/profiler/_chrome_trace_export.py): a range (`record_function`) is a
`user_annotation` event on its OS thread; a CUDA runtime call a `cuda_runtime` event, with `args.correlation`, the
CUPTI correlation id; a kernel, copy or memset a `kernel`, `gpu_memcpy` or `gpu_memset` event on its stream
(`args.stream`, else the "tid"), with the same `args.correlation` as the call that queued it (torch's own trace
validator matches them so, torch/profiler/_trace_validator.py). Driver calls (`cuda_driver`) are kept only where
kineto's registry lists them (libkineto/src/CuptiCbidRegistry.cpp: cuLaunchKernel(Ex), cuMemCreate, cuMemMap,
cuMemUnmap, cuMemRelease...; handleDriverActivity drops every other driver call): a `cuMemAlloc` made through the
driver API never reaches a trace. `cudaMalloc`, `cudaFree`, `cudaHostAlloc`, `cudaMallocAsync` do (every runtime
call but a blocklisted few), and the caching allocator's own count comes beside them (trace.py).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import median

from datamodules.sample.device_decode import JPEG_RANGE, RESIZE_RANGE

RANGES = (JPEG_RANGE, RESIZE_RANGE)
# what a CUDA runtime or driver call does, by a piece of its name (cudaStreamSynchronize, cuLaunchKernel, ...);
# the first kind that matches. cudaFree also waits for the whole device (CUDA Programming Guide, "Implicit
# Synchronization"); it counts as an allocation.
KINDS = (("wait", ("Synchronize",)), ("launch", ("Launch",)), ("copy", ("Memcpy", "Memset")),
         ("allocate", ("Malloc", "Free", "HostAlloc", "HostRegister", "MemAlloc", "MemCreate", "MemMap",
                       "MemUnmap", "MemRelease")))


@dataclass(frozen=True)
class Span:
    """One event of the trace: a range, a runtime call (on a thread) or device work (on a stream), in us."""
    name: str
    kind: str  # range | runtime | device
    where: int  # OS thread id (range, runtime) or CUDA stream (device)
    start: float
    end: float
    correlation: int | None = None  # CUPTI's: a call and the device work it queued share it


def call_kind(name: str) -> str:
    return next((kind for kind, pieces in KINDS if any(p in name for p in pieces)), "other")


def spans(trace: dict) -> list[Span]:
    """The ranges, runtime calls and device work of a chrome trace as torch.profiler exports it (see the module
    doc)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, start, args = e.get("cat", ""), float(e["ts"]), e.get("args") or {}
        kind = ("range" if cat == "user_annotation" and e.get("name") in RANGES else
                "runtime" if cat in ("cuda_runtime", "cuda_driver") else
                "device" if cat in ("kernel", "gpu_memcpy", "gpu_memset") else None)
        if kind is None:
            continue
        where = args.get("stream", e.get("tid")) if kind == "device" else e.get("tid")
        correlation = args.get("correlation")
        out.append(Span(e["name"], kind, _number(where), start, start + float(e["dur"]),
                        int(correlation) if correlation is not None else None))
    return out


def _number(value) -> int:
    """A thread or stream id: an int, or the digits of a label such as "stream 7"."""
    if isinstance(value, int):
        return value
    digits = "".join(c for c in str(value) if c.isdigit())
    return int(digits) if digits else -1


def union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def outermost_calls(events: list[Span]) -> dict[int, list[Span]]:
    """Per thread, its runtime and driver calls that no other call of that thread encloses (a runtime call's own
    driver call nests in it and is counted once)."""
    calls: dict[int, list[Span]] = defaultdict(list)
    for s in sorted((s for s in events if s.kind == "runtime"), key=lambda s: (s.start, -s.end)):
        of_thread = calls[s.where]
        if not of_thread or s.start >= of_thread[-1].end:
            of_thread.append(s)
    return calls


def decode_threads(events: list[Span]) -> set[int]:
    """The threads that ran a decode range."""
    return {s.where for s in events if s.kind == "range"}


def summarise(events: list[Span], steps: int) -> dict:
    """Per range name: batches, wall ms per batch, and ms per batch of the decode thread's runtime calls inside it
    by kind; per stream: kernels and copies per step and busy ms per step; the queue delays (`queue_delays`) and
    the allocation calls (`allocations`)."""
    parts: dict[str, dict] = {}
    runtime = outermost_calls(events)
    for name in RANGES:
        ranges = [s for s in events if s.kind == "range" and s.name == name]
        calls: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for r in ranges:
            for c in runtime.get(r.where, []):
                if r.start <= c.start < r.end:
                    calls[call_kind(c.name)] += min(c.end, r.end) - c.start
                    counts[call_kind(c.name)] += 1
        n = len(ranges)
        wall = sum(r.end - r.start for r in ranges)
        parts[name] = {"batches": n, "wall_ms": wall / n / 1e3 if n else None,
                       "calls_ms": {k: v / n / 1e3 for k, v in sorted(calls.items())} if n else {},
                       "calls": {k: v / n for k, v in sorted(counts.items())} if n else {},
                       "host_ms": (wall - sum(calls.values())) / n / 1e3 if n else None}
    device = [s for s in events if s.kind == "device"]
    # a step on the device: from the first piece of device work of the window to the last, over the steps
    step_ms = (max(s.end for s in device) - min(s.start for s in device)) / steps / 1e3 if device else None
    streams: dict[int, dict] = {}
    for stream in sorted({s.where for s in device}):
        work = [s for s in device if s.where == stream]
        busy = union([(s.start, s.end) for s in work]) / steps / 1e3
        streams[stream] = {"items_per_step": len(work) / steps, "busy_ms_per_step": busy,
                           "busy_share": busy / step_ms if step_ms else None}
    batches = max((p["batches"] for p in parts.values()), default=0)
    return {"parts": parts, "streams": streams, "step_ms": step_ms,
            "queue": queue_delays(events, batches), "allocations": allocations(events, steps, batches)}


def queue_delays(events: list[Span], batches: int) -> dict[str, dict]:
    """For the device work queued by the decode threads ("decode") and by every other thread ("step"): how many
    items, and in ms their queue delay (start on the device minus the end of the call that queued it, matched by
    correlation id; at least 0: a kernel can start before its launch call returns), median and largest; and the
    time they were held back by other streams: from the moment an item could run (its call returned and the item
    before it on its own stream ended) to its start, as a union over the window, per decode batch."""
    decoders = decode_threads(events)
    launches: dict[int, Span] = {}
    for s in events:
        if s.kind == "runtime" and s.correlation is not None:
            known = launches.get(s.correlation)
            if known is None or s.start < known.start:  # the outermost call of that id
                launches[s.correlation] = s
    last_end: dict[int, float] = {}  # stream -> the end of the item before, so far
    delays: dict[str, list[float]] = {"decode": [], "step": []}
    held: dict[str, list[tuple[float, float]]] = {"decode": [], "step": []}
    for item in sorted((s for s in events if s.kind == "device"), key=lambda s: s.start):
        before = last_end.get(item.where, float("-inf"))
        last_end[item.where] = max(before, item.end)
        launch = launches.get(item.correlation) if item.correlation is not None else None
        if launch is None:
            continue
        side = "decode" if launch.where in decoders else "step"
        delays[side].append(max(0.0, item.start - launch.end) / 1e3)
        ready = max(launch.end, before)
        if item.start > ready:
            held[side].append((ready, item.start))
    out = {}
    for side, values in delays.items():
        held_ms = union(held[side]) / 1e3
        out[side] = {"items": len(values), "median_ms": median(values) if values else None,
                     "max_ms": max(values, default=None), "held_ms": held_ms,
                     "held_ms_per_batch": held_ms / batches if batches else None}
    return out


def allocations(events: list[Span], steps: int, batches: int) -> dict:
    """The allocation calls in the trace (see the module doc for which reach it): per step on every thread, per
    batch on the decode threads, with the decode threads' ms per batch in them, and each name's count."""
    decoders = decode_threads(events)
    calls = [c for thread, of_thread in outermost_calls(events).items() for c in of_thread
             if call_kind(c.name) == "allocate"]
    mine = [c for c in calls if c.where in decoders]
    names: dict[str, int] = defaultdict(int)
    for c in calls:
        names[c.name] += 1
    return {"per_step": len(calls) / steps if steps else None,
            "decode_per_batch": len(mine) / batches if batches else None,
            "decode_ms_per_batch": sum(c.end - c.start for c in mine) / 1e3 / batches if batches else None,
            "names": dict(sorted(names.items()))}
