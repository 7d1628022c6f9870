"""The banded resize (datamodules/sample/banded_resize.py, resize_kernel.py) against the dense form it replaced
(dense_resize.py, the reference): the same pixels, not one apart, on real JPEG crops of every kind; and its work
counted from the plan."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torchvision.io import decode_jpeg

from datamodules.builtin.draw import PRESETS, render
from datamodules.sample.banded_resize import multiply_adds
from datamodules.sample.crop import CropPlan, TrainCrop, ValCrop
from tests.helpers.interpreted import call_interpreted
from tests.helpers.optional import needs_gpus
from tests.helpers.processes import in_child
from tests.helpers.trees import jpeg

SIZE = 45  # odd: a kernel's last block of lanes and rows part full


def real_images(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Decoded JPEGs of the built-in ImageNet-sized data (about 300 to 700 px a side), every fourth cut to an odd
    small size first (down to 3 x 5 px)."""
    rng = random.Random(seed)
    images = []
    for k in range(count):
        image = render(PRESETS["imagenet"], k % 10, seed, "train", k)
        if k % 4 == 3:
            w, h = rng.choice([(3, 5), (37, 23), (61, 90), (121, 45)])
            image = image.crop((0, 0, w, h))
        images.append(decode_jpeg(torch.frombuffer(bytearray(jpeg(image, quality=90)), dtype=torch.uint8)))
    return images


def crops(images: list[torch.Tensor], per_image: int, size: int, seed: int = 0) -> tuple[list[torch.Tensor],
                                                                                      torch.Tensor]:
    """`per_image` plans an image, of every kind in turn: ImageNet's random-resized crops, the validation
    resize and centre window, boxes at the right and bottom edges, 1-pixel crops, thin ones, the whole image;
    flipped at random. Up- and downscales both (the crops run from 1 px to 7 times the size)."""
    rng = random.Random(seed)
    chosen, plans = [], []
    for image in images:
        h, w = image.shape[1:]
        for k in range(per_image):
            kind = k % 6
            if kind == 0:
                plan = TrainCrop(0.08).plan(h, w, size, rng)
            elif kind == 1:
                plan = ValCrop().plan(h, w, size) or TrainCrop(0.08).plan(h, w, size, rng)
            elif kind == 2:  # a box touching the bottom right corner
                bh, bw = rng.randint(1, h), rng.randint(1, w)
                plan = CropPlan(h - bh, w - bw, bh, bw, size, size, 0, 0, rng.random() < 0.5)
            elif kind == 3:  # one pixel, anywhere (the top left corner, once an image)
                top, left = (0, 0) if k < 6 else (rng.randrange(h), rng.randrange(w))
                plan = CropPlan(top, left, 1, 1, size, size, 0, 0, rng.random() < 0.5)
            elif kind == 4:  # a row or a column
                plan = (CropPlan(rng.randrange(h), 0, 1, w, size, size, 0, 0, True) if rng.random() < 0.5 else
                        CropPlan(0, rng.randrange(w), h, 1, size, size, 0, 0, True))
            else:  # the whole image, resized past the size, a window of it kept
                rh, rw = size + rng.randint(0, 30), size + rng.randint(0, 30)
                plan = CropPlan(0, 0, h, w, rh, rw, rng.randint(0, rh - size), rng.randint(0, rw - size),
                                rng.random() < 0.5)
            chosen.append(image)
            plans.append(tuple(int(v) for v in plan))
    return chosen, torch.tensor(plans)


