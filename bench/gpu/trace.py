"""`bench gpu --groups trace`: where the decode thread of `--data.decode gpu` spends a batch while the model trains,
from torch.profiler's trace (CUPTI's activity records, which Nsight Systems reads too; the GPU image has no nsys).

One fit as the trainer group's "decode gpu alone, resize scripted" row, profiled for its timed steps (at most
TRACE_STEPS) after the warm-up. The decode thread marks each batch's two parts (JPEG_RANGE and RESIZE_RANGE in
datamodules/sample/device_decode.py: the batched nvJPEG call, then the scripted crop and resize). The profiler
records every thread's ranges (`profile_all_threads`, torch 2.7 and later: pytorch/pytorch PR 143659; without it,
only the thread that starts the profiler) and CUPTI every thread's CUDA runtime and driver calls, each with its
OS thread id. From them:
- per batch, each part's wall time and, inside it on the decode thread, the CUDA calls by what they do: wait
  (stream, event and device syncs: the host waits for the GPU), launch, copy, allocate, other;
- per step, each CUDA stream's kernels and copies: how many, and how long the stream was busy, also as a share
  of the step's span on the device (a training stream that waits for the decode's batch is idle in between).
The verdict names what fills most of the decode thread's batch. The trace itself is written beside the results
(chrome JSON, gzip; open it in Perfetto). On a CPU (--allow-cpu) the same fit runs on the decode's CPU path with
CPU activities only: the ranges, no CUDA calls.
"""
from __future__ import annotations

import gzip
import json
import shutil
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import pytorch_lightning as pl
import torch

from bench.gpu.checks import Check, Workload
from datamodules.sample.device_decode import JPEG_RANGE, RESIZE_RANGE

GROUP = "trace"
TRACE_STEPS = 10  # at most: about 10 of the decode thread's batches to average; a longer trace only grows the file
NAME = "decode gpu, where a batch's time goes"
RANGES = (JPEG_RANGE, RESIZE_RANGE)
# what a CUDA runtime or driver call does, by a piece of its name (cudaStreamSynchronize, cuLaunchKernel, ...)
KINDS = (("wait", ("Synchronize",)), ("launch", ("Launch",)), ("copy", ("Memcpy", "Memset")),
         ("allocate", ("Malloc", "Free", "HostAlloc", "HostRegister")))


@dataclass(frozen=True)
class Span:
    """One event of the trace: a range, a runtime call (on a thread) or device work (on a stream), in us."""
    name: str
    kind: str  # range | runtime | device
    where: int  # OS thread id (range, runtime) or CUDA stream (device)
    start: float
    end: float


def call_kind(name: str) -> str:
    return next((kind for kind, pieces in KINDS if any(p in name for p in pieces)), "other")


def spans(trace: dict) -> list[Span]:
    """The ranges, runtime calls and device work of a chrome trace as torch.profiler exports it, by kineto's
    categories (libkineto/src/ActivityType.cpp): user_annotation for a range on a thread, cuda_runtime and
    cuda_driver for a call, kernel, gpu_memcpy and gpu_memset on a stream (its id in args.stream, else "tid")."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, start = e.get("cat", ""), float(e["ts"])
        kind = ("range" if cat == "user_annotation" and e.get("name") in RANGES else
                "runtime" if cat in ("cuda_runtime", "cuda_driver") else
                "device" if cat in ("kernel", "gpu_memcpy", "gpu_memset") else None)
        if kind is None:
            continue
        where = (e.get("args") or {}).get("stream", e.get("tid")) if kind == "device" else e.get("tid")
        out.append(Span(e["name"], kind, _number(where), start, start + float(e["dur"])))
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


def summarise(events: list[Span], steps: int) -> dict:
    """Per range name: batches, wall ms per batch, and ms per batch of the decode thread's runtime calls inside it
    by kind; per stream: kernels and copies per step and busy ms per step."""
    parts: dict[str, dict] = {}
    runtime = defaultdict(list)  # thread -> its outermost calls (a runtime call's own driver calls nest in it)
    for s in sorted((s for s in events if s.kind == "runtime"), key=lambda s: (s.start, -s.end)):
        calls_of = runtime[s.where]
        if not calls_of or s.start >= calls_of[-1].end:
            calls_of.append(s)
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
    return {"parts": parts, "streams": streams, "step_ms": step_ms}


def verdict(summary: dict) -> str:
    """'fic.decode.jpeg 30.1 ms a batch (wait 24.0, launch 1.2, host 4.9); fic.decode.resize ...; largest: wait in
    fic.decode.jpeg (the host waits for the GPU), 24.0 ms'."""
    said = []
    largest = ("", 0.0)
    meaning = {"wait": "the host waits for the GPU", "launch": "launching kernels", "copy": "copies",
               "allocate": "allocations", "other": "other CUDA calls", "host": "its own host work"}
    for name, part in summary["parts"].items():
        if not part["batches"]:
            said.append(f"{name}: not seen")
            continue
        shares = {**part["calls_ms"], "host": part["host_ms"]}
        said.append(f"{name} {part['wall_ms']:.1f} ms a batch (" +
                    ", ".join(f"{k} {v:.1f}" for k, v in shares.items() if v >= 0.05) + ")")
        for k, v in shares.items():
            if v > largest[1]:
                largest = (f"{k} in {name} ({meaning[k]})", v)
    if summary.get("step_ms"):  # the busiest stream is the training step's
        busiest = max(summary["streams"].values(), key=lambda v: v["busy_ms_per_step"])
        said.append(f"a step {summary['step_ms']:.1f} ms on the device, its busiest stream busy "
                    f"{busiest['busy_share']:.0%} of it")
    return "; ".join(said) + (f"; largest: {largest[0]}, {largest[1]:.1f} ms" if largest[0] else "")


