"""Crop, resize and flip a batch of decoded images on the device, into the channels-last batch, in a few calls.

The steps, per batch (`build_on_device(device)`'s call, after the JPEG decode):
1. the host tensors go to the device before any kernel is queued (`to_device`: a copy from pageable memory waits
   for the stream's queued work);
2. each crop is resized, Pillow's antialiased bilinear in exact integer arithmetic (weights in 2^-16 steps,
   rounded to uint8 between the passes), and flipped, in the banded form: each output pixel from its own taps
   (banded_resize.py), work that grows with output pixels x taps. Where it runs:
   - on CUDA, two Triton kernels (resize_kernel.py) read the crops in place and write the batch's slots;
   - on a CPU (tests, a CPU run of --data.decode gpu), the taps as sparse CSR matrices, in MKL's sparse products
     (sparse_resize.py: about 8 ops a crop), scripted by TorchScript, on one intra-op thread (`_on_one_thread`:
     it runs beside the step);
   - on CUDA with a torch without triton, the same arithmetic in torch ops (`banded_groups`: gathered taps and
     integer multiply-adds), per group of crops of similar size padded together (crop_table.py), scripted;
3. the workers' decoded samples take their slots in the batch.

`FIC_DEVICE_RESIZE` chooses (MODES): `auto` (the default, as above; `script`, its old name), `triton` (the
kernels, said once where they cannot run), `sparse` (the CPU's form; said once on another device, where the
banded form runs), `banded` (the gathered taps, scripted, on any device), `eager` (the same, op by op from
Python), `dense` (dense_resize.py: the matrix products the banded forms replaced, 99% of them by zero, kept as
the reference the tests compare with; scripted). Every mode gives the same pixels (tests/test_device_resize.py,
tests/test_banded_resize.py).

Why scripted: a TorchScript call runs all its ops without the GIL (torch/csrc/jit/python/pybind_utils.h,
runAndInsertCall), where each eager op gives the GIL up and waits to take it back behind the training thread's
Python: the banded form is about 15 ops a group and a tap. The kernel path is about 12 calls a batch from
Python (the copies, two launches and one scripted call making the weights, per chunk).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from datamodules.sample import resize_kernel
from datamodules.sample.banded_resize import banded_groups
from datamodules.sample.crop_table import (  # noqa: F401 - importable from here as before
    GROUP_ELEMENTS,
    PAD_WASTE,
    PLACE,
    largest_elements,
    plan_groups,
    resize_plan,
)
from datamodules.sample.dense_resize import resize_groups
from datamodules.sample.sparse_resize import csr_resize_into

# bytes a group holds per element of its largest tensor, at most (the GPU memory probe's figure; the sparse form
# runs on a CPU only, where the probe adds no decode buffers). The banded torch form, 16: the crops' gather
# (its int32 index and temporaries, 12, then the uint8 crops, 1, made int32, 4), then a pass's int32 input (4),
# sums (4) and a tap's gathered values (4), rounded in place; the weights (under 2). The dense form, 20: the
# fp32 crops (4), the weights being built (3 fp32 temporaries, 12) and the horizontal pass's fp32 output (4).
# The kernels hold less (resize_kernel.py, CHUNK_BYTES)
BYTES_PER_ELEMENT = 20
MODES = ("auto", "triton", "sparse", "banded", "eager", "dense")


def working_bytes(crops: list[tuple[int, int]], size: int) -> int:
    """The most device memory the resize of these crops holds at once besides the batch and the decoded images
    (for the memory probe): one group's in the torch forms, one chunk's in the kernels."""
    groups = BYTES_PER_ELEMENT * max(
        largest_elements(len(group), max(crops[i][0] for i in group), max(crops[i][1] for i in group), size)
        for group in plan_groups(crops, size))
    return max(groups, resize_kernel.kernel_bytes(crops, size))


def crop_resize_flip(images: list[torch.Tensor], plans: torch.Tensor, size: int) -> torch.Tensor:
    """Decoded (3, H, W) uint8 images and their (n, 9) `CropPlan`s -> (n, 3, size, size) uint8 channels-last, through
    the same call as a batch (`build_on_device`)."""
    n, device = len(images), images[0].device
    table, spans = resize_plan(images, plans, size)
    none = torch.zeros(0, dtype=torch.int64)
    out = torch.empty_strided([n, 3, size, size], [3 * size * size, 1, 3 * size, 3], dtype=torch.uint8, device=device)
    no_pixels = torch.zeros(0, 3, size, size, dtype=torch.uint8)
    build_on_device(device)(images, table, spans, size, out, torch.arange(n), no_pixels, none, none, device)
    return out


def to_device(table: torch.Tensor, slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor,
              labels: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """A batch's host tensors on `device`, copied before any kernel is queued (a copy from pageable memory waits
    for the stream's queued work: none yet)."""
    return [t.to(device, non_blocking=True) for t in [table, slots, pixels, pixel_slots, labels]]


def assemble(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int, out: torch.Tensor,
             slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor, labels: torch.Tensor,
             device: torch.device) -> torch.Tensor:
    """Every device op of one batch after its JPEG decode, in torch ops (`build_on_device` scripts it), written into
    `out`, a preallocated (n, 3, size, size) channels-last uint8 batch on `device`: the host tensors copied first
    (`to_device`), then the banded resize of the decoded images into their slots and the workers' pixels into
    theirs. Returns the labels on the device."""
    table, slots, pixels, pixel_slots, labels = to_device(table, slots, pixels, pixel_slots, labels, device)
    if len(images) > 0:
        out[slots] = banded_groups(images, table, spans, size)
    if pixel_slots.numel() > 0:
        out[pixel_slots] = pixels
    return labels


