"""Per-sample train augmentation on uint8 CHW tensors: auto-augment policies and random erasing.

Applied after the random resized crop and flip (the `augment` hook of `train_transform`), so
every PIL/tensor backend gets the same policy. DALI has its own subset: datamodules/dali/augment.py.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

from datamodules.index import DataError
from datamodules.sample.crop import Augment
from datamodules.sample.transforms import IMAGENET_MEAN

AUTO_AUGMENTS = ("trivialaugment", "randaugment", "autoaugment")
# torchvision's reference scripts erase AFTER normalising with value 0, i.e. with the mean colour;
# on uint8 before normalising, that is the ImageNet mean in [0, 255].
ERASE_VALUE = [round(m * 255) for m in IMAGENET_MEAN]


def auto_augment_policy(name: str) -> v2.Transform:
    """torchvision v2's policy for `name` (its defaults, as the torchvision reference recipes use them)."""
    if name == "trivialaugment":
        return v2.TrivialAugmentWide()
    if name == "randaugment":
        return v2.RandAugment()  # num_ops 2, magnitude 9
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    raise DataError(f"data.auto_augment must be one of {', '.join(AUTO_AUGMENTS)} or null, got {name!r}.")


def make_train_augment(auto_augment: str | None = None, random_erasing: float = 0.0) -> Augment | None:
    """The per-sample augmentation for `train_transform(..., augment=...)`, or None when both are off."""
    if not 0.0 <= random_erasing <= 1.0:
        raise DataError(f"data.random_erasing is a probability in [0, 1], got {random_erasing}.")
    steps: list[v2.Transform] = []
    if auto_augment:
        steps.append(auto_augment_policy(str(auto_augment).lower()))
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=ERASE_VALUE))
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else v2.Compose(steps)


def check_uint8(image: torch.Tensor) -> torch.Tensor:
    """What every augmentation must keep: a uint8 CHW tensor."""
    if image.dtype != torch.uint8 or image.ndim != 3:
        raise TypeError(f"augmentations take and return uint8 CHW tensors, got {image.dtype} {tuple(image.shape)}")
    return image