class ProfileSteps(pl.Callback):
    """torch.profiler over optimizer steps warmup .. warmup + steps, every thread; the chrome trace to `path`."""

    def __init__(self, warmup: int, steps: int, path: Path, cuda: bool) -> None:
        self.warmup, self.steps, self.path, self.cuda = warmup, steps, path, cuda
        self.profiler: torch.profiler.profile | None = None
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step != self.warmup or self.profiler is not None:
            return
        from torch._C._profiler import _ExperimentalConfig

        try:
            every_thread = _ExperimentalConfig(profile_all_threads=True)
        except TypeError as e:
            raise RuntimeError(f"torch {torch.__version__} cannot profile every thread (profile_all_threads: "
                               "torch 2.7 and later); the decode thread's ranges would be missing") from e
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            torch.cuda.synchronize()
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities,
                                               experimental_config=every_thread)
        self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.profiler is None or self.done or trainer.global_step != self.warmup + self.steps:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        plain = self.path.with_suffix("")  # torch writes plain JSON; kept gzipped (a trace of 30 steps is large)
        self.profiler.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(self.path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
        self.done = True


def trace_row(w: Workload, root: Path, num_workers: int, out: Path) -> Check:
    """The profiled fit and its summary (see the module doc); the trace at OUT/trace-decode-gpu.json.gz."""
    from bench.gpu.trainer import DATA_WARMUP, NUM_CLASSES
    from datamodules import ImageFolderDataModule
    from lightning_app.module import ImageClassifier

    w = replace(w, warmup=max(w.warmup, DATA_WARMUP), steps=min(w.steps, TRACE_STEPS))
    cuda = w.device == "cuda"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace-decode-gpu.json.gz"
    data = ImageFolderDataModule(data_dir=str(root), batch_size=w.batch_size, num_workers=num_workers,
                                 image_size=w.image_size, pin_memory=True, persistent_workers=True, decode="gpu",
                                 cpu_decode_share=0.0)
    pl.seed_everything(0, verbose=False)
    model = ImageClassifier(arch=w.arch, num_classes=NUM_CLASSES, image_size=w.image_size,
                            global_batch_size=w.batch_size, channels_last=True, pictures=[], warmup_epochs=0.0)
    profile = ProfileSteps(w.warmup, w.steps, path, cuda)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="16-mixed" if cuda else "32-true",
                         max_steps=w.warmup + w.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, log_every_n_steps=10**6, benchmark=True, callbacks=[profile])
    trainer.fit(model, datamodule=data)
    if not profile.done:
        raise RuntimeError(f"the fit ended after {trainer.global_step} steps, before the profiled window closed")
    with gzip.open(path, "rt") as f:
        summary = summarise(spans(json.load(f)), w.steps)
    said = verdict(summary)
    print(f"trace: {said}", flush=True)
    return Check(GROUP, NAME, "ok", said, None, f"trace: {path}",
                 {**summary, "trace": str(path), "steps": w.steps, "warmup": w.warmup, "batch_size": w.batch_size,
                  "image_size": w.image_size, "num_workers": num_workers})