def assemble_sparse(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int,
                    out: torch.Tensor, slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor,
                    labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`assemble` with the CPU form's resize (sparse_resize.py)."""
    table, slots, pixels, pixel_slots, labels = to_device(table, slots, pixels, pixel_slots, labels, device)
    if len(images) > 0:
        csr_resize_into(images, table, size, out, slots[table[:, 12]])  # each row's slot (column PLACE)
    if pixel_slots.numel() > 0:
        out[pixel_slots] = pixels
    return labels


def assemble_dense(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int,
                   out: torch.Tensor, slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor,
                   labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`assemble` with the dense form's resize (dense_resize.py), the reference."""
    table, slots, pixels, pixel_slots, labels = to_device(table, slots, pixels, pixel_slots, labels, device)
    if len(images) > 0:
        out[slots] = resize_groups(images, table, spans, size).permute(0, 2, 1, 3)
    if pixel_slots.numel() > 0:
        out[pixel_slots] = pixels
    return labels


def assemble_kernel(images: list[torch.Tensor], table: torch.Tensor, spans: list[list[int]], size: int,
                    out: torch.Tensor, slots: torch.Tensor, pixels: torch.Tensor, pixel_slots: torch.Tensor,
                    labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`assemble` through the Triton kernels (resize_kernel.py), where they run (`build_on_device`)."""
    table, slots, pixels, pixel_slots, labels = to_device(table, slots, pixels, pixel_slots, labels, device)
    if images:
        flat = torch.cat([image.reshape(-1) for image in images])
        resize_kernel.resize_into(flat, table, spans, size, out, slots[table[:, PLACE]],
                                  _scripted(resize_kernel.weights))
    if pixel_slots.numel() > 0:
        out[pixel_slots] = pixels
    return labels


def resize_mode() -> str:
    """FIC_DEVICE_RESIZE, checked (module doc)."""
    mode = os.environ.get("FIC_DEVICE_RESIZE", "auto") or "auto"
    mode = "auto" if mode == "script" else mode
    if mode not in MODES:
        raise ValueError(f"FIC_DEVICE_RESIZE={mode!r} is not a device resize: set it to one of {', '.join(MODES)} "
                         "(datamodules/sample/device_resize.py says what each does), or unset it for auto.")
    return mode


_SCRIPTED: dict[Callable, Callable] = {}
_ONE_THREAD: dict[Callable, Callable] = {}
_SAID: set[str] = set()
# OpenMP keeps a thread count per calling thread (libgomp's ICVs; torch.set_num_threads sets the caller's, and
# MKL's mkl_set_num_threads_local); torch's native pool has one count, fixed once work has started
_PER_THREAD_COUNT = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def build_on_device(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The call that crops, resizes and flips a batch on `device`, `assemble`'s signature, as FIC_DEVICE_RESIZE
    says (module doc). A torch without TorchScript (deprecated from torch 2.10) runs the torch forms op by op,
    said once."""
    mode, device = resize_mode(), torch.device(device)
    if device.type == "cpu":
        return _on_one_thread(_chosen(mode, device))
    return _chosen(mode, device)


def _chosen(mode: str, device: torch.device) -> Callable[..., torch.Tensor]:
    if mode == "eager":
        return assemble
    if mode == "dense":
        return _scripted(assemble_dense)
    cpu = device.type == "cpu"
    if mode == "sparse" and not cpu:
        _say_once("sparse", f"FIC_DEVICE_RESIZE=sparse: the sparse form is the CPU's (its memory is not counted by "
                  f"the GPU memory probe); on {device} the banded form runs (the same pixels)")
    if mode in ("auto", "sparse") and cpu:
        return _scripted(assemble_sparse)
    kernels = resize_kernel.runs_on(device)
    if mode == "triton" and not kernels:
        _say_once("triton", "FIC_DEVICE_RESIZE=triton: the kernels need triton and a CUDA device (or "
                  "TRITON_INTERPRET=1); the device resize runs in torch ops here (the same pixels)")
    if mode in ("banded", "sparse") or not kernels:
        return _scripted(assemble)
    return assemble_kernel


def _on_one_thread(fn: Callable) -> Callable:
    """`fn` run with one intra-op thread, where the count is the calling thread's (OpenMP), then the count put
    back. On a CPU the resize runs on the decode thread beside the training step, whose pool has the cores: a
    second team from this thread oversubscribes them, and each op's parallel region then waits for a thread
    the OS has not scheduled (the same batch about 10 times slower at 2 threads than at 1 on a shared 2-core
    machine). DataLoader workers run at one thread for the same reason (torch/utils/data/_utils/worker.py)."""
    if not _PER_THREAD_COUNT:
        return fn
    if fn not in _ONE_THREAD:
        def call(*args):
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn(*args)
            finally:
                torch.set_num_threads(before)

        call.__wrapped__ = fn
        _ONE_THREAD[fn] = call
    return _ONE_THREAD[fn]


def _scripted(fn: Callable) -> Callable:
    """`fn` scripted by TorchScript, once; as it is where TorchScript fails (said once)."""
    if fn not in _SCRIPTED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                _SCRIPTED[fn] = torch.jit.script(fn)
        except Exception as e:  # noqa: BLE001 - any failure to script leaves the same ops, run eagerly
            _say_once("script", f"--data.decode gpu: TorchScript could not compile the device resize ({e}); it runs "
                      "op by op, each taking the GIL")
            _SCRIPTED[fn] = fn
    return _SCRIPTED[fn]


def _say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(message, stacklevel=3)
