"""What every backend shares: the init args of DESIGN.md, the Index, the global batch size.

A backend subclasses `ImageDataModule` and implements `make_dataset(split, index)` (or
overrides the dataloader methods entirely, as DALI does).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from datamodules.augment import make_train_augment
from datamodules.index import DataError, Index, find_classes, load_indexes
from datamodules.transforms import TrainSize, normalize

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILTIN_ROOT = REPO_ROOT / "data" / "builtin"


def resolve_data_dir(data_dir: str | os.PathLike | None, builtin: str) -> Path:
    """`data_dir`, or the built-in dataset (generated on first use) when it is None."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    from datamodules.builtin import ensure_builtin

    return Path(ensure_builtin(builtin, root=BUILTIN_ROOT))


class ImageDataModule(pl.LightningDataModule):
    """Shared init args (DESIGN.md).

    Args:
        data_dir: root holding train/ and val/ (ImageFolder layout); None = the built-in dataset.
        builtin: preset of the built-in dataset used when data_dir is None.
        batch_size: GLOBAL batch size, split evenly across all processes (devices x nodes).
        num_workers: DataLoader worker processes per training process.
        image_size: training crop size (px).
        val_image_size: validation crop size (px); default: image_size.
        val_crop_ratio: validation resizes the shorter side to val_image_size / val_crop_ratio.
        min_scale: smallest area fraction of the random resized crop (ImageNet recipes: 0.08).
        pin_memory: page-locked host batches for faster, asynchronous copies to the GPU.
        persistent_workers: keep workers alive between epochs.
        skip_invalid: leave unreadable files out (listed in a warning) instead of failing.
        auto_augment: per-sample policy after crop and flip: trivialaugment, randaugment, autoaugment, or null.
        random_erasing: probability of erasing a random rectangle (filled with the mean colour), 0 = off.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        builtin: str = "small",
        batch_size: int = 256,
        num_workers: int = 4,
        image_size: int = 224,
        val_image_size: int | None = None,
        val_crop_ratio: float = 0.875,
        min_scale: float = 0.25,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        skip_invalid: bool = False,
        auto_augment: str | None = None,
        random_erasing: float = 0.0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise DataError(f"data.batch_size must be >= 1, got {batch_size}.")
        if not 0 < min_scale <= 1:
            raise DataError(f"data.min_scale must be in (0, 1], got {min_scale}.")
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.image_size = image_size
        self.val_image_size = val_image_size or image_size
        self.val_crop_ratio = val_crop_ratio
        self.min_scale = min_scale
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.skip_invalid = skip_invalid
        self.builtin = builtin
        self.auto_augment = auto_augment
        self.random_erasing = random_erasing
        self.train_augment = make_train_augment(auto_augment, random_erasing)
        self.train_size = TrainSize(image_size)  # shared with the workers; see set_train_size
        # Read now (cheaply, and before any process group starts) so a bad layout fails
        # at once and num_classes can be linked to the model.
        self.classes = self.discover_classes()
        self.indexes: dict[str, Index] = {}
        self.datasets: dict[str, Dataset] = {}

    # -- what a backend may override -------------------------------------------------------
    def discover_classes(self) -> list[str]:
        self.root = resolve_data_dir(self.data_dir, self.builtin)
        return find_classes(self.root)

    def load_indexes(self) -> dict[str, Index]:
        return load_indexes(self.root)

    def make_dataset(self, split: str, index: Index) -> Dataset:
        raise NotImplementedError

    # -- shared behaviour -----------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def world_size(self) -> int:
        trainer = self.trainer
        return trainer.world_size if trainer is not None else 1

    @property
    def per_process_batch_size(self) -> int:
        world = self.world_size
        if self.batch_size < world:
            raise DataError(
                f"data.batch_size {self.batch_size} is the GLOBAL batch size and must be at least "
                f"the number of processes ({world})."
            )
        if self.batch_size % world:
            warnings.warn(
                f"data.batch_size {self.batch_size} is not divisible by {world} processes: "
                f"each uses {self.batch_size // world}.",
                stacklevel=2,
            )
        return self.batch_size // world

    def set_train_size(self, size: int) -> None:
        """Train crop size from the next train iterator on (progressive resizing, lightning_app/schedules.py).

        Call it between epochs, before the epoch's iterator is made: persistent workers read the new
        size from shared memory; batches still in flight from an unfinished epoch are discarded when
        the DataLoader's iterator is reset, so no batch mixes sizes.
        """
        if int(size) < 1:
            raise DataError(f"train size must be >= 1 px, got {size}.")
        self.train_size.set(int(size))

    def setup(self, stage: str | None = None) -> None:
        if self.indexes:
            return
        indexes = self.load_indexes()
        for split, index in indexes.items():
            if index.bad_files:
                if not self.skip_invalid:
                    index.raise_if_bad()
                warnings.warn(
                    f"skipping {len(index.bad_files)} unreadable file(s) in {split}/, e.g. "
                    f"{index.bad_files[0][0]} ({index.bad_files[0][1]})",
                    stacklevel=2,
                )
            if index.empty_classes:
                warnings.warn(
                    f"{split}/ has empty class folder(s) {index.empty_classes}: they keep their labels.",
                    stacklevel=2,
                )
        self.indexes = indexes
        self.datasets = {split: self.make_dataset(split, index) for split, index in indexes.items()}

    def _loader(self, split: str, train: bool) -> DataLoader:
        workers = self.num_workers
        batch_size = self.per_process_batch_size
        if train and len(self.datasets[split]) < batch_size * self.world_size:
            raise DataError(
                f"{split}/ of {self.root} has {len(self.datasets[split])} images, fewer than one global batch "
                f"({self.batch_size}); lower --data.batch_size."
            )
        sampler = None
        if train:
            # The same shuffle whatever the layout: with seed s, epoch e's global batch k is the same
            # images on 1 process, N processes or N nodes (each rank takes every N-th of them).
            # Lightning calls set_epoch on it, and leaves a DistributedSampler alone under DDP.
            trainer = self.trainer
            sampler = DistributedSampler(
                self.datasets[split], num_replicas=self.world_size,
                rank=trainer.global_rank if trainer is not None else 0, shuffle=True,
                seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), drop_last=True,
            )
        return DataLoader(
            self.datasets[split],
            batch_size=batch_size,
            sampler=sampler,
            drop_last=train,  # equal steps on every rank, no tiny last batch in BatchNorm
            num_workers=workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.persistent_workers and workers > 0,
            prefetch_factor=4 if workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch[0], batch[1]
        return normalize(images), labels
