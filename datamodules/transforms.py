"""torchvision transforms shared by the PIL-based backends.

Transforms stop at uint8 CHW tensors: the uint8 batch crosses to the device (4x less to
copy and pin than float32) and `normalize` runs there, in `on_after_batch_transfer`.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(image_size: int, min_scale: float = 0.25) -> v2.Compose:
    """Random resized crop (scale min_scale..1) and horizontal flip, as uint8 CHW."""
    return v2.Compose([
        v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.PILToTensor(),
    ])


def val_transform(image_size: int, crop_ratio: float = 0.875) -> v2.Compose:
    """Resize the shorter side to image_size / crop_ratio, then center-crop image_size."""
    return v2.Compose([
        v2.Resize(round(image_size / crop_ratio), antialias=True),
        v2.CenterCrop(image_size),
        v2.PILToTensor(),
    ])


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW in [0, 255] -> float, normalised with the ImageNet mean and std."""
    if images.dtype != torch.uint8:
        return images
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255
    return (images.float() - mean) / std
