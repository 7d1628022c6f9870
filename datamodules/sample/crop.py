"""Crop and flip: a decoded uint8 CHW image -> one uint8 CHW sample of the batch's size.

Train: a random-resized-crop box drawn from the image's size (torchvision's RandomResizedCrop
algorithm), an antialiased bilinear resize, and a horizontal flip (of the crop or of the output,
whichever is smaller). Val: the
shorter side resized to size / crop_ratio, then the centre crop (torchvision's Resize(int) +
CenterCrop geometry). Both resize a channels-last uint8 tensor, which takes PyTorch's
vectorised uint8 RGB kernel (aten/src/ATen/native/cpu/UpSampleKernel.cpp,
`_upsample_avx_bilinear_bicubic_uint8`, ported from Pillow-SIMD), about 2x faster than the
generic path and within 1 of PIL's bilinear resize (tests/test_sample_path.py states the bound).

The train size is read per batch (see `sample.SampleDataset`), so `set_train_size` changes it
between epochs; `augment` runs per sample after crop and flip (uint8 CHW in, uint8 CHW out).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

Augment = Callable[..., torch.Tensor]  # (image) or, with `takes_rng = True`, (image, rng)


def resize(image: torch.Tensor, height: int, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 CHW -> uint8 CHW (channels-last memory) of height x width, antialiased bilinear; written into `out`
    (a batch's slot: channels-last 3 x height x width) when given, and `out` returned."""
    x = image[None]
    if x.is_contiguous(memory_format=torch.channels_last):
        # A CHW view of HWC memory (a decoded image) unsqueezes to a batch stride of 3, which takes
        # the kernel off its dense-stride fast path; same memory, same pixels (tested).
        x = x.as_strided(x.shape, (x.numel(), *x.stride()[1:]))
    else:
        x = x.contiguous(memory_format=torch.channels_last)  # a crop view: one copy of the crop
    if x.shape[-2:] == (height, width):
        return x[0] if out is None else out.copy_(x[0])
    if out is None:
        return F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)[0]
    # F.interpolate's own call for these arguments (torch/nn/functional.py), with out=: the structured kernel keeps
    # an out of the right shape as it is (no restride: resize_out in the generated RegisterCPU.cpp) and the uint8
    # kernel writes a channels-last out directly (aten/src/ATen/native/cpu/UpSampleKernelAVXAntialias.h,
    # skip_packing), so the sample lands in the batch without a tensor of its own and a copy
    torch._C._nn._upsample_bilinear2d_aa(x, [height, width], False, None, None, out=out[None])
    return out


def random_resized_box(height: int, width: int, rng: random.Random, scale: tuple[float, float],
                       ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random crop: torchvision's RandomResizedCrop.get_params with `rng`."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: the central crop of the closest allowed aspect ratio
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


class CropPlan(NamedTuple):
    """One sample's geometry, drawn from the image's size alone: the box cut from the image, the size it is
    resized to, the window of that kept (the batch's size x size) and whether it is flipped."""

    top: int
    left: int
    height: int
    width: int
    resize_h: int
    resize_w: int
    window_top: int
    window_left: int
    flip: bool


class TrainCrop:
    """Random resized crop (area min_scale..1, aspect 3/4..4/3) + horizontal flip (+ `augment`)."""

    def __init__(self, min_scale: float = 0.25, augment: Augment | None = None) -> None:
        self.scale = (min_scale, 1.0)
        self.augment = augment

    def plan(self, height: int, width: int, size: int, rng: random.Random) -> CropPlan:
        """The box, then the flip, drawn from `rng` in that order (what `__call__` crops: GPU decode draws it
        in the worker and crops on the device, datamodules/sample/encoded.py)."""
        top, left, h, w = random_resized_box(height, width, rng, self.scale)
        return CropPlan(top, left, h, w, size, size, 0, 0, rng.random() < 0.5)

    def __call__(self, image: torch.Tensor, size: int, rng: random.Random, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return self.cut(image, self.plan(image.shape[-2], image.shape[-1], size, rng), rng, out=out)

    def cut(self, image: torch.Tensor, plan: CropPlan, rng: random.Random, origin: tuple[int, int] = (0, 0),
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The sample of `plan` (drawn from `rng`, which the augment draws from next) out of `image`: the whole
        image, or a region of it whose top-left pixel is the image's `origin` (region decode: sample/region.py).
        `out`: the batch's slot to write it into (and return), else a tensor of its own."""
        top, left, h, w, size, _, _, _, flip = plan
        top, left = top - origin[0], left - origin[1]
        crop = image[:, top:top + h, left:left + w]
        # Flipping commutes with the resize (its sampling grid is symmetric), so flip whichever of the
        # crop and the output has fewer pixels: for ImageNet-size images at 224 px that is the output
        # (a flip of the crop cost about half as much as the resize itself).
        if flip and h * w < size * size:
            crop, flip = crop.flip(-1), False
        if out is not None and not flip and self.augment is None:
            return resize(crop, size, size, out=out)  # straight into the batch
        sample = resize(crop, size, size)
        if flip:
            sample = sample.flip(-1)
        if self.augment is not None:
            # a seeded augment draws from this sample's rng (datamodules/sample/augment.py), never torch's shared one
            sample = self.augment(sample, rng) if getattr(self.augment, "takes_rng", False) else self.augment(sample)
        return sample if out is None else out.copy_(sample)


class ValCrop:
    """Shorter side to round(size / crop_ratio), then the centre size x size (zero-padded if smaller)."""

    def __init__(self, crop_ratio: float = 0.875) -> None:
        self.crop_ratio = crop_ratio

    def resized(self, height: int, width: int, size: int) -> tuple[int, int]:
        """The size the whole image is resized to (torchvision.transforms.v2.functional._geometry.
        _compute_resized_output_size)."""
        short = round(size / self.crop_ratio)
        if height <= width:
            return short, int(short * width / height)
        return int(short * height / width), short

    def plan(self, height: int, width: int, size: int, rng: random.Random | None = None) -> CropPlan | None:
        """The whole image, resized, and its centre window; None when the resized image needs padding."""
        new_h, new_w = self.resized(height, width, size)
        if new_h < size or new_w < size:
            return None
        # torchvision CenterCrop: round((h - size) / 2)
        return CropPlan(0, 0, height, width, new_h, new_w, round((new_h - size) / 2.0),
                        round((new_w - size) / 2.0), False)

    def __call__(self, image: torch.Tensor, size: int, rng: random.Random | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        sample = self._centre(image, size)
        return sample if out is None else out.copy_(sample)

    def _centre(self, image: torch.Tensor, size: int) -> torch.Tensor:
        new_h, new_w = self.resized(image.shape[-2], image.shape[-1], size)
        resized = resize(image, new_h, new_w)
        if new_h < size or new_w < size:
            padded = torch.zeros((3, max(size, new_h), max(size, new_w)), dtype=torch.uint8)
            top, left = (padded.shape[1] - new_h) // 2, (padded.shape[2] - new_w) // 2
            padded[:, top:top + new_h, left:left + new_w] = resized
            resized, new_h, new_w = padded, padded.shape[1], padded.shape[2]
        # torchvision CenterCrop: round((h - size) / 2)
        top, left = round((new_h - size) / 2.0), round((new_w - size) / 2.0)
        return resized[:, top:top + size, left:left + size]
