"""`bench gpu --groups trace`: the verdict, one limit of `--data.decode gpu` under training, with its arithmetic.

The decode thread builds one batch after another. Where it waits a good part of its time for the next batch from
the workers, or for the step to take the batch it built, that names the limit ("the workers"; or "the step
itself": the decode keeps up). Otherwise its own batch sets the pace, and its time per batch is split four ways,
each in ms a batch, the largest naming the limit:
- the engines: the batched JPEG call alone on an idle GPU (engines.py), less the host work inside it under
  training: what the hardware decoder needs whatever else runs;
- the decode thread's host work: its time in the ranges outside CUDA's waits and allocations, and at most its
  thread CPU time there (under spin-wait the waits burn CPU too; trace_clock.py);
- SM queueing behind the step: the decode's device work held back by other streams (trace_events.queue_delays);
- allocations: the decode thread's allocation calls (cudaMalloc, cudaFree: the latter waits for the device).
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.gpu.trace_events import RANGES

ENGINES, HOST, QUEUEING, ALLOCATIONS, WORKERS, STEP = (
    "the engines", "the decode thread's host work", "SM queueing behind the step", "allocations", "the workers",
    "the step itself (the decode keeps up)")
LIMITS = (ENGINES, HOST, QUEUEING, ALLOCATIONS, WORKERS, STEP)
WAITING = 0.2  # a decode thread that waits this share of its time for the workers or the step is not the limit


@dataclass
class Figures:
    """What `name_limit` judges: the decode thread's batch (ms), the shares of its time it waited for the workers
    and for the step (None: not read), and the four parts of its batch (ms; None: not measured)."""

    batch_ms: float
    wait_workers: float | None
    wait_step: float | None
    engines_ms: float | None
    host_ms: float | None
    queued_ms: float | None
    alloc_ms: float | None


def name_limit(f: Figures) -> tuple[str, str]:
    """(one of LIMITS, the arithmetic): see the module doc."""
    waits = {WORKERS: f.wait_workers, STEP: f.wait_step}
    waits = {k: v for k, v in waits.items() if v is not None}
    if waits and max(waits.values()) >= WAITING:
        limit = max(waits, key=waits.get)
        whom = "the workers' next batch" if limit == WORKERS else "the step to take its batch"
        return limit, (f"the decode thread waited {waits[limit]:.0%} of its time for {whom} (>= {WAITING:.0%}; "
                       + ", ".join(f"{'workers' if k == WORKERS else 'step'} {v:.0%}" for k, v in waits.items()) + ")")
    parts = {ENGINES: f.engines_ms, HOST: f.host_ms, QUEUEING: f.queued_ms, ALLOCATIONS: f.alloc_ms}
    measured = {k: v for k, v in parts.items() if v is not None}
    if not measured:
        return HOST, f"nothing but its {f.batch_ms:.1f} ms a batch was measured: its own work, by default"
    limit = max(measured, key=measured.get)
    said = ", ".join(f"{k} {v:.1f}" for k, v in measured.items())
    missing = [k for k, v in parts.items() if v is None]
    return limit, (f"the decode thread sets the pace ({', '.join(f'{k} {v:.0%}' for k, v in waits.items())} of its "
                   f"time waiting) at {f.batch_ms:.1f} ms a batch; in ms a batch: {said}: {limit} the largest, "
                   f"{measured[limit] / max(f.batch_ms, 1e-9):.0%} of the batch"
                   + (f" (not measured: {', '.join(missing)})" if missing else ""))


def figures_from(summary: dict, clock: dict[str, dict], waits: dict[str, float] | None,
                 jpeg_alone_ms: float | None) -> Figures | None:
    """The verdict's figures from the trace's summary (trace_events.summarise), the ranges' thread CPU
    (trace_clock.per_batch), the decode thread's wait shares, and the JPEG call alone (ms a batch). None when no
    decode range was seen."""
    parts = summary["parts"]
    seen = [parts[name] for name in RANGES if parts.get(name, {}).get("batches")]
    if not seen:
        return None
    batch = sum(p["wall_ms"] for p in seen)
    host = {}
    for name in RANGES:
        part = parts.get(name) or {}
        if not part.get("batches"):
            continue
        busy = part["wall_ms"] - part["calls_ms"].get("wait", 0.0) - part["calls_ms"].get("allocate", 0.0)
        cpu = (clock.get(name) or {}).get("cpu_ms")
        host[name] = max(0.0, min(busy, cpu) if cpu is not None else busy)
    engines = None
    if jpeg_alone_ms is not None:
        engines = max(0.0, jpeg_alone_ms - host.get(RANGES[0], 0.0))
    queue = summary.get("queue", {}).get("decode", {})
    allocated = sum(p["calls_ms"].get("allocate", 0.0) for p in seen)
    return Figures(batch, (waits or {}).get("workers"), (waits or {}).get("step"), engines, sum(host.values()),
                   queue.get("held_ms_per_batch") if queue.get("items") else None, allocated)


def said(summary: dict, clock: dict[str, dict]) -> str:
    """'fic.decode.jpeg 30.1 ms a batch (wait 24.0, launch 1.2, host 4.9; CPU 29.8 ms, 99%); ...; a step 41.0 ms on
    the device, its busiest stream busy 97% of it; queue delay ...; allocations ...'."""
    words = []
    for name, part in summary["parts"].items():
        if not part["batches"]:
            words.append(f"{name}: not seen")
            continue
        shares = {**part["calls_ms"], "host": part["host_ms"]}
        cpu = clock.get(name)
        words.append(f"{name} {part['wall_ms']:.1f} ms a batch (" +
                     ", ".join(f"{k} {v:.1f}" for k, v in shares.items() if v >= 0.05)
                     + (f"; its thread's CPU {cpu['cpu_ms']:.1f} ms, {cpu['cpu_share']:.0%}"
                        if cpu and cpu.get("cpu_share") is not None else "") + ")")
    if summary.get("step_ms"):  # the busiest stream is the training step's
        busiest = max(summary["streams"].values(), key=lambda v: v["busy_ms_per_step"])
        words.append(f"a step {summary['step_ms']:.1f} ms on the device, its busiest stream busy "
                     f"{busiest['busy_share']:.0%} of it")
    for side, q in summary.get("queue", {}).items():
        if q["items"]:
            words.append(f"the {side}'s {q['items']} device items: queue delay median {q['median_ms']:.2f} ms, "
                         f"largest {q['max_ms']:.1f} ms, held back by other streams {q['held_ms']:.1f} ms")
    a = summary.get("allocations")
    if a and a["per_step"]:
        words.append(f"allocation calls {a['per_step']:g} a step ({a['decode_per_batch']:g} a batch on the decode "
                     f"thread, {a['decode_ms_per_batch']:.1f} ms)")
    return "; ".join(words)
