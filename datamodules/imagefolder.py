"""ImageFolder backend: one file per image, read through its Index by the shared sample path."""
from __future__ import annotations

from collections.abc import Sequence

from torch.utils.data import Dataset

from datamodules.base import ImageDataModule
from datamodules.index import Index
from datamodules.sample.dataset import FileSource

FIX = "Fix or delete the file (or pass --data.skip_invalid true after re-validating the tree)."


class IndexFiles(FileSource):
    """FileSource over an Index's own paths: a worker that unpickles its dataset (--data.worker_start forkserver or
    spawn) gets the Index's compressed arrays (datamodules/index.py), not a list of every absolute path."""

    def __init__(self, index: Index, fix: str) -> None:
        super().__init__([], fix)
        self.paths = IndexPaths(index)


class IndexPaths(Sequence):
    """`paths[i]` is `index.path(i)`."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        return self.index.path(i)


class ImageFolderDataModule(ImageDataModule):
    """Reads an ImageFolder tree through its Index (see ImageDataModule for the args)."""

    def make_dataset(self, split: str, index: Index) -> Dataset:
        return self.sample_dataset(split, IndexFiles(index, FIX), index.labels)
