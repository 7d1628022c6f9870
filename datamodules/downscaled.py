"""Downscaled backend: the ImageFolder backend on a copy whose shorter sides are at most max_size px.

The copy is made on first use (`datamodules.downscale`) in a cache folder. With
`in_memory=True` all encoded images are read once into one shared-memory buffer that every
DataLoader worker reads in place (fork or spawn), so no worker holds its own copy.
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

from datamodules.base import REPO_ROOT, ImageDataModule, resolve_data_dir
from datamodules.downscale import ensure_downscaled, read_marker
from datamodules.images import decode_rgb
from datamodules.imagefolder import IndexDataset
from datamodules.index import DataError, Index, find_classes
from datamodules.transforms import train_transform, val_transform


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
            image = decode_rgb(memoryview(self.buffer.numpy()[start:end]))
        except Exception as e:  # noqa: BLE001 - name the file, whatever the decoder raised
            raise DataError(f"cannot decode image {self.index.path(i)}: {e}. Delete the downscaled copy and rerun.") from e
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
            transform = train_transform(self.image_size, self.min_scale)
        else:
            transform = val_transform(self.val_image_size, self.val_crop_ratio)
        return InMemoryDataset(index, transform) if self.in_memory else IndexDataset(index, transform)
