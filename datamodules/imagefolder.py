"""ImageFolder backend: one file per image, read through its Index by the shared sample path."""
from __future__ import annotations

from torch.utils.data import Dataset

from datamodules.base import ImageDataModule
from datamodules.index import Index
from datamodules.sample.dataset import FileSource

FIX = "Fix or delete the file (or pass --data.skip_invalid true after re-validating the tree)."


class ImageFolderDataModule(ImageDataModule):
    """Reads an ImageFolder tree through its Index (see ImageDataModule for the args)."""

    def make_dataset(self, split: str, index: Index) -> Dataset:
        return self.sample_dataset(split, FileSource(index, FIX), index.labels)
