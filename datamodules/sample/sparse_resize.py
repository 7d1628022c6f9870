"""The CPU form of the device resize: the banded weights (banded_resize.py) as sparse CSR matrices, in products
torch hands to MKL's sparse BLAS (aten/src/ATen/native/mkl/SparseBlasImpl.cpp; torch's own loop without MKL).

A pass is one product: weights (size x length: a row an output pixel, holding its taps) @ pixels (a row a pixel
along the pass). The horizontal pass goes crop by crop: the crop copied transposed and made float in one copy,
(width, 3 x height), times its weights; the (size, 3, height) result goes transposed into `wide`, (crop rows
of the whole batch, size x 3), rounded as it goes. The vertical pass is one product for the batch, with a
block-diagonal matrix (a block a crop), whose (n x size, size x 3) result is the batch's channels-last layout.

Exact in float32: the values are the steps x 2^-16 (the steps integers 0 .. 2^16, never negative: the triangle
filter is clamped at 0 in `band_weights`), the pixels integers 0 .. 255, so every product and partial sum of a
row is a multiple of 2^-16 below 2^8 (at most 255 x (2^16 + taps / 2) + 2^15 steps of 2^-16 < 2^24), which
float32 holds exactly in any order of summation (MKL's vector lanes, fused multiply-adds). Each row has one more
tap, 2^-15 times a pixel of 1 (a column past the crop, a row of ones in the dense side), so a sum is
(sum of pixel x step + 2^15) / 2^16 and its floor, clamped to 255, is `round_steps`' result, bit for bit (the
sum is at least 1/2, never negative). Not a dense float32 matmul: with `torch.set_float32_matmul_precision`
at "medium" oneDNN computes those in bf16 on a CPU that has it (8 bits of a 16-bit step); the sparse products
have no such mode.

Why this on a CPU rather than `banded_groups`: there a tap is a gather and a multiply-add, two passes over a
group's memory a tap, about 15 ops a group and a tap; here a crop is 4 ops and the batch about 20 besides, and
on a CPU each op is a parallel region of the intra-op pool, which on a loaded machine can cost a scheduler
slice. `python -m bench.gpu.resize_split` measures both. The working memory (about 100 MB for 64 crops at 224 px)
is the caller's, kept from batch to batch: a fresh tensor of that size costs its page faults, which took about
twice the time of the products themselves (MKL's sparse product into a kept 38 MB output: 11 ms; `torch.mm`,
which allocates it: 55 ms, on the 2-core VM).
"""
from __future__ import annotations

import warnings

import torch

from datamodules.sample.banded_resize import band_weights

with warnings.catch_warnings():  # torch says once a process that CSR tensors are beta and their invariants
    warnings.simplefilter("ignore", UserWarning)  # unchecked (`csr_parts` keeps them): said here, unseen
    torch.sparse_csr_tensor(torch.tensor([0, 0]), torch.tensor([], dtype=torch.int64), torch.tensor([]), [1, 1])


def csr_parts(first: torch.Tensor, steps: torch.Tensor, rounding: torch.Tensor) -> list[torch.Tensor]:
    """`band_weights`' (n, size) `first` and (n, size, count) `steps` -> each sample's CSR matrix in four
    tensors: the row pointers, (n, size + 1), each sample's from 0; the columns and the values of all samples'
    taps one after another; and where each sample's taps end in those, (n,). The values are the steps x 2^-16,
    and each row ends with 2^-15 at column `rounding` (the sample's; module doc). Zero steps are left out, so a
    row's columns are distinct and increasing (a tap past the crop's edge has a zero step): the CSR invariants,
    which torch does not check by default (torch.sparse.check_sparse_tensor_invariants)."""
    n, size, count = steps.shape[0], steps.shape[1], steps.shape[2]
    half = torch.full((n, size, 1), 32768, dtype=steps.dtype, device=steps.device)
    steps = torch.cat([steps, half], 2)
    columns = torch.cat([first[:, :, None] + torch.arange(count, device=steps.device),
                         rounding[:, None, None].expand(n, size, 1)], 2)
    kept = steps != 0
    pointers = torch.zeros((n, size + 1), dtype=torch.int64, device=steps.device)
    pointers[:, 1:] = kept.sum(-1).cumsum(1)
    return [pointers, columns[kept], steps[kept].float().mul_(1.0 / 65536.0), pointers[:, -1].cumsum(0)]


