"""Memory a rank's loaders hold, and their in-flight batches sized to a per-rank budget.

Three kinds, per training process (rank); eight ranks on a node hold eight times as much:
- pinned (page-locked) host memory: the DataLoader's pin thread copies each batch into it for an
  asynchronous copy to the GPU (sample/batches.py, `give_back(pin=True)`). torch's pinned allocator
  rounds every request up to a power of two and keeps freed blocks cached for reuse
  (ATen/core/CachingHostAllocator.h: `roundSize` uses PowerOf2Ceil; `free` puts the block on its
  size's free list), so the cache holds as many blocks of pow2ceil(batch bytes) as were ever in flight.
- shared memory (/dev/shm): each loader worker's ring of batch buffers (sample/batches.py), and a
  dataset held in RAM for all workers (DownscaledDataModule in_memory).
- host RAM: both of the above (page-locked and shared pages are RAM too), plus what each worker process holds of
  its own (`WORKER_OWN_BYTES`, by --data.worker_start) and, under forkserver, the fork server. A worker holds no
  copy of the dataset's Index: forked, it shares the training process's pages; under forkserver and spawn the
  Index's arrays and the labels reach it as shared memory (datamodules/index.py), counted once here as
  `resident`. Not counted: the images a worker is decoding (a few at a time).

In flight per loader: `prefetch_factor` batches per worker outstanding
(torch/utils/data/dataloader.py, `_MultiProcessingDataLoaderIter._try_put_index`, round robin, so
at most that many per worker), all of which the pin thread may have pinned before a GPU-bound step
takes them; plus Lightning's one prefetched batch (`_PrefetchDataFetcher`) and the step's own
batch. A worker's ring needs a slot for each of its outstanding batches: with pinning, a batch's
buffer goes back as soon as the pin thread has copied it, before the batch can be consumed and the
worker be sent its next index; without pinning the training process uses the ring buffer itself,
so the two batches it may still hold need slots too.

Persistent train and val workers both keep their rings, and the pinned cache keeps both batch
shapes, so during a fit the two loaders share the budget (`_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from datamodules.sample.batches import batch_layout, ring_buffer_bytes

GIB = 1 << 30
MIB = 1 << 20
PREFETCH_CHOICES = (4, 3, 2, 1)  # the most batches per worker in flight that the budget allows
CONSUMER_BATCHES = 2  # Lightning's prefetched batch and the one the step is using
DEFAULT_BUDGET_GIB = {"pinned": 2.0, "shm": 4.0, "host": 8.0}
# What one loader worker holds of its own, beyond pages it shares with the process it was forked from
# (/proc/PID/smaps_rollup, Private_*; python -m bench.worker_start): forked from the training process or from the
# fork server, 10-13 MiB at its first batch; spawned, a whole interpreter with torch imported, 405-413 MiB. With
# room for a worker's decode buffers. The fork server is such an interpreter too, one per rank.
WORKER_OWN_BYTES = {"fork": 32 * MIB, "forkserver": 32 * MIB, "spawn": 512 * MIB}
FORK_SERVER_BYTES = 512 * MIB


def pinned_block_bytes(nbytes: int) -> int:
    """Pinned bytes a request of `nbytes` takes in torch's caching host allocator: the next power of two."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def gib(nbytes: float) -> str:
    """Bytes for a reader: GiB from a tenth of one, else MiB, else KiB."""
    if nbytes >= GIB / 10:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.0f} MiB" if nbytes >= MIB else f"{nbytes / 1024:.0f} KiB"


@dataclass(frozen=True)
class Budget:
    """Bytes one rank may hold: pinned, shared memory, host RAM (pinned + shared + anything else in RAM)."""

    pinned: int
    shm: int
    host: int

    @classmethod
    def from_gib(cls, pinned: float, shm: float, host: float) -> Budget:
        return cls(int(pinned * GIB), int(shm * GIB), int(host * GIB))

    @classmethod
    def of(cls, args) -> Budget:
        """From a DataModule's init args (`pinned_budget_gib`, `shm_budget_gib`, `host_budget_gib`)."""
        return cls.from_gib(*(float(args.get(f"{kind}_budget_gib", DEFAULT_BUDGET_GIB[kind]))
                              for kind in ("pinned", "shm", "host")))

    def share(self, fraction: float) -> Budget:
        return Budget(int(self.pinned * fraction), int(self.shm * fraction), int(self.host * fraction))


@dataclass(frozen=True)
class LoaderPlan:
    """One split's loader: workers, batches in flight, and the bytes they hold."""

    split: str
    batch: int  # images per rank
    size: int  # px (the largest this loader will make)
    workers: int
    prefetch: int  # batches per worker in flight (DataLoader prefetch_factor); 0 without workers
    pin: bool
    wanted_workers: int  # before the budget
    worker_own: int = 0  # bytes each worker process holds of its own (WORKER_OWN_BYTES)

    @property
    def batch_bytes(self) -> int:
        return batch_layout(self.batch, self.size)[2]

    @property
    def ring_slots(self) -> int:
        return self.prefetch if self.pin else self.prefetch + CONSUMER_BATCHES

    @property
    def in_flight(self) -> int:
        return (self.prefetch * self.workers if self.workers else 1) + CONSUMER_BATCHES

    @property
    def pinned(self) -> int:
        return self.in_flight * pinned_block_bytes(self.batch_bytes) if self.pin else 0

    @property
    def shm(self) -> int:
        return self.workers * self.ring_slots * ring_buffer_bytes(self.batch, self.size)

    @property
    def processes(self) -> int:
        return self.workers * self.worker_own

    def describe(self) -> str:
        if not self.workers:
            return f"{self.split} in-process at {self.size} px"
        capped = f" (of {self.wanted_workers}: memory budget)" if self.workers < self.wanted_workers else ""
        return (f"{self.split}: {self.workers} worker{'s' * (self.workers > 1)}{capped}, "
                f"{self.prefetch} batch{'es' * (self.prefetch > 1)} each in flight, {self.size} px")


