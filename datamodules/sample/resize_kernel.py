"""The banded resize (banded_resize.py) as two Triton kernels: crop, both passes, flip and placement, in one
read of the decoded images and one write of the batch.

`_horizontal`: a program per (sample, block of crop rows, block of output columns x channels); each lane reads
its output column's taps straight from the flat buffer of decoded images (the crop is an offset, no copy) and
writes the rounded row into `wide`, a (crop rows, size, 3) uint8 buffer per sample. `_vertical`: a program per
(sample, block of output rows, block of columns x channels) reads its taps' rows of `wide` and writes the
rounded pixels into the sample's slot of the channels-last batch. The flip is in the weights (band_weights
reverses them), so both kernels only multiply and add integers: the pixels are the torch form's wherever they
run, and the weights are computed once, by the torch ops both forms share.

Two kernels, not one: an output row's vertical taps overlap its neighbours', so one kernel would either
recompute each horizontal row for every output row that reads it (taps / scale times the horizontal work:
about 2x at ImageNet sizes to 224 px) or stage a tile of rows on chip and pick each output row's taps from it
(a `tl.gather` over a register tile, per row). What fusing would save is one write and one read of `wide`:
3 x size bytes a crop row, about 65 MB a batch of 256 ImageNet crops at 224 px, some 30 us of an H200's
memory bandwidth; each kernel stays a plain loop over its taps.

Without CUDA or Triton the kernels do not run (`runs_on`); `TRITON_INTERPRET=1`, set before triton is first
imported, runs them on CPU tensors (the tests, in a fresh interpreter).
"""
from __future__ import annotations

import os

import torch