def csr_resize(images: list[torch.Tensor], table: torch.Tensor, size: int, floats: torch.Tensor,
               pixels: torch.Tensor) -> list[torch.Tensor]:
    """The resized crops, (n, size, size, 3) uint8, a sample per `table` row (crop_table.py's columns, as
    literals: TorchScript reads no globals), from the decoded (3, H, W) uint8 `images`, which the column PLACE
    indexes; and the working memory, float32 and uint8, for the next call: `floats` and `pixels` where they were
    large enough, else larger ones. The memory is the caller's to keep: a fresh tensor of this size costs its
    page faults, more than the products (module doc). Written for TorchScript (device_resize.py scripts it)."""
    n = table.shape[0]
    height, width, resize_h, resize_w = table[:, 2], table[:, 3], table[:, 4], table[:, 5]
    window_top, window_left, flip = table[:, 6], table[:, 7], table[:, 8]
    first_x, steps_x = band_weights(width, resize_w, window_left, size, int(table[:, 13].max()), flip)  # TAPS_X
    first_y, steps_y = band_weights(height, resize_h, window_top, size, int(table[:, 14].max()), None)  # TAPS_Y
    pointers_x, columns_x, values_x, ends_x = csr_parts(first_x, steps_x, width)  # the ones: the crop's last row
    rows: list[list[int]] = table[:, :13].tolist()
    ends: list[int] = ends_x.tolist()
    device = table.device
    # the working memory, in one tensor: `wide` (the crops' rows, size x 3, and a row of ones), the vertical
    # pass's sums, one crop transposed (and a row of ones), one crop's horizontal sums
    crop_rows, lanes = int(height.sum()), 3 * size
    sizes = [(crop_rows + 1) * lanes, n * size * lanes, int(((width + 1) * height).max()) * 3,
             size * 3 * int(height.max())]
    if floats.numel() < sum(sizes):
        floats = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    if pixels.numel() < n * size * lanes:
        pixels = torch.empty(n * size * lanes, dtype=torch.uint8, device=device)
    wide, tall, crops, products = floats[:sum(sizes)].split(sizes)
    wide = wide.view(crop_rows + 1, lanes)
    row = 0
    for k in range(len(rows)):
        top, left, h, w, place = rows[k][0], rows[k][1], rows[k][2], rows[k][3], rows[k][12]
        crop = crops[:(w + 1) * 3 * h].view(w + 1, 3 * h)
        crop[:w].view(w, 3, h).copy_(images[place][:, top:top + h, left:left + w].permute(2, 0, 1))
        crop[w].fill_(1.0)
        begin = ends[k - 1] if k > 0 else 0
        weights = torch.sparse_csr_tensor(pointers_x[k], columns_x[begin:ends[k]], values_x[begin:ends[k]],
                                          [size, w + 1])
        product = products[:size * 3 * h].view(size, 3 * h)
        # beta = 0: what `product` held is ignored, NaN included (torch.addmm's documentation)
        torch.addmm(product, weights, crop, beta=0.0, out=product)
        torch.floor(product.view(3 * size, h).t(), out=wide[row:row + h])  # (size, 3, h) -> (h, size, 3)
        row += h
    # clip8's clamp, needed only where a row's steps pass 65664 (255 x 65665 + 2^15 >= 2^24: taps past 256)
    if int(steps_x.sum(-1).max()) > 65664:
        wide[:row].clamp_(max=255.0)
    wide[row].fill_(1.0)
    # one block-diagonal matrix: sample k's rows from k x size, its columns from its first row in `wide`, its
    # rounding's column the last row (of ones)
    starts = height.cumsum(0) - height
    pointers_y, columns_y, values_y, ends_y = csr_parts(first_y, steps_y, row - starts)
    counts = pointers_y[:, -1]
    pointers = torch.cat([(pointers_y[:, :-1] + (ends_y - counts)[:, None]).reshape(-1), ends_y[-1:]])
    columns = columns_y + torch.repeat_interleave(starts, counts)
    weights = torch.sparse_csr_tensor(pointers, columns, values_y, [n * size, row + 1])
    tall = tall.view(n * size, lanes)
    torch.addmm(tall, weights, wide, beta=0.0, out=tall)
    if int(steps_y.sum(-1).max()) > 65664:
        tall.clamp_(max=255.0)
    resized = pixels[:n * size * lanes].view(n, size, size, 3)
    resized.copy_(tall.view(n, size, size, 3))  # a positive float made uint8: its floor
    return [resized, floats, pixels]
