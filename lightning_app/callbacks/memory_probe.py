"""Before the first step of a fit: will one training step fit in memory? A tiny probe says.

ResNet-50 at batch 1024 and 176 px needs about 60 GB for one step on a CPU; on a 24 GB machine the
kernel killed it (exit 137, no message). `MemoryProbe` runs the model's forward pass on 2 and on 4
random images (train mode, the run's precision, the largest train crop size of the fit: a ProgressiveResizing
schedule's largest, which it reaches epochs after the probe) and adds up the bytes of every
tensor autograd keeps for the backward pass (`torch.autograd.graph.saved_tensors_hooks`, counting each
storage once). The difference is the activation memory per image; weights, gradients and the SGD
momentum come on top, and with --data.decode gpu the decode's buffers on the GPU (datamodules/sample/
device_decode.py: `device_bytes_per_image`, and DEVICE_GROUP_BYTES for one resize group). Against the memory
free for this process (CUDA: `torch.cuda.mem_get_info`; CPU: MemAvailable and the cgroup limit, shared by the training
processes of the node):

- clearly too much (estimate > STOP_FACTOR x free): the fit stops with one paragraph that names a
  --data.batch_size that fits (exit status 2);
- close (estimate > WARN_FACTOR x free): a warning, and the fit goes on;
- a probe that fails for any reason blocks nothing: "no verdict", said in one line by the rank it failed on.

The ranks decide together: each rank's verdict (no verdict < ok < warn < stop) goes into one all_reduce(MAX), so
every rank takes the worst one, and the rank that measured it broadcasts its paragraph. Every rank reaches both
collectives whatever its own probe did, so a stop ends every rank with the same paragraph (exit status 2) and
none is left waiting in a collective for its timeout.

The probe runs the backbone's own `forward` (not a `compile`d call: nothing is compiled for it), with every
SyncBatchNorm normalising locally (a collective of one rank would otherwise wait for the others), restores the
BatchNorm statistics and random state it touched, and costs two small forward passes.

Tests set the free memory of a process with FIC_MEMORY_PROBE_FREE_BYTES (bytes); a value that is not a whole
number makes the probe fail there, as a probe that cannot measure does.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn

from lightning_app.errors import UserError

PROBE_BATCHES = (2, 4)  # not 1: BatchNorm in train mode refuses one value per channel (a 1x1 map of one image)
STOP_FACTOR = 1.5  # the estimate counts saved activations only; the real peak is higher, never much lower
WARN_FACTOR = 0.8
FIT_SHARE = 0.7  # the suggested batch leaves this share of the free memory to the step
STATE_COPIES = 3  # weights + gradients + SGD momentum, as float32
GB = 1e9
VERDICTS = ("no verdict", "ok", "warn", "stop")  # in the order all_reduce(MAX) picks the worst
FREE_ENV = "FIC_MEMORY_PROBE_FREE_BYTES"


@dataclass
class StepEstimate:
    per_image: float  # bytes of activations per image
    fixed: float  # bytes that do not grow with the batch: weights, gradients, optimizer state, probe constants
    batch: int  # images per process (per device under dp)

    def bytes_for(self, batch: int) -> float:
        return self.fixed + self.per_image * batch

    @property
    def total(self) -> float:
        return self.bytes_for(self.batch)


def saved_bytes(forward, images: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass of `forward(images)`."""
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(images)
    del out
    return sum(seen.values())


