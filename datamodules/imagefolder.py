"""ImageFolder backend: one file per image, decoded by PIL in DataLoader workers."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import Dataset

from datamodules.base import ImageDataModule
from datamodules.images import decode_rgb
from datamodules.index import DataError, Index
from datamodules.transforms import train_transform, val_transform


class IndexDataset(Dataset):
    """The samples of an Index, read as files and decoded to RGB."""

    def __init__(self, index: Index, transform: Callable) -> None:
        self.index = index
        self.transform = transform

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.index.path(i)
        try:
            image = decode_rgb(path)
        except Exception as e:  # noqa: BLE001 - any decoder failure must name the file
            raise DataError(
                f"cannot decode image {path}: {e}. Fix or delete the file "
                "(or pass --data.skip_invalid true after re-validating the tree)."
            ) from e
        return self.transform(image), self.index.samples[i][1]


class ImageFolderDataModule(ImageDataModule):
    """Reads an ImageFolder tree through its Index (see ImageDataModule for the args)."""

    def make_dataset(self, split: str, index: Index) -> Dataset:
        if split == "train":
            transform = train_transform(self.train_size, self.min_scale, augment=self.train_augment)
        else:
            transform = val_transform(self.val_image_size, self.val_crop_ratio)
        return IndexDataset(index, transform)