def resized(images: list[torch.Tensor], plans: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    import os

    from datamodules.sample.device_resize import crop_resize_flip

    os.environ["FIC_DEVICE_RESIZE"] = mode
    try:
        return crop_resize_flip(images, plans, size)
    finally:
        del os.environ["FIC_DEVICE_RESIZE"]


def kernels_against_reference(count: int, skip: int, per_image: int, size: int) -> tuple[int, list[list[int]]]:
    """In a fresh interpreter with TRITON_INTERPRET=1 (call_interpreted): the pixels where the kernels' batch and
    the dense form's differ, of the crops of real_images(count)[skip:]; and the plans."""
    images, plans = crops(real_images(count)[skip:], per_image, size)
    got, want = resized(images, plans, size, "triton"), resized(images, plans, size, "dense")
    assert got.shape == (len(plans), 3, size, size) and got.is_contiguous(memory_format=torch.channels_last)
    return int((got != want).sum()), plans.tolist()


def _covers_every_kind(plans: torch.Tensor, size: int) -> None:
    h, w, flip = plans[:, 2], plans[:, 3], plans[:, 8]
    assert ((h == 1) & (w == 1)).any() and (h > 4 * size).any() and ((h < size) & (h > 1)).any()
    assert flip.any() and not flip.all()
    assert (plans[:, 0] + h == 0 + h).any()  # boxes at the top edge
    assert (plans[:, 6] > 0).any() and (plans[:, 7] > 0).any()  # windows of a larger resize


@pytest.mark.parametrize("mode", ["banded", "sparse"])
def test_the_torch_forms_give_the_dense_references_pixels_on_256_real_crops(monkeypatch, mode):
    """The fallback (banded: gathered taps, scripted) and the CPU's form (sparse: CSR products, what auto picks
    on a CPU): 0 pixels apart from the dense form."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    images, plans = crops(real_images(16), 16, SIZE)
    assert len(plans) >= 256
    _covers_every_kind(plans, SIZE)
    got = resized(images, plans, SIZE, mode)
    dense = resized(images, plans, SIZE, "dense")
    assert got.shape == (len(plans), 3, SIZE, SIZE) and got.is_contiguous(memory_format=torch.channels_last)
    assert int((got != dense).sum()) == 0


def test_the_kernels_give_the_dense_references_pixels():
    """The Triton kernels, interpreted on the CPU: 0 pixels apart from the dense form, on 12 real crops of every
    kind from two images, a 432 x 321 photo and a 121 x 45 cut (the interpreter is slow; the slow test below
    takes 256 crops)."""
    differ, plans = in_child(call_interpreted, __name__, "kernels_against_reference", 4, 2, 6, SIZE)
    assert len(plans) == 12 and differ == 0


@pytest.mark.slow
def test_the_kernels_give_the_dense_references_pixels_on_256_real_crops():
    differ, plans = in_child(call_interpreted, __name__, "kernels_against_reference", 16, 0, 16, SIZE, timeout=1800)
    _covers_every_kind(torch.tensor(plans), SIZE)
    assert len(plans) == 256 and differ == 0


def test_the_banded_form_needs_20_times_fewer_multiply_adds_at_imagenet_sizes():
    """ImageNet-sized images (about 500 x 375), the ImageNet recipes' random-resized crops (area 0.08 to 1) at
    224 px, a batch of 256: the banded form's multiply-adds against the dense form's."""
    rng = random.Random(0)
    sizes = [(rng.randint(330, 420), rng.randint(440, 560)) for _ in range(256)]
    plans = [TrainCrop(0.08).plan(h, w, 224, rng) for h, w in sizes]
    banded, dense = multiply_adds(plans, 224)
    assert dense >= 20 * banded, dense / banded


@needs_gpus(1, "CUDA kernels and matmuls")
@pytest.mark.parametrize("mode", ["triton", "banded", "dense"])
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_every_mode_on_the_gpu_gives_the_cpus_dense_pixels(mode, precision):
    """On CUDA, the kernels (compiled, not interpreted), the torch form and the dense form each give the CPU's
    dense batch, pixel for pixel, on 96 real crops at 224 px, whether cuBLAS computes fp32 products in fp32 or
    bf16 (the dense form's two weight parts; scripts/gpu_mutants.py puts one back)."""
    images, plans = crops(real_images(16), 6, 224)
    want = resized(images, plans, 224, "dense")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        got = resized([image.cuda() for image in images], plans, 224, mode).cpu()
    finally:
        torch.set_float32_matmul_precision(before)
    assert int((got != want).sum()) == 0, (got.float() - want.float()).abs().mean()


def test_the_kernels_take_the_batch_in_chunks_the_memory_probe_counts():
    """The kernels' buffers (a crop row's 3 x size bytes, the weights being made) for a run of groups stay within
    what the memory probe counts for the resize (device_decode.py: BYTES_PER_ELEMENT x GROUP_ELEMENTS), however
    large the batch; the chunks cover it in order."""
    from datamodules.sample.device_resize import BYTES_PER_ELEMENT, GROUP_ELEMENTS, resize_plan, working_bytes
    from datamodules.sample.resize_kernel import CHUNK_BYTES, chunk_bytes, chunks

    assert CHUNK_BYTES == BYTES_PER_ELEMENT * GROUP_ELEMENTS
    rng = random.Random(4)
    images = [torch.empty((3, rng.randint(300, 2000), rng.randint(300, 2000)), dtype=torch.uint8)
              for _ in range(2048)]
    plans = torch.tensor([tuple(TrainCrop(0.08).plan(im.shape[1], im.shape[2], 224, rng)) for im in images])
    _, spans = resize_plan(images, plans, 224)
    runs = chunks(spans, 224)
    assert len(runs) > 1 and [r[0] for r in runs] == list(itertools.accumulate([0] + [r[1] for r in runs[:-1]]))
    assert sum(r[1] for r in runs) == len(images) and sum(r[2] for r in runs) == int(plans[:, 2].sum())
    largest = max(chunk_bytes(rows, g, kx, ky, 224) for _, g, rows, kx, ky, _ in runs)
    assert largest <= CHUNK_BYTES and largest <= working_bytes([tuple(p[2:4]) for p in plans.tolist()], 224)
