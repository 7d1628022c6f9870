"""The device-side normalisation, and torchvision's PIL transforms as the reference of the sample path.

Batches stay uint8 until they reach the device (4x less to copy and pin than float32);
`normalize` runs there, in `on_after_batch_transfer`. The backends crop with `crop.py` on
tensors; `train_transform` / `val_transform` are the same geometry on PIL images, kept for code
that holds PIL images and as the reference tests/test_sample_path.py compares the fast path with.
"""
from __future__ import annotations

import functools

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
    mean, inv_std = _stats(images.device)
    # In place on the one new float tensor, and a multiply rather than a divide (cheaper per element).
    return images.float().sub_(mean).mul_(inv_std)


@functools.cache
def _stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and 1/std in [0, 255] units on ``device``, made once: not a host-to-device copy per batch."""
    with torch.inference_mode(False):  # normal tensors even if the first call comes from validation
        mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
        return mean, 1 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)