@contextlib.contextmanager
def local_batch_norm(net: torch.nn.Module) -> Iterator[None]:
    """Every SyncBatchNorm in `net` runs BatchNorm's own forward meanwhile: statistics of this rank's batch only.

    SyncBatchNorm.forward all-gathers the statistics in train mode whenever a process group is up
    (torch/nn/modules/batchnorm.py, `need_sync`); BatchNorm2d.forward is the same normalisation without it
    (a function of the module's own attributes, which SyncBatchNorm shares through _BatchNorm). An instance attribute
    `forward` shadows the class's for nn.Module.__call__ until it is deleted again.
    """
    synced = [m for m in net.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    for m in synced:
        m.forward = torch.nn.BatchNorm2d.forward.__get__(m)
    try:
        yield
    finally:
        for m in synced:
            del m.forward


def probe(module: pl.LightningModule, trainer: pl.Trainer, size: int, batch: int) -> StepEstimate:
    """Measure the activations per image of `module`'s backbone at `size` px under the trainer's precision."""
    backbone = module.backbone
    device = module.device
    buffers = {k: b.detach().clone() for k, b in backbone.named_buffers()}
    was_training = backbone.training
    channels_last = bool(module.hparams.get("channels_last"))
    measured = []
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), local_batch_norm(backbone):
            backbone.train()
            for n in PROBE_BATCHES:
                images = torch.randn(n, 3, size, size, device=device)
                if channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                with trainer.precision_plugin.forward_context():
                    measured.append(saved_bytes(backbone.forward, images))  # .forward: eager, never compiled
                del images
    finally:
        backbone.train(was_training)
        with torch.no_grad():
            for k, b in backbone.named_buffers():
                b.copy_(buffers[k])
    (n1, m1), (n2, m2) = zip(PROBE_BATCHES, measured, strict=False)
    per_image = max(0.0, (m2 - m1) / (n2 - n1))
    constant = max(0.0, m1 - per_image * n1)
    params = sum(p.numel() * p.element_size() for p in backbone.parameters())
    return StepEstimate(per_image=per_image, fixed=constant + STATE_COPIES * params, batch=batch)


def host_memory_available() -> int | None:
    """Bytes this process could still allocate on the host: MemAvailable, capped by the cgroup's limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit.isdigit() and int(limit) < 2**60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def free_memory(device: torch.device, processes_on_node: int) -> int | None:
    """Bytes free for this process's training step on `device` (FIC_MEMORY_PROBE_FREE_BYTES: a test's value)."""
    told = os.environ.get(FREE_ENV)
    if told is not None:
        return int(told)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = host_memory_available()
    return None if available is None else available // max(1, processes_on_node)


def verdict(need: float, free: float) -> str:
    """'stop' when the step clearly cannot fit, 'warn' when it may not, else 'ok'."""
    if need > STOP_FACTOR * free:
        return "stop"
    if need > WARN_FACTOR * free:
        return "warn"
    return "ok"


def fitting_batch(estimate: StepEstimate, free: float, copies: int) -> int:
    """The largest GLOBAL batch whose step uses FIT_SHARE of `free` on each of `copies` (processes x dp devices),
    a multiple of 8 per copy from 16 up."""
    each = math.floor((FIT_SHARE * free - estimate.fixed) / estimate.per_image) if estimate.per_image else 0
    if each >= 16:
        each -= each % 8
    return max(0, each) * copies


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def describe(estimate: StepEstimate, free: float, where: str, arch: str, size: int, batch: int, processes: int,
             split: int, schedule: list[int] | None = None) -> str:
    """What one step at `size` px needs and what is free; `schedule`: a progressive-resizing schedule's sizes."""
    per = f"{batch // processes} per process" if processes > 1 else ""
    per = f"{per}{', ' if per else ''}{estimate.batch} per device" if split > 1 else per
    ramp = f" (the largest train size of the progressive-resizing schedule {' -> '.join(map(str, schedule))} px)"
    return (f"--data.batch_size {batch}{f' ({per})' if per else ''} needs about {_size(estimate.total)} for one "
            f"training step of {arch} at {size} px{ramp if schedule else ''} ({estimate.per_image / 1e6:.1f} MB of "
            f"activations per image, measured on a probe of {PROBE_BATCHES[-1]} images; {_size(estimate.fixed)} of "
            f"weights, gradients and optimizer state), but about {_size(free)} is free {where}")