@dataclass
class MemoryPlan:
    """Every loader of a rank and what they hold, against the budget."""

    loaders: list[LoaderPlan]
    budget: Budget
    resident: int = 0  # in shared memory once per rank: the Index's arrays, a dataset held in RAM
    helpers: int = 0  # processes besides the loaders' workers: the fork server, DALI's external-source workers
    notes: list[str] = field(default_factory=list)

    def loader(self, split: str) -> LoaderPlan | None:
        return next((p for p in self.loaders if p.split == split), None)

    @property
    def pinned(self) -> int:
        return sum(p.pinned for p in self.loaders)

    @property
    def shm(self) -> int:
        return sum(p.shm for p in self.loaders) + self.resident

    @property
    def processes(self) -> int:
        """The worker processes' own memory, and the helper processes' (the fork server, DALI's workers)."""
        return sum(getattr(p, "processes", 0) for p in self.loaders) + self.helpers

    @property
    def host(self) -> int:
        return self.pinned + self.shm + self.processes

    def over_budget(self) -> list[str]:
        return [f"{kind} {gib(got)} > {gib(limit)}" for kind, got, limit in
                (("pinned", self.pinned, self.budget.pinned), ("shared memory", self.shm, self.budget.shm),
                 ("host", self.host, self.budget.host)) if got > limit]

    def describe(self) -> str:
        """The start-up line: what a rank holds, against its budget."""
        parts = [f"pinned {gib(self.pinned)} of {gib(self.budget.pinned)}",
                 f"shared memory {gib(self.shm)} of {gib(self.budget.shm)}",
                 f"host {gib(self.host)} of {gib(self.budget.host)} with {gib(self.processes)} in worker processes"]
        loaders = "; ".join(p.describe() for p in self.loaders)
        batch = max(self.loaders, key=lambda p: p.batch_bytes, default=None)
        per_batch = (f"; a batch of {batch.batch} at {batch.size} px is {gib(batch.batch_bytes)}"
                     + (f", pinned in blocks of {gib(pinned_block_bytes(batch.batch_bytes))}" if batch.pin else "")
                     if batch else "")
        over = self.over_budget()
        return ("Memory per rank: " + ", ".join(parts) + f" ({loaders}{per_batch})"
                + (f". OVER BUDGET: {'; '.join(over)}" if over else "") + "".join(f". {n}" for n in self.notes))


def plan_memory(batch: int, train_size: int | None, val_size: int, workers: int, pin: bool, budget: Budget,
                resident: int = 0, val_workers: int | None = None, worker_start: str = "forkserver") -> MemoryPlan:
    """A rank's loaders: train (when `train_size` is given, i.e. during a fit) and val, sized to `budget`.

    `batch`: images per rank; `train_size`: the largest train crop the run will use; `resident`: bytes held in
    shared memory once per rank (the Index's arrays, a dataset held in RAM), taken off the shared-memory and host
    budgets first, as is the fork server under `worker_start` forkserver.
    """
    splits = [("train", train_size, workers)] if train_size is not None else []
    splits.append(("val", val_size, workers if val_workers is None else val_workers))
    server = FORK_SERVER_BYTES if worker_start == "forkserver" and max(w for *_, w in splits) > 0 else 0
    left = Budget(budget.pinned, max(0, budget.shm - resident), max(0, budget.host - resident - server))
    return MemoryPlan(_plan(splits, batch, pin, left, WORKER_OWN_BYTES[worker_start]), budget, resident, helpers=server)


def _plan(splits: list[tuple[str, int, int]], batch: int, pin: bool, budget: Budget,
          worker_own: int) -> list[LoaderPlan]:
    """Workers first, the same number for every split (validation decodes as much per image as training),
    as many as fit with one batch each in flight; then more batches in flight, train first, while they fit.
    When not even one worker per split fits, one worker each (the start-up line says over budget)."""
    def fits(plans: list[LoaderPlan]) -> bool:
        pinned, shm, own = (sum(p.pinned for p in plans), sum(p.shm for p in plans),
                            sum(p.processes for p in plans))
        return pinned <= budget.pinned and shm <= budget.shm and pinned + shm + own <= budget.host

    def make(workers: int, prefetch: list[int]) -> list[LoaderPlan]:
        return [LoaderPlan(name, batch, size, min(workers, wanted), p if wanted else 0, pin, wanted, worker_own)
                for (name, size, wanted), p in zip(splits, prefetch, strict=False)]

    most = max(wanted for _, _, wanted in splits)
    workers = next((w for w in range(most, 0, -1) if fits(make(w, [1] * len(splits)))), 1)
    prefetch = [1] * len(splits)
    for i in range(len(splits)):
        for p in PREFETCH_CHOICES:
            if p > prefetch[i] and fits(make(workers, prefetch[:i] + [p] + prefetch[i + 1:])):
                prefetch[i] = p
                break
    return make(workers, prefetch)


def release_cached_pinned_memory() -> None:
    """Free the pinned blocks torch's caching host allocator keeps for reuse (after a batch size change, the
    old size's blocks would stay cached for the rest of the run). torch/cuda/graphs.py calls the same
    `torch._C._host_emptyCache`; blocks still in use are left alone. Nothing to do before CUDA starts."""
    if torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
