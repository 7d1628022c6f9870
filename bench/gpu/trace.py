"""`bench gpu --groups trace`: where the decode thread of `--data.decode gpu` spends a batch while the model trains,
from torch.profiler's trace (CUPTI's activity records, which Nsight Systems reads too; the GPU image has no nsys),
and which one thing limits it.

One fit as the trainer group's "decode gpu alone" row, profiled for its timed steps (at most TRACE_STEPS) after the
warm-up. The decode thread marks each batch's two parts (JPEG_RANGE and RESIZE_RANGE in
datamodules/sample/device_decode.py: the batched nvJPEG call, then the crop and resize). The profiler records every
thread's ranges (`profile_all_threads`, torch 2.7 and later: pytorch/pytorch PR 143659; without it, only the thread
that starts the profiler) and CUPTI every thread's CUDA runtime calls, each with its OS thread id. From them
(trace_events.py):
- per batch, each part's wall time and, inside it on the decode thread, the CUDA calls by what they do: wait
  (stream, event and device syncs: the host waits for the GPU), launch, copy, allocate, other; and the decode
  thread's CPU time in each part (trace_clock.py: spin-waits in CUDA's syncs burn CPU, host work does too);
- per step, each CUDA stream's kernels and copies: how many, and how long the stream was busy;
- every kernel's and copy's queue delay, from the end of the call that queued it to its start (correlation id),
  for the decode's device work and the step's, and how long the decode's work was held back by other streams;
- the allocation calls, and the caching allocator's own device allocations (torch.cuda.memory_stats:
  num_device_alloc, num_device_free) over the window.
The VERDICT row names one limit (trace_verdict.py), with the JPEG call alone on an idle GPU (engines.py) for the
engines' part. The A/B rows (trace_ab.py) run the same fit unprofiled with the side stream's priority at 0 and at
-1, and with blocking sync in a process of its own. The trace itself is written beside the results (chrome JSON,
gzip; open it in Perfetto). On a CPU (--allow-cpu) the same fit runs on the decode's CPU path with CPU activities
only: the ranges, no CUDA calls.
"""
from __future__ import annotations

import gzip
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytorch_lightning as pl
import torch

from bench.gpu.checks import Check, Workload
from bench.gpu.trace_clock import RangeClock, per_batch
from bench.gpu.trace_events import spans, summarise
from bench.gpu.trace_verdict import figures_from, name_limit, said

GROUP = "trace"
TRACE_STEPS = 10  # at most: about 10 of the decode thread's batches to average; a longer trace only grows the file
NAME = "decode gpu, where a batch's time goes"
VERDICT = "VERDICT"
PRIORITY_ENV = "FIC_DECODE_STREAM_PRIORITY"  # the decode side stream's priority (datamodules/sample/device_decode.py)


def train_decoder(trainer: pl.Trainer):
    """The training loader's device decoder, or None."""
    decoders = getattr(trainer.datamodule, "device_decoders", None) or {}
    return decoders.get("train")


def waits_now(decoder) -> dict[str, float] | None:
    """The decoder's wait totals so far (datamodules/sample/device_decode.py Waits), or None where it has none."""
    waits = getattr(decoder, "waits", None)
    if waits is None or not all(hasattr(waits, k) for k in ("workers", "device", "step")):
        return None
    return {k: float(getattr(waits, k)) for k in ("workers", "device", "step")}


