"""Downscaled backend: the ImageFolder backend on a copy whose shorter sides are at most max_size px.

The copy is made on first use (`datamodules.downscale`) in a cache folder. With
`in_memory=True` all encoded images are read once into one shared-memory buffer that every
DataLoader worker reads in place (fork or spawn), so no worker holds its own copy.

Every file of a copy is a plain RGB JPEG written by the downscaler (orientation applied, no
EXIF), so it is decoded straight to a uint8 tensor by torchvision's libjpeg-turbo decoder
(the same pixels as PIL, about 3x faster on small images), and the crop and resize run on
that tensor, which is about 2x faster than on a PIL image. Anything else falls back to PIL.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.base import REPO_ROOT, ImageDataModule, resolve_data_dir
from datamodules.downscale import ensure_downscaled, read_marker
from datamodules.images import decode_rgb
from datamodules.index import DataError, Index, find_classes
from datamodules.transforms import TensorTrainTransform, val_transform


READ_THREADS = 8


def decode_copy(data: torch.Tensor) -> torch.Tensor:
    """Encoded bytes of a downscaled copy (1-D uint8) -> RGB uint8 CHW tensor."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB)
    except RuntimeError:  # not a JPEG after all: PIL reads everything else
        return torch.from_numpy(np.array(decode_rgb(data.numpy().tobytes()))).permute(2, 0, 1)


def _undecodable(path: Path, e: Exception) -> DataError:
    return DataError(f"cannot decode image {path}: {e}. Delete the downscaled copy (or this file) and rerun.")


_readers: tuple[int, ThreadPoolExecutor] | None = None


def _reader_pool() -> ThreadPoolExecutor:
    """This process's file-reading threads (made after any fork: a pool never crosses one)."""
    global _readers
    if _readers is None or _readers[0] != os.getpid():
        _readers = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read"))
    return _readers[1]


def _read(path: Path) -> bytearray | Exception:
    try:
        with open(path, "rb") as f:
            return bytearray(f.read())
    except OSError as e:
        return e


class CopyDataset(Dataset):
    """The files of a downscaled copy's Index, decoded to uint8 tensors.

    A DataLoader fetches a whole batch with `__getitems__`: its files are read by READ_THREADS
    threads at once, so on a cold page cache the read latencies overlap instead of adding up
    (the small files of a copy are bound by latency, not by bandwidth).
    """

    def __init__(self, index: Index, transform: Callable) -> None:
        self.index = index
        self.transform = transform

    def __len__(self) -> int:
        return len(self.index)

    def _sample(self, i: int, data: bytearray | Exception) -> tuple[torch.Tensor, int]:
        try:
            if isinstance(data, Exception):
                raise data
            image = decode_copy(torch.frombuffer(data, dtype=torch.uint8))
        except Exception as e:  # noqa: BLE001 - name the file, whatever the reader or decoder raised
            raise _undecodable(self.index.path(i), e) from e
        return self.transform(image), self.index.samples[i][1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self._sample(i, _read(self.index.path(i)))

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        blobs = _reader_pool().map(_read, [self.index.path(i) for i in indices])
        return [self._sample(i, data) for i, data in zip(indices, blobs)]


class InMemoryDataset(Dataset):
    """The files of an Index held encoded in RAM: one uint8 tensor in shared memory plus offsets."""

    def __init__(self, index: Index, transform: Callable, threads: int = 8) -> None:
        self.index = index
        self.labels = torch.tensor(index.labels, dtype=torch.int64)
        self.transform = transform
        paths = [index.path(i) for i in range(len(index))]
        sizes = np.fromiter((os.path.getsize(p) for p in paths), dtype=np.int64, count=len(paths))
        offsets = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        # Shared memory: forked workers see the same pages, and spawned ones receive a handle, not a copy.
        self.buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8).share_memory_()
        self.offsets = torch.from_numpy(offsets)
        view = self.buffer.numpy()

        def load(i: int) -> None:
            with open(paths[i], "rb") as f:
                n = f.readinto(memoryview(view[offsets[i]:offsets[i + 1]]))
            if n != sizes[i]:
                raise DataError(f"{paths[i]} changed size while it was loaded into memory; run again.")

        with ThreadPoolExecutor(threads) as pool:  # file reads release the GIL
            list(pool.map(load, range(len(paths))))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        try:
            image = decode_copy(self.buffer[start:end])  # a view: no copy of the encoded bytes
        except Exception as e:  # noqa: BLE001 - name the file, whatever the decoder raised
            raise _undecodable(self.index.path(i), e) from e
        return self.transform(image), int(self.labels[i])


def default_cache(root: Path, max_size: int) -> Path:
    digest = hashlib.sha1(str(root.absolute()).encode()).hexdigest()[:10]
    return REPO_ROOT / "data" / "downscaled" / f"{root.name}-{digest}-{max_size}"


class DownscaledDataModule(ImageDataModule):
    """ImageFolder data read from a downscaled copy (see ImageDataModule for the shared args).

    Args:
        data_dir: the ORIGINAL ImageFolder root (None = the built-in dataset). A copy made by
            `python -m datamodules.downscale` with a max size <= max_size is used as it is.
        max_size: shorter side of the copy's images, px (never upscaled). Train small and
            validate larger with image_size / val_image_size (both cropped from the copy).
        quality: JPEG quality of the copy.
        in_memory: hold every encoded image of the copy in RAM once, shared by all workers.
        cache_dir: where the copy goes (default data/downscaled/<name>-<hash of root>-<max_size>).
        downscale_workers: processes for making the copy (default: all cores).
    """

    def __init__(self, data_dir: str | None = None, max_size: int = 160, quality: int = 90,
                 in_memory: bool = False, cache_dir: str | None = None, downscale_workers: int | None = None,
                 **kwargs) -> None:
        if max_size < 1:
            raise DataError(f"data.max_size must be >= 1, got {max_size}.")
        self.max_size = max_size
        self.quality = quality
        self.in_memory = in_memory
        self.cache_dir = cache_dir
        self.downscale_workers = downscale_workers
        super().__init__(data_dir=data_dir, **kwargs)

    def discover_classes(self) -> list[str]:
        src = resolve_data_dir(self.data_dir, self.builtin)
        find_classes(src)  # a clear error for a bad layout before anything is written
        marker = read_marker(src)
        if marker and marker.get("max_size", self.max_size + 1) <= self.max_size and marker.get("quality") is not None:
            self.source_root = Path(marker.get("source_root", src))
            self.root = src  # already a complete downscaled copy
        else:
            self.source_root = src
            dst = Path(self.cache_dir).expanduser() if self.cache_dir else default_cache(src, self.max_size)
            self.root = ensure_downscaled(src, dst, self.max_size, quality=self.quality,
                                          skip_invalid=self.skip_invalid, workers=self.downscale_workers)
        return find_classes(self.root)

    def make_dataset(self, split: str, index: Index) -> Dataset:
        if split == "train":
            transform = TensorTrainTransform(self.train_size, self.min_scale, augment=self.train_augment)
        else:
            transform = val_transform(self.val_image_size, self.val_crop_ratio)
        return InMemoryDataset(index, transform) if self.in_memory else CopyDataset(index, transform)
