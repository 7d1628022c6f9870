"""The one sample path of the ImageFolder, LMDB and Downscaled backends: source -> decode -> crop -> batch.

A backend only says where a sample's encoded bytes come from (a `Source`); decoding
(`decode.decode`), crop and flip (`crop.TrainCrop` / `crop.ValCrop`) and batching are shared.

A DataLoader calls `SampleDataset.__getitems__(indices)` once per batch (torch/utils/data/_utils/
fetch.py, _MapDatasetFetcher). It writes every sample straight into one preallocated uint8
batch tensor, in shared memory when it runs in a worker (a reused ring buffer: batches.py), and
the loader's `collate_fn` is `built_batch`, which returns it as it is. The samples of a batch run on a small
thread pool: file reads wait on the disk with the GIL released, and libjpeg-turbo decoding and
the resize release it too (decode.py says where), so a worker overlaps its reads and, on a
machine with spare cores, its decodes.

Random crops are drawn from one `random.Random` per sample, seeded from torch's generator in the
calling thread, so a seeded run gives the same crops whatever order the threads finish in.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch
from torch.utils.data import Dataset, get_worker_info

from datamodules.batches import RingBatch, fill_batch, new_batch
from datamodules.decode import decode
from datamodules.index import DataError, Index

SAMPLE_THREADS = 4  # per process: enough reads in flight to hide a local disk's latency on a cold cache


class Source(Protocol):
    """Where the encoded bytes of sample i come from."""

    def read(self, i: int) -> bytes | bytearray | memoryview: ...

    def describe(self, i: int, error: Exception) -> str:
        """The error message for an unusable sample: names it and says how to fix it."""


class FileSource:
    """One file per sample: the paths of an Index (or a list of paths); `fix` ends an error message."""

    def __init__(self, index: Index | Sequence[str], fix: str) -> None:
        self.paths = [index.path(i) for i in range(len(index))] if isinstance(index, Index) else list(index)
        self.fix = fix

    def read(self, i: int) -> bytearray:
        with open(self.paths[i], "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(data)
        return data if n == len(data) else data[:n]

    def describe(self, i: int, error: Exception) -> str:
        return f"cannot decode image {self.paths[i]}: {error}. {self.fix}"


_pool: tuple[int, ThreadPoolExecutor] | None = None


def sample_pool() -> ThreadPoolExecutor:
    """This process's sample threads (made after any fork: a pool never crosses one)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(SAMPLE_THREADS, thread_name_prefix="sample"))
    return _pool[1]


class SampleDataset(Dataset):
    """Samples of `source`, decoded, cropped to `size()` and written a whole batch at a time.

    `size` is read once per batch (a batch never mixes sizes); `crop` is `TrainCrop` or `ValCrop`.
    """

    def __init__(self, source: Source, labels: Sequence[int], crop: Callable, size: int | torch.Tensor) -> None:
        self.source = source
        self.labels = torch.as_tensor(list(labels), dtype=torch.int64)
        self.crop = crop
        self._size = size

    def __len__(self) -> int:
        return len(self.labels)

    def size(self) -> int:
        return int(self._size[0]) if isinstance(self._size, torch.Tensor) else int(self._size)

    def sample(self, i: int, size: int, rng: random.Random | None = None) -> torch.Tensor:
        """Sample i as a uint8 CHW tensor of size x size."""
        try:
            image = decode(self.source.read(i))
        except Exception as e:
            raise DataError(self.source.describe(i, e)) from e
        return self.crop(image, size, rng or random.Random(int(torch.randint(2**62, ()))))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.sample(i, self.size()), int(self.labels[i])

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.size()
        images = new_batch(len(indices), size)
        seeds = torch.randint(2**62, (len(indices),)).tolist()
        # A failure (a DataError naming the sample) is re-raised here, in this thread.
        fill_batch(images, lambda k: self.sample(indices[k], size, random.Random(seeds[k])), sample_pool())
        labels = self.labels[list(indices)]
        return RingBatch((images, labels)) if get_worker_info() is not None else (images, labels)