def wait_shares(before: dict | None, after: dict | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    spent = {k: after[k] - before[k] for k in after}
    total = sum(spent.values())
    return {k: v / total for k, v in spent.items()} if total > 0 else None


def device_allocations() -> tuple[int, int] | None:
    """The caching allocator's (cudaMalloc or cuMemMap, cudaFree or cuMemUnmap) calls so far (torch/cuda/memory.py
    memory_stats: num_device_alloc, num_device_free)."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_alloc", 0)), int(stats.get("num_device_free", 0))


class Window(pl.Callback):
    """Optimizer steps warmup .. warmup + steps: their wall time, the decode ranges' clock, the decode thread's
    waits and the caching allocator's device allocations; with `path`, torch.profiler over every thread, the
    chrome trace written there (gzip)."""

    def __init__(self, warmup: int, steps: int, cuda: bool, clock: RangeClock, path: Path | None = None) -> None:
        self.warmup, self.steps, self.cuda, self.clock, self.path = warmup, steps, cuda, clock, path
        self.profiler: torch.profiler.profile | None = None
        self.started = self.done = False
        self.figures: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step != self.warmup or self.started:
            return
        if self.cuda:
            torch.cuda.synchronize()
        if self.path is not None:
            from torch._C._profiler import _ExperimentalConfig

            try:
                every_thread = _ExperimentalConfig(profile_all_threads=True)
            except TypeError as e:
                raise RuntimeError(f"torch {torch.__version__} cannot profile every thread (profile_all_threads: "
                                   "torch 2.7 and later); the decode thread's ranges would be missing") from e
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, experimental_config=every_thread)
            self.profiler.__enter__()
        self.started = True
        self._before = (self.clock.snapshot(), waits_now(train_decoder(trainer)), device_allocations(),
                        time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.started or self.done or trainer.global_step != self.warmup + self.steps:
            return
        if self.cuda:
            torch.cuda.synchronize()
        clock, waits, allocated, t0 = self._before
        seconds = time.perf_counter() - t0
        decoder = train_decoder(trainer)
        after = device_allocations()
        self.figures = {"images_s": self.steps * int(batch[0].shape[0]) / seconds,
                        "ranges": per_batch(clock, self.clock.snapshot()),
                        "waits": wait_shares(waits, waits_now(decoder)),
                        "device_allocations": ([b - a for a, b in zip(allocated, after, strict=True)]
                                               if allocated and after else None),
                        "priority": getattr(getattr(decoder, "stream", None), "priority", None)}
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            plain = self.path.with_suffix("")  # torch writes plain JSON; kept gzipped (a trace is large)
            self.profiler.export_chrome_trace(str(plain))
            with open(plain, "rb") as src, gzip.open(self.path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
        self.done = True


def decode_fit(w: Workload, root: Path, num_workers: int, window: Window) -> None:
    """A fit of warmup + steps steps with the device decoding every file (the trainer group's row), `window` on."""
    from bench.gpu.trainer import NUM_CLASSES
    from datamodules import ImageFolderDataModule
    from lightning_app.module import ImageClassifier

    cuda = w.device == "cuda"
    data = ImageFolderDataModule(data_dir=str(root), batch_size=w.batch_size, num_workers=num_workers,
                                 image_size=w.image_size, pin_memory=True, persistent_workers=True, decode="gpu",
                                 cpu_decode_share=0.0)
    pl.seed_everything(0, verbose=False)
    model = ImageClassifier(arch=w.arch, num_classes=NUM_CLASSES, image_size=w.image_size,
                            global_batch_size=w.batch_size, channels_last=True, pictures=[], warmup_epochs=0.0)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="16-mixed" if cuda else "32-true",
                         max_steps=w.warmup + w.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, log_every_n_steps=10**6, benchmark=True, callbacks=[window])
    with window.clock.installed():
        trainer.fit(model, datamodule=data)
    if not window.done:
        raise RuntimeError(f"the fit ended after {trainer.global_step} steps, before the timed window closed")


def trace_window(w: Workload) -> Workload:
    from bench.gpu.trainer import DATA_WARMUP

    return replace(w, warmup=max(w.warmup, DATA_WARMUP), steps=min(w.steps, TRACE_STEPS))


def trace_rows(w: Workload, root: Path, num_workers: int, out: Path, jpeg_alone_ms: float | None = None
               ) -> list[Check]:
    """The profiled fit and its summary (see the module doc) and the VERDICT; the trace at
    OUT/trace-decode-gpu.json.gz. `jpeg_alone_ms`: the engines group's JPEG call alone, ms a batch (measured here
    when None). The A/B rows are trace_ab.py's, run after these by the caller (bench/gpu/command.py)."""
    w = trace_window(w)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace-decode-gpu.json.gz"
    window = Window(w.warmup, w.steps, w.device == "cuda", RangeClock(), path)
    decode_fit(w, root, num_workers, window)
    with gzip.open(path, "rt") as f:
        summary = summarise(spans(json.load(f)), w.steps)
    clock = window.figures["ranges"]
    text = said(summary, clock)
    allocated = window.figures["device_allocations"]
    if allocated is not None:
        text += f"; the caching allocator's device allocations {allocated[0]}, frees {allocated[1]} in the window"
    print(f"trace: {text}", flush=True)
    extra = {**summary, **window.figures, "trace": str(path), "steps": w.steps, "warmup": w.warmup,
             "batch_size": w.batch_size, "image_size": w.image_size, "num_workers": num_workers,
             "clocked_modules": window.clock.modules}
    rows = [Check(GROUP, NAME, "ok", text, window.figures["images_s"], f"trace: {path}", extra)]
    if jpeg_alone_ms is None:
        from bench.gpu.engines import decode_alone

        try:
            jpeg_alone_ms = decode_alone(root, w)[0].extra["ms_per_batch"]
        except Exception as e:  # noqa: BLE001 - the verdict goes without the engines' part, said
            print(f"trace: the JPEG call alone could not be timed ({type(e).__name__}: {e})", flush=True)
    figures = figures_from(summary, clock, window.figures["waits"], jpeg_alone_ms)
    if figures is None:
        rows.append(Check(GROUP, VERDICT, "FAIL", "no decode range in the trace: the decode thread was not seen"))
    else:
        limit, why = name_limit(figures)
        rows.append(Check(GROUP, VERDICT, "ok", why, figure=limit,
                          extra={"limit": limit, "figures": figures.__dict__, "jpeg_alone_ms": jpeg_alone_ms}))
        print(f"trace: VERDICT: {limit}; {why}", flush=True)
    return rows
