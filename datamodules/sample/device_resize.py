"""Crop, resize and flip a batch of decoded images on the device: every op of a batch in one call.

The steps, per batch (`assemble`, after the JPEG decode):
1. the host tensors go to the device before any kernel is queued (a copy from pageable memory waits for the
   stream's queued work);
2. the decoded images go into one flat buffer (one `cat`);
3. the crops are gathered, in groups of similar size (`plan_groups`, planned on the host by `resize_plan`:
   crop_table.py), and resized: Pillow's antialiased bilinear, two exact matrix products per group
   (dense_resize.py); the flip is the horizontal weights' rows reversed;
4. the resized samples and the workers' decoded ones take their slots in the channels-last batch.

The call is scripted by TorchScript (`build_on_device`), which runs it without the GIL: op by op, each of its
100 or so ops a group gives the GIL up and waits to take it back behind the training thread's Python.
"""
from __future__ import annotations

import os
import warnings

import torch

from datamodules.sample.crop_table import (  # noqa: F401 - importable from here as before
    GROUP_ELEMENTS,
    PAD_WASTE,
    largest_elements,
    plan_groups,
    resize_plan,
)
from datamodules.sample.dense_resize import resize_groups

# bytes a group holds per element of its largest tensor, at most: the fp32 crops (4), the weights being built
# (3 fp32 temporaries, 12) and the horizontal pass's fp32 output (4); the int32 gather index is freed before
BYTES_PER_ELEMENT = 20


def working_bytes(crops: list[tuple[int, int]], size: int) -> int:
    """The most device memory one group of these crops holds while it is resized (for the memory probe)."""
    return BYTES_PER_ELEMENT * max(
        largest_elements(len(group), max(crops[i][0] for i in group), max(crops[i][1] for i in group), size)
        for group in plan_groups(crops, size))


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
