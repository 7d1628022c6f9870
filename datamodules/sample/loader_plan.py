"""One loader's decisions in one frozen value: its workers, their prefetch and start, pinning, and what its dataset
does per batch (decode threads, ring slots, region decode, the device decode's shared overflow).

`Loaders.loader_plan` (datamodules/loaders.py) computes it once from the settings and the memory plan; the dataset
(sample/dataset.py, encoded.py) and the shards' collate (shards/loader.py) are built with it and never changed
after, so what a loader worker unpickles is what was decided. A leaf: a worker imports it, so it imports no
Lightning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from datamodules.sample.batches import RING_SLOTS

SAMPLE_THREADS = 4  # per process: enough reads in flight to hide a local disk's latency on a cold cache


@dataclass(frozen=True)
class LoaderPlan:
    """What one loader was decided to be. The defaults are a loader without workers and without a memory plan
    (a dataset built outside a DataModule's loader: tests, bench).

    workers: worker processes; prefetch: batches each keeps ahead (None without workers); start: how they start
    (--data.worker_start, None without workers); pin_memory, persistent_workers: DataLoader's.
    decode_threads: the CPUs one process of the loader has; above 1 a batch's samples decode side by side
    (sample/dataset.py). ring_slots: the shared-memory batch buffers a worker keeps (budget/memory.py).
    region_decode: a TrainCrop's JPEGs decode only the box's region (region.py); False: always whole.
    overflow: with --data.decode gpu, the workers' share of the device's files (one float64 in shared memory,
    written by the device stage and read by the workers once per batch: balance.py); None otherwise.
    """

    workers: int = 0
    prefetch: int | None = None
    start: str | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    decode_threads: int = SAMPLE_THREADS
    ring_slots: int = RING_SLOTS
    region_decode: bool = True
    overflow: torch.Tensor | None = field(default=None, compare=False, repr=False)


NO_LOADER = LoaderPlan()  # a dataset's plan until a loader plans it