class MemoryProbe(pl.Callback):
    """One training step's memory, estimated before the first step of a fit and decided by all ranks (module doc)."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            decision, said = self._check(trainer, pl_module)
        except UserError as error:  # a setting the model refuses: its first step would stop the run the same way
            decision, said = "stop", str(error)
        except Exception as error:  # noqa: BLE001 - an estimate that cannot be made never blocks a run
            decision, said = "no verdict", None
            print(f"Memory probe: no estimate on rank {trainer.global_rank} of {trainer.world_size} "
                  f"({type(error).__name__}: {error}); it counts as no verdict and the run goes on.",
                  file=sys.stderr, flush=True)
        worst, src = agree(trainer, pl_module.device, decision)
        if worst in ("warn", "stop"):
            said = trainer.strategy.broadcast(said, src=src)
        if worst == "stop":
            raise UserError(said)
        if worst == "warn":
            rank_zero_warn(said)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[str, str | None]:
        dm = trainer.datamodule
        batch = getattr(dm, "batch_size", None)
        if not hasattr(pl_module, "backbone") or not isinstance(batch, int):
            return "no verdict", None
        processes = max(1, trainer.world_size)
        per_process = max(1, batch // processes)
        strategy = trainer.strategy
        split = max(1, len(getattr(strategy, "cuda_devices", []) or []))  # dp: each GPU holds a slice
        size = int(getattr(dm, "train_size", None) or pl_module.hparams.get("image_size") or 224)
        # ProgressiveResizing's sizes (its setup, before on_fit_start, lists them): the largest comes epochs later
        schedule = [int(s) for s in getattr(dm, "scheduled_train_sizes", None) or []]
        schedule = schedule if len(set(schedule)) > 1 else []
        size = max([size, *schedule])
        estimate = probe(pl_module, trainer, size, math.ceil(per_process / split))
        if getattr(dm, "decodes_on_device", False) and pl_module.device.type == "cuda":
            from datamodules.sample.device_decode import DEVICE_GROUP_BYTES, device_bytes_per_image

            estimate.per_image += device_bytes_per_image(size)  # --data.decode gpu: its buffers are the step's
            estimate.fixed += DEVICE_GROUP_BYTES
        on_node = max(1, processes // max(1, trainer.num_nodes))
        free = free_memory(pl_module.device, on_node)
        if not free:
            return "no verdict", None
        where = (f"on {pl_module.device}" if pl_module.device.type == "cuda"
                 else f"in host memory{f' per training process ({on_node} on this node)' if on_node > 1 else ''}")
        if processes > 1:
            where += f" of rank {trainer.global_rank}"
        said = describe(estimate, free, where, pl_module.hparams.get("arch", "the model"), size, batch, processes,
                        split, schedule)
        smaller = "smaller sizes in the ProgressiveResizing schedule" if schedule else "a smaller --data.image_size"
        fits = fitting_batch(estimate, free, processes * split)
        advice = (f"--data.batch_size {fits} fits" if fits >= processes
                  else f"not even one image per process fits: use {smaller} or pick a smaller --model.arch")
        hint = f"; or keep the batch and add devices (--trainer.devices), use --trainer.precision bf16-mixed or " \
            f"{smaller}"
        decision = verdict(estimate.total, free)
        if decision == "stop":
            return decision, (f"{said}: the step would not fit and the run would be killed. {advice}{hint}. "
                              f"(Estimated before the first step by lightning_app/callbacks/memory_probe.py.)")
        if decision == "warn":
            return decision, f"{said}: the step may not fit. If the run is killed, {advice}{hint}."
        return decision, None


def agree(trainer: pl.Trainer, device: torch.device, decision: str) -> tuple[str, int]:
    """(the worst verdict over all ranks, the lowest rank that gave it), from one all_reduce(MAX) on every rank.

    Each rank adds its verdict's index times the world size to its rank counted from the top, so the maximum
    carries both. Strategy.reduce is a no-op in one process, an all_reduce under DDP (lightning_fabric/utilities/
    distributed.py, `_sync_ddp`); the tensor lives on the module's device, where NCCL needs it.
    """
    world, rank = max(1, trainer.world_size), trainer.global_rank
    mine = torch.tensor(VERDICTS.index(decision) * world + (world - 1 - rank), device=device)
    best = int(trainer.strategy.reduce(mine, reduce_op="max"))
    return VERDICTS[best // world], world - 1 - best % world
