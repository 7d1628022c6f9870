"""Crop, resize and flip a batch of decoded images on the device: every op of a batch in one call.

The steps, per batch (`assemble`, after the JPEG decode):
1. the host tensors go to the device before any kernel is queued (a copy from pageable memory waits for the
   stream's queued work);
2. the decoded images go into one flat buffer (one `cat`);
3. the crops are gathered, in groups of similar size, into one padded tensor per group (`plan_groups`, planned
   on the host by `resize_plan`), the edge pixel repeated into the padding (its weights are 0, so it never shows);
4. the resize is Pillow's antialiased bilinear (`torch.nn.functional.interpolate(antialias=True)` computes
   the same filter, aten/src/ATen/native/UpSample.h `_compute_indices_min_size_weights_aa`): two passes,
   horizontal then vertical, each one batched matrix product with a weight matrix per image whose rows hold
   one output pixel's taps, each rounded to uint8 as Pillow and torch's uint8 kernel round between passes.
   The flip is the horizontal weights' rows reversed;
5. the resized samples and the workers' decoded ones take their slots in the channels-last batch.

The call is scripted by TorchScript (`build_on_device`), which runs it without the GIL: op by op, each of its
100 or so ops a group gives the GIL up and waits to take it back behind the training thread's Python.

Exact arithmetic: each weight is a multiple of 2^-16 (torch's uint8 kernel keeps 14 to 16 bits), split into a
high part (a multiple of 2^-8) and a low part (2^-16 times an integer below 2^8); each pass is the sum of two
products, pixels x high and pixels x low. Pixels (integers below 2^8) and both parts have at most 8
significant bits, exact in bf16 and TF32 as in fp32, and every partial sum is a multiple of 2^-16 below 2^8,
exact in fp32's 24 bits. So a product is exact in any order whatever `torch.set_float32_matmul_precision`
says ("medium" computes in bf16, "high" in TF32), and the device gives the pixels the CPU gives in the tests.
"""
from __future__ import annotations

import itertools
import os
import warnings
from typing import Optional

import torch

WEIGHT_STEPS = 1 << 16  # the weights' resolution (see the module doc)
HIGH_STEPS = 1 << 8  # the high part's
GROUP_ELEMENTS = 1 << 25  # the most elements one group's largest tensor holds
# bytes a group holds per element of its largest tensor, at most: the fp32 crops (4), the weights being built
# (3 fp32 temporaries, 12) and the horizontal pass's fp32 output (4); the int32 gather index is freed before
BYTES_PER_ELEMENT = 20
PAD_WASTE = 1.5  # a group's padded area is at most this times its crops' own
# the plan's columns (datamodules/sample/crop.py CropPlan), the image's place in the flat buffer, its size, and
# the sample's index in the batch
TOP, LEFT, HEIGHT, WIDTH, RESIZE_H, RESIZE_W, WINDOW_TOP, WINDOW_LEFT, FLIP, BASE, IMAGE_H, IMAGE_W, PLACE = range(13)


def plan_groups(crops: list[tuple[int, int]], size: int) -> list[list[int]]:
    """Sample indices in groups to pad together: by crop area, largest first; a group closes when padding
    would waste more than PAD_WASTE or a tensor of it would pass GROUP_ELEMENTS. A crop too large for any
    group is a group of its own."""
    order = sorted(range(len(crops)), key=lambda i: crops[i][0] * crops[i][1], reverse=True)
    groups: list[list[int]] = []
    members: list[int] = []
    hp = wp = area = 0
    for i in order:
        h, w = crops[i]
        n, nh, nw = len(members) + 1, max(hp, h), max(wp, w)
        if members and (n * nh * nw > PAD_WASTE * (area + h * w) or largest_elements(n, nh, nw, size) > GROUP_ELEMENTS):
            groups.append(members)
            members, area, nh, nw = [], 0, h, w
        members.append(i)
        hp, wp, area = nh, nw, area + h * w
    if members:
        groups.append(members)
    return groups


def largest_elements(n: int, height: int, width: int, size: int) -> int:
    """Elements of the largest tensor a group of n crops padded to height x width holds: the crops, a
    pass's weights or output."""
    return n * max(3 * height * width, 3 * height * size, size * max(height, width), 3 * size * size)


def working_bytes(crops: list[tuple[int, int]], size: int) -> int:
    """The most device memory one group of these crops holds while it is resized (for the memory probe)."""
    return BYTES_PER_ELEMENT * max(
        largest_elements(len(group), max(crops[i][0] for i in group), max(crops[i][1] for i in group), size)
        for group in plan_groups(crops, size))


