"""GPU decode: the share of a batch the loader workers decode themselves, so that neither half waits for the other.

With --data.decode gpu two halves feed the step side by side: the loader workers, each packing a whole batch
(read the bytes, walk the headers, draw the crops; a file they also decode costs more), and the device stage,
one thread that decodes and crops the rest of each batch (device_decode.py). Decoding everything on the device
leaves the workers idle while the stage sets the pace; decoding everything in the workers is --data.decode cpu.
In between, with per-image costs

    r: a worker's seconds to read and plan one image,   c: a worker's extra seconds to decode and crop one,
    g: the stage's seconds per image it decodes,        W: workers, s: the share of the batch decoded on the CPU,

the workers deliver a batch of n every n (r + s c) / W seconds and the stage takes n (1 - s) g; both take as
long when

    s = (W g - r) / (W g + c).

Each batch carries what its worker spent (`EncodedBatch.costs`), the stage times itself, and `WorkerDecodeShare` keeps
the three costs as running averages and solves for s after every batch. Files the device cannot decode
(progressive, grayscale, ...) count towards s; the workers are told the rest as `overflow`, the chance that a
file the device could decode is decoded on the CPU (a value in shared memory, read once per batch, like the
train size). The costs are wall times, so a worker slowed by too few CPUs, or a stage slowed by a GPU busy with
the step, shows as such and moves the share.
"""
from __future__ import annotations

import torch

WARMUP_BATCHES = 2  # the first batches pay for CUDA, nvJPEG and the workers' start: not counted
DECAY = 0.8  # the weight of the running averages' past at each batch
MOST = 0.9  # the device keeps at least a tenth, so its cost stays measured

# EncodedBatch.costs: what a worker spent on one batch (float64, seconds and counts)
IMAGES, READ_S, ON_CPU, DECODE_S, CANNOT = range(5)
COSTS = 5


def shared_overflow() -> torch.Tensor:
    """The overflow the workers read: one float64 in shared memory (a forked, forkserver or spawned worker)."""
    return torch.zeros(1, dtype=torch.float64).share_memory_()


class WorkerDecodeShare:
    """The CPU's share of each batch under --data.decode gpu: fixed (`fixed` in [0, 1]: 0, the default, leaves
    every file the device can take to it) or balanced (`fixed` None, see the module doc). `overflow` is the
    workers' shared value; `workers` the loader's worker count (0: the batches are packed on the stage's own
    thread, where decoding on the CPU only adds to it)."""

    def __init__(self, overflow: torch.Tensor | None, workers: int, fixed: float | None = None) -> None:
        self.overflow = overflow
        self.workers = workers
        self.fixed = fixed
        self.batches = 0
        self.sums = [0.0] * (COSTS + 2)  # the costs, then the stage's seconds and images
        if overflow is not None:
            overflow.fill_(fixed or 0.0)

    def update(self, costs: list[float], stage_s: float, device_images: int) -> None:
        """Fold in one batch: its worker's costs (`EncodedBatch.costs` as a list) and the stage's seconds on its
        `device_images` (kept with a fixed share too: the end-of-run line reports them)."""
        self.batches += 1
        if self.batches <= WARMUP_BATCHES:
            return
        self.sums = [DECAY * old + new for old, new in zip(self.sums, [*costs, stage_s, device_images], strict=True)]
        if self.overflow is not None and self.fixed is None:
            self.overflow.fill_(self.target_overflow())

    def costs(self) -> dict[str, float] | None:
        """The running per-image seconds: read (r), decode (c, None before a CPU decode), device (g); and the share
        of files the device cannot take. None before both halves have been measured."""
        s = self.sums
        if s[IMAGES] <= 0 or s[COSTS + 1] <= 0:
            return None
        return {"read": s[READ_S] / s[IMAGES], "decode": s[DECODE_S] / s[ON_CPU] if s[ON_CPU] > 0 else None,
                "device": s[COSTS] / s[COSTS + 1], "cannot": s[CANNOT] / s[IMAGES]}

    def target_overflow(self) -> float:
        """The overflow at which both halves take as long per batch (a twentieth until a CPU decode is timed)."""
        costs = self.costs()
        if costs is None or self.workers < 1:
            return 0.0
        r, c, g, cannot = costs["read"], costs["decode"], costs["device"], costs["cannot"]
        if c is None:  # no file decoded on the CPU yet: try a little, to time it
            return 0.05
        wg = self.workers * g
        share = max(cannot, min(MOST, (wg - r) / (wg + c)))
        return 0.0 if cannot >= 1 else (share - cannot) / (1 - cannot)
