"""The CPU form of the device resize: the banded weights (banded_resize.py) as sparse CSR matrices, in products
torch hands to MKL's sparse BLAS (aten/src/ATen/native/mkl/SparseBlasImpl.cpp; torch's own loop without MKL).

A pass is one product: weights (size x length: a row an output pixel, holding its taps) @ pixels (a row a pixel
along the pass). A crop at a time, so that what it goes through stays in the caches: the crop copied transposed
and made float in one copy, (width, 3 x height); times its horizontal weights; the (size, 3, height) sums
rounded as they are transposed to (height, size x 3); times its vertical weights, whose (size, size x 3) sums
are the slot's channels-last layout, made uint8 as they are copied there. About 8 ops a crop.

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
group's memory a tap, about 15 ops a group and a tap; and on a CPU each op is a parallel region of the intra-op
pool, which on a loaded machine can cost a scheduler slice. The working memory is a few MB (the largest
crop's), reused from crop to crop: a batch-sized buffer (100 MB for 64 crops at 224 px) cost its page faults and
its trips to memory, 20% more CPU time on the 2-core VM. `python -m bench.gpu.resize_split` measures the forms.
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


def csr_resize_into(images: list[torch.Tensor], table: torch.Tensor, size: int, out: torch.Tensor,
                    places: torch.Tensor) -> None:
    """Each crop of `table` (crop_table.py's columns, as literals: TorchScript reads no globals) from the decoded
    (3, H, W) uint8 `images` (the column PLACE indexes them), resized and flipped into out[places[row]], `out` a
    (n, 3, size, size) uint8 batch (channels-last in training). A crop at a time, both passes, so that what it
    goes through stays in the caches. Written for TorchScript (device_resize.py scripts it)."""
    height, width, resize_h, resize_w = table[:, 2], table[:, 3], table[:, 4], table[:, 5]
    window_top, window_left, flip = table[:, 6], table[:, 7], table[:, 8]
    first_x, steps_x = band_weights(width, resize_w, window_left, size, int(table[:, 13].max()), flip)  # TAPS_X
    first_y, steps_y = band_weights(height, resize_h, window_top, size, int(table[:, 14].max()), None)  # TAPS_Y
    # each pass's rounding column: the row of ones after the crop's last pixel along it
    pointers_x, columns_x, values_x, ends_x = csr_parts(first_x, steps_x, width)
    pointers_y, columns_y, values_y, ends_y = csr_parts(first_y, steps_y, height)
    # clip8's clamp, needed only where a row's steps pass 65664 (255 x 65665 + 2^15 >= 2^24: taps past 256)
    clamp_x, clamp_y = int(steps_x.sum(-1).max()) > 65664, int(steps_y.sum(-1).max()) > 65664
    rows: list[list[int]] = table[:, :13].tolist()
    ends: list[list[int]] = torch.stack([ends_x, ends_y], 1).tolist()
    slots: list[int] = places.tolist()
    device, lanes, tallest = table.device, 3 * size, int(height.max())
    # one buffer each, for the largest crop: the crop transposed (and a row of ones), its horizontal sums, those
    # rounded and transposed (and a row of ones), its vertical sums
    crops = torch.empty(int(((width + 1) * height).max()) * 3, dtype=torch.float32, device=device)
    products = torch.empty(size * 3 * tallest, dtype=torch.float32, device=device)
    wides = torch.empty((tallest + 1) * lanes, dtype=torch.float32, device=device)
    tall = torch.empty((size, lanes), dtype=torch.float32, device=device)
    for k in range(len(rows)):
        top, left, h, w, place = rows[k][0], rows[k][1], rows[k][2], rows[k][3], rows[k][12]
        begin_x, begin_y = (ends[k - 1][0], ends[k - 1][1]) if k > 0 else (0, 0)
        crop = crops[:(w + 1) * 3 * h].view(w + 1, 3 * h)
        crop[:w].view(w, 3, h).copy_(images[place][:, top:top + h, left:left + w].permute(2, 0, 1))
        crop[w].fill_(1.0)
        weights = torch.sparse_csr_tensor(pointers_x[k], columns_x[begin_x:ends[k][0]],
                                          values_x[begin_x:ends[k][0]], [size, w + 1])
        product = products[:size * 3 * h].view(size, 3 * h)
        # beta = 0: what the output held is ignored, NaN included (torch.addmm's documentation)
        torch.addmm(product, weights, crop, beta=0.0, out=product)
        wide = wides[:(h + 1) * lanes].view(h + 1, lanes)
        torch.floor(product.view(lanes, h).t(), out=wide[:h])  # (size, 3, h) -> (h, size, 3)
        if clamp_x:
            wide[:h].clamp_(max=255.0)
        wide[h].fill_(1.0)
        weights = torch.sparse_csr_tensor(pointers_y[k], columns_y[begin_y:ends[k][1]],
                                          values_y[begin_y:ends[k][1]], [size, h + 1])
        torch.addmm(tall, weights, wide, beta=0.0, out=tall)  # (size, size, 3): the slot's channels-last layout
        if clamp_y:
            tall.clamp_(max=255.0)
        out[slots[k]].permute(1, 2, 0).copy_(tall.view(size, size, 3))  # a positive float made uint8: its floor
