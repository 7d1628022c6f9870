"""The device resize's plan, made on the host: a batch's crops in groups, and the table the device reads.

`resize_plan` turns the decoded images and their `CropPlan`s (crop.py) into one int64 table, a row a sample in
group order, and the groups' spans. Every device form of the resize (device_resize.py) reads the same table.
"""
from __future__ import annotations

import itertools
import math

import torch

GROUP_ELEMENTS = 1 << 25  # the most elements one group's largest tensor holds
PAD_WASTE = 1.5  # a group's padded area is at most this times its crops' own
# the plan's columns (datamodules/sample/crop.py CropPlan), the image's place in the flat buffer, its size, the
# sample's index in the batch, and the most taps an output pixel of each pass reads (`taps`)
TOP, LEFT, HEIGHT, WIDTH, RESIZE_H, RESIZE_W, WINDOW_TOP, WINDOW_LEFT, FLIP, BASE, IMAGE_H, IMAGE_W, PLACE = range(13)
TAPS_X, TAPS_Y = 13, 14


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


def taps(length: int, target: int) -> int:
    """The most input pixels an output pixel of a `length` -> `target` pass of the antialiased bilinear reads:
    ceil(2 * support) lie within support of a centre, and one more for the rounding of the bounds
    (floor(b) - floor(a) <= floor(b - a) + 1 for any a, b)."""
    return math.ceil(2 * max(length / target, 1.0)) + 1


def resize_plan(images: list[torch.Tensor], plans: torch.Tensor, size: int) -> tuple[torch.Tensor, list[list[int]]]:
    """On the host, no device work: the groups (`plan_groups`) as the device resize takes them. The table, per
    sample in group order: its plan, its place in the flat buffer, the image's height and width, and its index in
    the batch, and its two passes' `taps`; the spans, per group: its first row in the table, its count, its padded
    height and width, its most taps of each pass, and its crops' rows."""
    bases = [0, *itertools.accumulate(image.numel() for image in images)][:len(images)]
    shapes = [(int(image.shape[1]), int(image.shape[2])) for image in images]
    rows = plans.tolist()
    groups = plan_groups([(r[HEIGHT], r[WIDTH]) for r in rows], size)
    spans, start = [], 0
    counts = [(taps(r[WIDTH], r[RESIZE_W]), taps(r[HEIGHT], r[RESIZE_H])) for r in rows]
    for group in groups:
        spans.append([start, len(group), max(rows[i][HEIGHT] for i in group), max(rows[i][WIDTH] for i in group),
                      max(counts[i][0] for i in group), max(counts[i][1] for i in group),
                      sum(rows[i][HEIGHT] for i in group)])
        start += len(group)
    table = torch.tensor([[*rows[i], bases[i], *shapes[i], i, *counts[i]] for group in groups for i in group],
                         dtype=torch.int64)
    return table.view(-1, TAPS_Y + 1), spans


def gather_crops(flat: torch.Tensor, base: torch.Tensor, image_h: torch.Tensor, image_w: torch.Tensor,
                 top: torch.Tensor, left: torch.Tensor, height: torch.Tensor, width: torch.Tensor, hp: int,
                 wp: int) -> torch.Tensor:
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
