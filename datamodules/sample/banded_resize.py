"""The banded form of the device resize: each output pixel from its own taps only, in integer arithmetic.

Pillow's antialiased bilinear gives output pixel i of a `length` -> `target` pass the taps of input pixels
first(i) .. first(i) + count(i) - 1, count(i) at most ceil(2 * support) (crop_table.py's `taps` adds one for
the rounding of the bounds), with weights in 2^-16 steps (`band_weights`: the dense form's weights,
dense_resize.py, bit for bit, without the zeros). A pass is then, per output pixel, a sum of pixel x step
over its taps in int32 (at most 255 x 2^16 x 1.001, far below 2^31), rounded as Pillow's clip8 rounds its
fixed-point sum: (sum + 2^15) >> 16, clamped to 0..255. The dense form's fp32 products compute the same exact
sums (its module doc), so both forms give the same pixels; the work is output pixels x taps, not crop width x
output width.

`banded_groups` is the form in torch ops, per padded group (crop_table.py): the fallback where the Triton
kernel (resize_kernel.py) cannot run, written for TorchScript. `multiply_adds` counts both forms' work.
"""
from __future__ import annotations

from typing import Optional

import torch

from datamodules.sample.crop_table import gather_crops, plan_groups, taps


def band_weights(length: torch.Tensor, target: torch.Tensor, window: torch.Tensor, size: int, count: int,
                 flip: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    """(G, size) int64 `first` and (G, size, count) int32 `steps`: output pixel window + i of a `length` ->
    `target` pass reads input pixels first .. first + count - 1 with these weights in 2^-16 steps (0 past the
    filter's last tap); both reversed along the output where `flip`. Every float op is dense_resize.py's
    `resize_weights`', on the same operands, so the steps are its steps bit for bit: the normaliser is summed in
    float64, exactly (each weight is a multiple of 2^-24 at most 1), so its value does not hang on the order
    of the sum, which differs between the two forms and between a CPU and a GPU."""
    device = length.device
    scale = length.double() / target.double()  # (G,)
    support = scale.clamp(min=1.0)[:, None]
    out = window[:, None] + torch.arange(size, device=device)  # (G, size)
    center = scale[:, None] * (out + 0.5)
    first = (center - support + 0.5).floor().clamp(min=0)
    last = torch.minimum((center + support + 0.5).floor(), length[:, None].double())
    whole = center.floor()
    j = first[..., None] + torch.arange(count, device=device, dtype=torch.float64)  # (G, size, count)
    offset = (j - whole[..., None]).float() + (0.5 - (center - whole)).float()[..., None]
    weights = (1 - (offset / support.float()[..., None]).abs()).clamp_(min=0)
    weights *= j < last[..., None]
    weights /= weights.double().sum(-1, keepdim=True).float()
    steps = weights.mul_(65536).add_(0.5).floor_().int()  # 2^-16 steps (a literal: TorchScript reads no globals)
    start = first.long()
    if flip is not None:
        flipped = flip[:, None] != 0
        start = torch.where(flipped, start.flip(1), start)
        steps = torch.where(flipped[..., None], steps.flip(1), steps)
    return start, steps


def round_steps(total: torch.Tensor) -> torch.Tensor:
    """A pass's int32 sums of pixel x step -> pixel values, in place: Pillow's clip8 of its fixed-point sum."""
    return total.add_(32768).bitwise_right_shift_(16).clamp_(0, 255)  # (total + 2^15) // 2^16


def banded_pass(pixels: torch.Tensor, dim: int, first: torch.Tensor, steps: torch.Tensor,
                last: torch.Tensor) -> torch.Tensor:
    """One pass over (g, 3, rows, columns) int32 pixels along `dim` (3: along a row, 2: along a column): output
    pixel i of sample s sums pixels first[s, i] + k (clamped to last[s]: its weight there is 0) x steps[s, i, k]
    over the taps k, a gather and an in-place multiply-add a tap; rounded."""
    g, i = first.shape[0], first.shape[1]
    shape = [g, 3, pixels.shape[2], i] if dim == 3 else [g, 3, i, pixels.shape[3]]
    view = [g, 1, 1, i] if dim == 3 else [g, 1, i, 1]
    total = torch.zeros(shape, dtype=torch.int32, device=pixels.device)
    for k in range(steps.shape[2]):
        index = torch.minimum(first + k, last[:, None]).view(view).expand(shape)
        total.addcmul_(pixels.gather(dim, index), steps[:, :, k].reshape(view))
    return round_steps(total)


def banded_groups(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]],
                  size: int) -> torch.Tensor:
    """The banded resize in torch ops: (n, 3, size, size) uint8, a sample per table row's PLACE. Per group: the
    crops gathered padded (crop_table.py) in int32, then each pass (`banded_pass`)."""
    flat = torch.cat([image.reshape(-1) for image in images])
    result = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=flat.device)
    for span in spans:
        start, g, hp, wp, kx, ky = span[0], span[1], span[2], span[3], span[4], span[5]
        top, left, height, width, resize_h, resize_w, window_top, window_left, flip, base, image_h, image_w, place = \
            table[start:start + g, :13].unbind(1)
        first, steps = band_weights(width, resize_w, window_left, size, kx, flip)
        wide = banded_pass(gather_crops(flat, base, image_h, image_w, top, left, height, width, hp, wp).int(), 3,
                           first, steps, width - 1)  # (g, 3, hp, size); the crops freed on return
        first, steps = band_weights(height, resize_h, window_top, size, ky, None)
        result.index_copy_(0, place, banded_pass(wide, 2, first, steps, height - 1).to(torch.uint8))
    return result


def multiply_adds(plans: list[tuple[int, ...]] | torch.Tensor, size: int) -> tuple[int, int]:
    """(banded, dense) multiply-adds of a batch's resize, from its `CropPlan`s: the banded form's as the kernel
    does them (each crop row x output column x channel over its taps, then each output pixel x channel over its
    taps), the dense form's as dense_resize.py does them (two products a pass, the weights' high and low parts,
    over the groups' padded crops)."""
    rows = plans.tolist() if isinstance(plans, torch.Tensor) else [list(p) for p in plans]
    banded = sum(3 * h * size * taps(w, rw) + 3 * size * size * taps(h, rh) for _, _, h, w, rh, rw, *_ in rows)
    dense = 0
    for group in plan_groups([(r[2], r[3]) for r in rows], size):
        hp, wp = max(rows[i][2] for i in group), max(rows[i][3] for i in group)
        dense += 2 * len(group) * (3 * hp * wp * size + size * hp * 3 * size)
    return banded, dense
