"""A downscaled copy held in RAM for every loader worker (DownscaledDataModule in_memory): kept apart from the
DataModule so that a worker that unpickles its dataset (--data.worker_start forkserver, spawn) imports no Lightning."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from datamodules.errors import DataError
from datamodules.index import Index, IndexPaths

FIX = "Delete the downscaled copy (or this file) and rerun."


class MemorySource:
    """The files of an Index held encoded in RAM: one uint8 tensor in shared memory plus offsets."""

    def __init__(self, index: Index, threads: int = 8) -> None:
        self.paths = IndexPaths(index)  # pickled to a forkserver or spawned worker as the Index: compact
        sizes = np.fromiter((os.path.getsize(p) for p in self.paths), dtype=np.int64, count=len(self.paths))
        offsets = np.zeros(len(self.paths) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        # Shared memory: forked workers see the same pages, and spawned ones receive a handle, not a copy.
        self.buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8).share_memory_()
        self.offsets = torch.from_numpy(offsets).share_memory_()  # so too the offsets, 8 bytes a sample
        view = self.buffer.numpy()

        def load(i: int) -> None:
            with open(self.paths[i], "rb") as f:
                n = f.readinto(memoryview(view[offsets[i]:offsets[i + 1]]))
            if n != sizes[i]:
                raise DataError(f"{self.paths[i]} changed size while it was loaded into memory; run again.")

        with ThreadPoolExecutor(threads) as pool:  # file reads release the GIL
            list(pool.map(load, range(len(self.paths))))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def read(self, i: int) -> torch.Tensor:
        return self.buffer[int(self.offsets[i]):int(self.offsets[i + 1])]  # a view: no copy of the bytes

    def describe(self, i: int, error: Exception) -> str:
        return f"cannot decode image {self.paths[i]}: {error}. {FIX}"