from datamodules.sample.banded_resize import band_weights
from datamodules.sample.crop_table import (
    BASE,
    HEIGHT,
    IMAGE_H,
    IMAGE_W,
    LEFT,
    TAPS_X,
    TAPS_Y,
    TOP,
    WIDTH,
    plan_groups,
    taps,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch comes without triton: the torch form runs (device_resize.py)
    triton = None

# a program's block: crop rows (horizontal) or output rows (vertical), by output columns x channels (channels
# innermost, as in the batch); the interpreter's (numpy, an op at a time) larger, for fewer programs
BLOCKS = (16, 128)
INTERPRETED_BLOCKS = (256, 256)
TABLE_BYTES = 48  # device bytes per tap of an output pixel of a pass while the weights are made (band_weights)
CHUNK_BYTES = 20 << 25  # the most a chunk of samples holds: what device_resize.py's groups may (BYTES_PER_ELEMENT x
# GROUP_ELEMENTS), which the memory probe counts


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: triton imported, and a CUDA device or the interpreter."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def chunk_bytes(rows: int, samples: int, taps_x: int, taps_y: int, size: int) -> int:
    """Device bytes the kernels' pass over a chunk holds: `wide` and the two passes' weights being made."""
    return 3 * size * rows + TABLE_BYTES * size * samples * (taps_x + taps_y)


def chunks(spans: list[list[int]], size: int) -> list[list[int]]:
    """Runs of consecutive groups (crop_table.py spans) the kernels take at once, as [first table row, rows past
    it, crop rows, most taps of each pass, tallest crop]: as many groups as fit CHUNK_BYTES (one at least)."""
    runs: list[list[int]] = []
    for start, g, hp, _, kx, ky, rows in spans:
        if runs:
            run = runs[-1]
            merged = [run[0], run[1] + g, run[2] + rows, max(run[3], kx), max(run[4], ky), max(run[5], hp)]
            if chunk_bytes(merged[2], merged[1], merged[3], merged[4], size) <= CHUNK_BYTES:
                runs[-1] = merged
                continue
        runs.append([start, g, rows, kx, ky, hp])
    return runs


def kernel_bytes(crops: list[tuple[int, int]], size: int) -> int:
    """The most device memory a chunk of these crops holds in the kernels' pass (for the memory probe): each
    crop's taps as at `size` x `size`, the most a crop resized to at least the batch's size reads."""
    spans, start = [], 0
    for group in plan_groups(crops, size):
        spans.append([start, len(group), max(crops[i][0] for i in group), 0,
                      max(taps(crops[i][1], size) for i in group), max(taps(crops[i][0], size) for i in group),
                      sum(crops[i][0] for i in group)])
        start += len(group)
    return max(chunk_bytes(rows, g, kx, ky, size) for _, g, rows, kx, ky, _ in chunks(spans, size))


def weights(part: torch.Tensor, size: int, taps_x: int, taps_y: int) -> list[torch.Tensor]:
    """A chunk's weights (band_weights) and each sample's first row in `wide`, in one call (scripted by
    device_resize.py, so that its ops run without the GIL)."""
    _, _, height, width, resize_h, resize_w, window_top, window_left, flip = part[:, :9].unbind(1)  # CropPlan's
    first_x, steps_x = band_weights(width, resize_w, window_left, size, taps_x, flip)
    first_y, steps_y = band_weights(height, resize_h, window_top, size, taps_y, None)
    return [first_x, steps_x, first_y, steps_y, height.cumsum(0) - height]


def resize_into(flat: torch.Tensor, table: torch.Tensor, spans: list[list[int]], size: int, out: torch.Tensor,
                dest: torch.Tensor, make_weights=weights) -> None:
    """Resize the crops of `table` (on the device, crop_table.py's columns) from `flat`, each into out[dest[row]]
    (`out` a (n, 3, size, size) uint8 batch of any strides: channels-last in training)."""
    lanes = 3 * size
    block_rows, block_lanes = BLOCKS if flat.is_cuda else INTERPRETED_BLOCKS
    for start, g, rows, taps_x, taps_y, tallest in chunks(spans, size):
        part = table[start:start + g]
        first_x, steps_x, first_y, steps_y, row_start = make_weights(part, size, taps_x, taps_y)
        wide = torch.empty(rows * lanes, dtype=torch.uint8, device=flat.device)
        _horizontal[(g, triton.cdiv(tallest, block_rows), triton.cdiv(lanes, block_lanes))](
            flat, part, part.stride(0), first_x, steps_x, taps_x, wide, row_start, size,
            BLOCK_ROWS=block_rows, BLOCK_LANES=block_lanes)
        _vertical[(g, triton.cdiv(size, block_rows), triton.cdiv(lanes, block_lanes))](
            wide, part, part.stride(0), first_y, steps_y, taps_y, row_start, size, out, dest[start:start + g],
            out.stride(0), out.stride(1), out.stride(2), out.stride(3),
            BLOCK_ROWS=block_rows, BLOCK_LANES=block_lanes)


if triton is not None:
    # the table's columns (crop_table.py), as the kernels read them
    _TOP, _LEFT, _HEIGHT, _WIDTH = tl.constexpr(TOP), tl.constexpr(LEFT), tl.constexpr(HEIGHT), tl.constexpr(WIDTH)
    _BASE, _IMAGE_H, _IMAGE_W = tl.constexpr(BASE), tl.constexpr(IMAGE_H), tl.constexpr(IMAGE_W)
    _TAPS_X, _TAPS_Y = tl.constexpr(TAPS_X), tl.constexpr(TAPS_Y)

    @triton.jit
    def _horizontal(flat, table, stride, first, steps, count, wide, row_start, size,
                    BLOCK_ROWS: tl.constexpr, BLOCK_LANES: tl.constexpr):
        i = tl.program_id(0)
        r0 = tl.program_id(1) * BLOCK_ROWS
        sample = table + i * stride
        height = tl.load(sample + _HEIGHT)
        if r0 >= height:  # a shorter crop than the chunk's tallest
            return
        top, left, width = tl.load(sample + _TOP), tl.load(sample + _LEFT), tl.load(sample + _WIDTH)
        image_w = tl.load(sample + _IMAGE_W)
        plane = tl.load(sample + _IMAGE_H) * image_w
        base = tl.load(sample + _BASE)
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        lanes = tl.program_id(2) * BLOCK_LANES + tl.arange(0, BLOCK_LANES)
        x, c = lanes // 3, lanes % 3
        used = lanes < 3 * size
        keep = (rows < height)[:, None] & used[None, :]
        start = tl.load(first + i * size + x, mask=used, other=0)
        pixels = flat + (base + c * plane + left)[None, :] + ((top + rows) * image_w)[:, None]
        weights = steps + (i * size + x) * count
        total = tl.zeros((BLOCK_ROWS, BLOCK_LANES), dtype=tl.int32)
        for k in range(tl.load(sample + _TAPS_X)):
            column = tl.minimum(start + k, width - 1)  # a tap past the filter's last has the weight 0
            weight = tl.load(weights + k, mask=used, other=0)
            pixel = tl.load(pixels + column[None, :], mask=keep, other=0)
            total += pixel.to(tl.int32) * weight[None, :]
        value = tl.minimum(tl.maximum((total + 32768) >> 16, 0), 255)  # banded_resize.py round_steps
        place = (tl.load(row_start + i) + rows)[:, None] * (3 * size) + lanes[None, :]
        tl.store(wide + place, value.to(tl.uint8), mask=keep)

    @triton.jit
    def _vertical(wide, table, stride, first, steps, count, row_start, size, out, dest, out_n, out_c, out_y, out_x,
                  BLOCK_ROWS: tl.constexpr, BLOCK_LANES: tl.constexpr):
        i = tl.program_id(0)
        sample = table + i * stride
        height = tl.load(sample + _HEIGHT)
        ys = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        lanes = tl.program_id(2) * BLOCK_LANES + tl.arange(0, BLOCK_LANES)
        x, c = lanes // 3, lanes % 3
        inside = ys < size
        keep = inside[:, None] & (lanes < 3 * size)[None, :]
        start = tl.load(first + i * size + ys, mask=inside, other=0)
        pixels = wide + tl.load(row_start + i) * (3 * size) + lanes[None, :]
        weights = steps + (i * size + ys) * count
        total = tl.zeros((BLOCK_ROWS, BLOCK_LANES), dtype=tl.int32)
        for k in range(tl.load(sample + _TAPS_Y)):
            row = tl.minimum(start + k, height - 1)
            weight = tl.load(weights + k, mask=inside, other=0)
            pixel = tl.load(pixels + (row * (3 * size))[:, None], mask=keep, other=0)
            total += pixel.to(tl.int32) * weight[:, None]
        value = tl.minimum(tl.maximum((total + 32768) >> 16, 0), 255)
        slot = tl.load(dest + i)
        place = slot * out_n + (ys * out_y)[:, None] + (x * out_x + c * out_c)[None, :]
        tl.store(out + place, value.to(tl.uint8), mask=keep)
