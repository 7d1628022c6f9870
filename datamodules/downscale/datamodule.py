"""Downscaled backend: the ImageFolder backend on a copy whose shorter sides are at most max_size px.

The copy is made on first use (`datamodules.downscale`) in a cache folder. With
`in_memory=True` all encoded images are read once into one shared-memory buffer that every
DataLoader worker reads in place (fork or spawn), so no worker holds its own copy.

Only the source of the bytes differs from ImageFolder: decoding, crop and batching are the
shared sample path (datamodules/sample/). Every file of a copy is a plain RGB JPEG written by the
downscaler (orientation applied, no EXIF), so it always takes the libjpeg-turbo decoder.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from torch.utils.data import Dataset

from datamodules.base import REPO_ROOT, ImageDataModule, resolve_data_dir
from datamodules.downscale.memory import FIX, MemorySource
from datamodules.downscale.writer import ensure_downscaled, read_marker
from datamodules.errors import DataError
from datamodules.index import Index, find_classes
from datamodules.sample.dataset import FileSource


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
        source = MemorySource(index) if self.in_memory else FileSource(index, FIX)
        return self.sample_dataset(split, source, index.labels)
