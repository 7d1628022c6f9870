"""What a fit's tree must hold, checked from the config before any class is built or any banner printed.

The DataModule refuses a train split smaller than one global batch only when its first loader is made
(datamodules/loaders.py, `_loader`): after the model, the Trainer's banner, the model table and the data line. Here
the train images are counted (only up to the batch: a large tree costs one listing of a few folders) straight
from the config, so a small tree gets its paragraph, with a batch that fits, before anything else.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_app.errors import UserError

# the backends that read an ImageFolder tree from data_dir (the others read a pack: LMDB, shards)
TREE_BACKENDS = ("ImageFolderDataModule", "DALIDataModule", "DownscaledDataModule")


def images_up_to(train: Path, limit: int) -> int:
    """The images under train/<class>/ (nested folders too), counted until `limit` is reached."""
    from datamodules.sample.images import is_image_name

    count = 0
    for _, _, files in os.walk(train, followlinks=True):
        count += sum(1 for f in files if is_image_name(f))
        if count >= limit:
            break
    return count


def batch_for(images: int) -> int:
    """A global batch for a small tree: the largest power of two that gives 8 to 16 steps an epoch, at least 1."""
    batch = 1
    while batch * 2 <= max(1, images // 8):
        batch *= 2
    return batch


def check_tree_holds_a_batch(class_path: str | None, data: Mapping[str, Any]) -> None:
    """Refuse a fit of a tree with fewer than 2 classes (datamodules/index.py), or whose train/ has fewer images than
    one global batch, naming a --data.batch_size that fits."""
    if not class_path or class_path.rpartition(".")[2] not in TREE_BACKENDS or data.get("data_dir") is None:
        return
    batch = data.get("batch_size")
    train = Path(str(data["data_dir"])).expanduser() / "train"
    if not isinstance(batch, int) or not train.is_dir():  # a bad layout gets the DataModule's own paragraph
        return
    from datamodules.index import find_classes

    find_classes(train.parent)  # the layout and the classes first (one class is refused): folder names only
    images = images_up_to(train, batch)
    if 0 < images < batch:
        raise UserError(
            f"{train} has {images} images, fewer than one global batch (--data.batch_size {batch}): an epoch would "
            f"have no step. Pass --data.batch_size {batch_for(images)} (8 to 16 steps an epoch; the learning rate "
            "scales with it, per 256 images) or add images (docs/data.md, \"Your own data\").")
