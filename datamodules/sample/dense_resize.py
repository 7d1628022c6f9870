"""The dense form of the device resize: Pillow's antialiased bilinear as two batched matrix products per group.

The reference the banded form (banded_resize.py, resize_kernel.py) is tested against, pixel for pixel, and
`FIC_DEVICE_RESIZE=dense` (device_resize.py). Per group of similar crops (crop_table.py): the crops gathered
into one padded tensor, the edge pixel repeated into the padding (its weights are 0, so it never shows); then
two passes, horizontal then vertical, each one batched matrix product with a weight matrix per image whose rows
hold one output pixel's taps (`torch.nn.functional.interpolate(antialias=True)` computes the same filter,
aten/src/ATen/native/UpSample.h `_compute_indices_min_size_weights_aa`), each rounded to uint8 as Pillow and
torch's uint8 kernel round between passes. The flip is the horizontal weights' rows reversed. Each row holds a
handful of taps among hundreds of columns: about 99% of the products are by zero.

Exact arithmetic: each weight is a multiple of 2^-16 (torch's uint8 kernel keeps 14 to 16 bits), split into a
high part (a multiple of 2^-8) and a low part (2^-16 times an integer below 2^8); each pass is the sum of two
products, pixels x high and pixels x low. Pixels (integers below 2^8) and both parts have at most 8
significant bits, exact in bf16 and TF32 as in fp32, and every partial sum is a multiple of 2^-16 below 2^8,
exact in fp32's 24 bits. So a product is exact in any order whatever `torch.set_float32_matmul_precision`
says ("medium" computes in bf16, "high" in TF32), and the device gives the pixels the CPU gives in the tests.
"""
from __future__ import annotations

from typing import Optional

import torch

from datamodules.sample.crop_table import gather_crops

WEIGHT_STEPS = 1 << 16  # the weights' resolution (see the module doc)
HIGH_STEPS = 1 << 8  # the high part's


def resize_weights(length: torch.Tensor, target: torch.Tensor, window: torch.Tensor, size: int, n: int,
                   flip: Optional[torch.Tensor] = None, resolution: int = WEIGHT_STEPS,  # noqa: UP045
                   high_resolution: int = HIGH_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (G, size, n) float32 matrices, the high and low parts (module doc): row i holds the taps of output
    pixel window + i of a `length` -> `target` antialiased bilinear resize, over input pixels 0..n-1 (0 past
    `length`), in steps of 2^-16; rows reversed where `flip`. Pillow's `precompute_coeffs` (and torch's):
    center (i + 0.5) * scale, support max(scale, 1), taps from trunc(center - support + 0.5) to
    trunc(center + support + 0.5), triangle filter, normalised by a sum in float64, which is exact (each weight is
    a multiple of 2^-24 at most 1), so that the weights do not hang on the order a device sums in."""
    device = length.device
    scale = length.double() / target.double()  # (G,)
    support = scale.clamp(min=1.0)[:, None]
    out = window[:, None] + torch.arange(size, device=device)  # (G, size)
    center = scale[:, None] * (out + 0.5)
    first = (center - support + 0.5).floor().clamp(min=0)
    last = torch.minimum((center + support + 0.5).floor(), length[:, None].double())
    # distance in float32 from an exact integer part: (j - floor(center)) + (0.5 - frac(center))
    whole = center.floor()
    j = torch.arange(n, device=device, dtype=torch.float64)
    offset = (j - whole[..., None]).float() + (0.5 - (center - whole)).float()[..., None]
    weights = (1 - (offset / support.float()[..., None]).abs()).clamp_(min=0)
    weights *= (j >= first[..., None]) & (j < last[..., None])
    weights /= weights.double().sum(-1, keepdim=True).float()
    steps = weights.mul_(resolution).add_(0.5).floor_()  # integers up to 2^16
    if flip is not None:
        steps = torch.where(flip[:, None, None] != 0, steps.flip(1), steps)
    high = steps.div(resolution // high_resolution).floor_()
    low = steps.sub_(high * (resolution // high_resolution)).div_(resolution)
    return high.div_(high_resolution), low


def _product(a: torch.Tensor, b: torch.Tensor, b_low: Optional[torch.Tensor] = None,  # noqa: UP045
             a_low: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """a @ b, the weights given as high + low parts (either side), rounded to uint8 values: one exact pass."""
    if b_low is not None:
        return _round(torch.baddbmm(torch.bmm(a, b_low), a, b))
    assert a_low is not None
    return _round(torch.baddbmm(torch.bmm(a_low, b), a, b))


def _round(x: torch.Tensor) -> torch.Tensor:
    """Round half up and clamp to 0..255, in place: Pillow's clip8 of its fixed-point sum."""
    return x.add_(0.5).floor_().clamp_(0, 255)


def resize_groups(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int) -> torch.Tensor:
    """The tensor work of `crop_resize_flip`: (n, size, 3, size) uint8. `table`: per sample (in group order) its
    plan, its place in the flat buffer, the image's height and width, and its index in the batch; `spans`: per
    group its first row in `table`, its count and its padded height and width. Written for TorchScript too."""
    flat = torch.cat([image.reshape(-1) for image in images])
    result = torch.empty((len(images), size, 3, size), dtype=torch.uint8, device=flat.device)
    for span in spans:
        start, g, hp, wp = span[0], span[1], span[2], span[3]
        # the table's columns (TOP ... PLACE above), each (g,)
        top, left, height, width, resize_h, resize_w, window_top, window_left, flip, base, image_h, image_w, place = \
            table[start:start + g, :13].unbind(1)
        crops = gather_crops(flat, base, image_h, image_w, top, left, height, width, hp, wp).float().view(g, 3 * hp, wp)
        high, low = resize_weights(width, resize_w, window_left, size, wp, flip)
        wide = _product(crops, high.transpose(1, 2), b_low=low.transpose(1, 2))  # (g, 3 * hp, size)
        tall = wide.view(g, 3, hp, size).transpose(1, 2).reshape(g, hp, 3 * size)
        high, low = resize_weights(height, resize_h, window_top, size, hp, None)
        pixels = _product(high, tall, a_low=low).to(torch.uint8).view(g, size, 3, size)
        result.index_copy_(0, place, pixels)
    return result