def resize_weights(length: torch.Tensor, target: torch.Tensor, window: torch.Tensor, size: int, n: int,
                   flip: Optional[torch.Tensor] = None, resolution: int = WEIGHT_STEPS,  # noqa: UP045
                   high_resolution: int = HIGH_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (G, size, n) float32 matrices, the high and low parts (module doc): row i holds the taps of output
    pixel window + i of a `length` -> `target` antialiased bilinear resize, over input pixels 0..n-1 (0 past
    `length`), in steps of 2^-16; rows reversed where `flip`. Pillow's `precompute_coeffs` (and torch's):
    center (i + 0.5) * scale, support max(scale, 1), taps from trunc(center - support + 0.5) to
    trunc(center + support + 0.5), triangle filter, normalised."""
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
    weights /= weights.sum(-1, keepdim=True)
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


def resize_plan(images: list[torch.Tensor], plans: torch.Tensor, size: int) -> tuple[torch.Tensor, list[list[int]]]:
    """On the host, no device work: the groups (`plan_groups`) as `resize_groups` takes them. The table, per
    sample in group order: its plan, its place in the flat buffer, the image's height and width, and its index in
    the batch; the spans, per group: its first row in the table, its count, its padded height and width."""
    bases = [0, *itertools.accumulate(image.numel() for image in images)][:len(images)]
    shapes = [(int(image.shape[1]), int(image.shape[2])) for image in images]
    rows = plans.tolist()
    groups = plan_groups([(r[HEIGHT], r[WIDTH]) for r in rows], size)
    spans, start = [], 0
    for group in groups:
        spans.append([start, len(group), max(rows[i][HEIGHT] for i in group), max(rows[i][WIDTH] for i in group)])
        start += len(group)
    table = torch.tensor([[*rows[i], bases[i], *shapes[i], i] for group in groups for i in group], dtype=torch.int64)
    return table.view(-1, PLACE + 1), spans


def crop_resize_flip(images: list[torch.Tensor], plans: torch.Tensor, size: int) -> torch.Tensor:
    """Decoded (3, H, W) uint8 images and their (n, 9) `CropPlan`s -> (n, 3, size, size) uint8 channels-last, through
    the same call as a batch (`build_on_device`)."""
    n, device = len(images), images[0].device
    table, spans = resize_plan(images, plans, size)
    none = torch.zeros(0, dtype=torch.int64)
    out = torch.empty_strided([n, 3, size, size], [3 * size * size, 1, 3 * size, 3], dtype=torch.uint8, device=device)
    no_pixels = torch.zeros(0, 3, size, size, dtype=torch.uint8)
    build_on_device()(images, table, spans, size, out, torch.arange(n), no_pixels, none, none, device)
    return out


def assemble(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int, out: torch.Tensor,
             slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> torch.Tensor:
    """Every device op of one batch after its JPEG decode, in one call (`build_on_device` scripts it), written into
    `out`, a preallocated (n, 3, size, size) channels-last uint8 batch on `device`: the host tensors copied first (a
    copy from pageable memory waits for the stream's queued work: none yet), then the resize of the decoded images
    into their slots and the workers' pixels into theirs. Returns the labels on the device."""
    table = table.to(device, non_blocking=True)
    slots = slots.to(device, non_blocking=True)
    pixels = pixels.to(device, non_blocking=True)
    pixel_slots = pixel_slots.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if len(images) > 0:
        out[slots] = resize_groups(images, table, spans, size).permute(0, 2, 1, 3)
    if pixel_slots.numel() > 0:
        out[pixel_slots] = pixels
    return labels


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
            table[start:start + g].unbind(1)
        crops = _gather(flat, base, image_h, image_w, top, left, height, width, hp, wp).float().view(g, 3 * hp, wp)
        high, low = resize_weights(width, resize_w, window_left, size, wp, flip)
        wide = _product(crops, high.transpose(1, 2), b_low=low.transpose(1, 2))  # (g, 3 * hp, size)
        tall = wide.view(g, 3, hp, size).transpose(1, 2).reshape(g, hp, 3 * size)
        high, low = resize_weights(height, resize_h, window_top, size, hp, None)
        pixels = _product(high, tall, a_low=low).to(torch.uint8).view(g, size, 3, size)
        result.index_copy_(0, place, pixels)
    return result


_SCRIPTED: list = []


def build_on_device():
    """`assemble`, scripted by TorchScript once (FIC_DEVICE_RESIZE=eager: as it is, op by op): a scripted call runs
    all its ops without the GIL (torch/csrc/jit/python/pybind_utils.h, runAndInsertCall), where each eager op gives
    the GIL up and waits to take it back, behind the training thread's Python. A torch without TorchScript (it is
    deprecated from torch 2.10) gets the eager path, said once."""
    if os.environ.get("FIC_DEVICE_RESIZE", "script") != "script":
        return assemble
    if not _SCRIPTED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                _SCRIPTED.append(torch.jit.script(assemble))
        except Exception as e:  # noqa: BLE001 - any failure to script leaves the same ops, run eagerly
            warnings.warn(f"--data.decode gpu: TorchScript could not compile the device resize ({e}); it runs op by "
                          "op, each taking the GIL", stacklevel=2)
            _SCRIPTED.append(assemble)
    return _SCRIPTED[0]


def _gather(flat: torch.Tensor, base: torch.Tensor, image_h: torch.Tensor, image_w: torch.Tensor, top: torch.Tensor,
            left: torch.Tensor, height: torch.Tensor, width: torch.Tensor, hp: int, wp: int) -> torch.Tensor:
    """(g, 3, hp, wp) uint8: each crop from the flat buffer, its last row and column repeated into the
    padding. Index: base + channel * H * W + (top + y) * W + left + x."""
    device = flat.device
    y = torch.minimum(torch.arange(hp, device=device), height[:, None] - 1)  # (g, hp)
    x = torch.minimum(torch.arange(wp, device=device), width[:, None] - 1)  # (g, wp)
    rows = (top[:, None] + y) * image_w[:, None]
    cols = left[:, None] + x
    planes = base[:, None] + torch.arange(3, device=device) * (image_h * image_w)[:, None]
    index_type = torch.int32 if flat.numel() < 2147483648 else torch.int64  # half the index's memory when it can
    index = (planes[:, :, None, None] + rows[:, None, :, None]).to(index_type) + cols[:, None, None, :].to(index_type)
    return flat[index]
