"""The batched crop, resize and flip of --data.decode gpu (datamodules/sample/device_resize.py), on the CPU: the
same code and arithmetic run on the device."""
from __future__ import annotations

import inspect
import random

import pytest
import torch
import torch.nn.functional as F

from datamodules.sample.crop import TrainCrop, ValCrop, resize
from datamodules.sample.dense_resize import resize_weights
from datamodules.sample.device_resize import (
    _PER_THREAD_COUNT,
    GROUP_ELEMENTS,
    PAD_WASTE,
    crop_resize_flip,
    largest_elements,
    plan_groups,
)

SIZE = 48


def _images_and_plans(count: int, seed: int = 0) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """Textured images of many sizes (from 30 px, upscaled, to 360 px, downscaled 7x) with train and val plans."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    images, plans = [], []
    for k in range(count):
        h, w = rng.randint(30, 360), rng.randint(30, 360)
        coarse = torch.rand(1, 3, h // 6 + 2, w // 6 + 2, generator=gen) * 255
        smooth = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[0]
        noisy = smooth + torch.randint(0, 40, (3, h, w), generator=gen)
        images.append(noisy.clamp(0, 255).to(torch.uint8).contiguous())
        plan = ValCrop().plan(h, w, SIZE) if k % 3 == 0 else None
        plans.append(tuple(plan or TrainCrop(0.08).plan(h, w, SIZE, rng)))
    return images, plans


def _cpu_path(image: torch.Tensor, plan: tuple[int, ...]) -> torch.Tensor:
    top, left, h, w, rh, rw, wt, wl, flip = plan
    out = resize(image[:, top:top + h, left:left + w], rh, rw)[:, wt:wt + SIZE, wl:wl + SIZE]
    return out.flip(-1) if flip else out


def test_batched_resize_gives_the_cpu_paths_pixels():
    """Against torch's uint8 antialiased kernel (the CPU path's resize), crop by crop: a grey level apart at
    most, in under 1% of the pixels (the weights' last bits differ: 2^-16 here, 2^-14 to 2^-16 there)."""
    images, plans = _images_and_plans(60)
    got = crop_resize_flip(images, torch.tensor(plans), SIZE)
    assert got.shape == (60, 3, SIZE, SIZE) and got.dtype == torch.uint8
    want = torch.stack([_cpu_path(image, plan) for image, plan in zip(images, plans, strict=True)])
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 1 and diff.mean() < 0.01, (diff.mean(), diff.max())
    assert any(p[8] for p in plans) and not all(p[8] for p in plans)  # both flips, both directions of scale
    assert any(p[2] < SIZE for p in plans) and any(p[2] > 4 * SIZE for p in plans)


def test_groups_do_not_change_pixels():
    """A batch in several padded groups gives each crop what it gets alone (the padding never shows)."""
    images, plans = _images_and_plans(24, seed=1)
    assert len(plan_groups([p[2:4] for p in plans], SIZE)) > 3
    together = crop_resize_flip(images, torch.tensor(plans), SIZE)
    for k, (image, plan) in enumerate(zip(images, plans, strict=True)):
        assert torch.equal(together[k], crop_resize_flip([image], torch.tensor([plan]), SIZE)[0]), plan


@pytest.mark.parametrize("length,target", [(37, SIZE), (SIZE, SIZE), (200, SIZE), (1500, SIZE)])
def test_weights_are_exact_in_bf16_and_their_products_in_fp32(length, target):
    """What makes the device's pixels the CPU's whatever the matmul precision (module doc): both weight parts
    survive a round trip through bf16 (8 significant bits; TF32 keeps 11), and a pass summed in fp32 equals
    the same pass in fp64."""
    lengths = torch.tensor([length, length])
    high, low = resize_weights(lengths, torch.tensor([target] * 2), torch.tensor([0, 0]), target, length + 5,
                               flip=torch.tensor([0, 1]))
    for part in (high, low):
        assert torch.equal(part.bfloat16().float(), part)
    assert torch.equal(high[1] + low[1], (high[0] + low[0]).flip(0))  # the flip: the rows reversed
    total = (high + low).double().sum(-1)
    assert (total - 1).abs().max() < 1e-3 and (high + low)[:, :, length:].abs().max() == 0  # none past the crop
    pixels = torch.randint(0, 256, (2, 3 * 7, length + 5)).float()
    fp32 = torch.baddbmm(torch.bmm(pixels, low.transpose(1, 2)), pixels, high.transpose(1, 2))
    fp64 = pixels.double() @ (high + low).double().transpose(1, 2)
    assert torch.equal(fp32.double(), fp64)


def test_an_identity_resize_copies_the_crop():
    """Crop size = output size: the weights are the identity, the pixels the crop's, flipped where asked."""
    image = torch.randint(0, 256, (3, 90, 120), dtype=torch.uint8)
    plans = torch.tensor([[10, 20, SIZE, SIZE, SIZE, SIZE, 0, 0, 0], [5, 7, SIZE, SIZE, SIZE, SIZE, 0, 0, 1]])
    got = crop_resize_flip([image, image], plans, SIZE)
    assert torch.equal(got[0], image[:, 10:10 + SIZE, 20:20 + SIZE])
    assert torch.equal(got[1], image[:, 5:5 + SIZE, 7:7 + SIZE].flip(-1))


def test_groups_bound_padding_and_memory():
    """Every crop in one group; a group wastes at most PAD_WASTE in padding and its tensors stay under
    GROUP_ELEMENTS, unless it is one crop alone (a 6000 x 4000 photo at 224 px)."""
    rng = random.Random(3)
    crops = [(rng.randint(50, 500), rng.randint(50, 500)) for _ in range(256)] + [(6000, 4000)]
    groups = plan_groups(crops, 224)
    assert sorted(i for g in groups for i in g) == list(range(len(crops)))
    for group in groups:
        hp, wp = max(crops[i][0] for i in group), max(crops[i][1] for i in group)
        if len(group) > 1:
            assert len(group) * hp * wp <= PAD_WASTE * sum(crops[i][0] * crops[i][1] for i in group)
            assert largest_elements(len(group), hp, wp, 224) <= GROUP_ELEMENTS
    assert [256] in groups  # the large photo alone


def test_the_scripted_call_gives_the_eager_ops_pixels(monkeypatch):
    """The torch form runs as one TorchScript call (no GIL taken op by op: anywhere with FIC_DEVICE_RESIZE=banded);
    FIC_DEVICE_RESIZE=eager runs the same function op by op: the same pixels."""
    from datamodules.sample import device_resize

    images, plans = _images_and_plans(20, seed=2)
    monkeypatch.setattr(device_resize, "_SCRIPTED", {})
    monkeypatch.setenv("FIC_DEVICE_RESIZE", "banded")
    assert isinstance(inspect.unwrap(device_resize.build_on_device("cpu")), torch.jit.ScriptFunction)
    scripted = crop_resize_flip(images, torch.tensor(plans), SIZE)
    monkeypatch.setenv("FIC_DEVICE_RESIZE", "eager")
    assert inspect.unwrap(device_resize.build_on_device("cpu")) is device_resize.assemble
    assert torch.equal(crop_resize_flip(images, torch.tensor(plans), SIZE), scripted)


def test_auto_picks_the_sparse_form_on_a_cpu_only(monkeypatch):
    """On a CPU the default is the sparse form, scripted; on CUDA the kernels (or the banded form without
    triton), and FIC_DEVICE_RESIZE=sparse there says once that the banded form runs (the GPU memory probe counts
    the banded forms' groups, not the sparse form's buffers). Choosing makes no tensor: no GPU is needed."""
    from datamodules.sample import device_resize, resize_kernel

    monkeypatch.setattr(device_resize, "_SAID", set())
    monkeypatch.delenv("FIC_DEVICE_RESIZE", raising=False)
    sparse = device_resize._scripted(device_resize.assemble_sparse)
    assert inspect.unwrap(device_resize.build_on_device("cpu")) is sparse
    kernels = resize_kernel.runs_on(torch.device("cuda"))
    banded = device_resize._scripted(device_resize.assemble)
    assert device_resize.build_on_device("cuda") is (device_resize.assemble_kernel if kernels else banded)
    monkeypatch.setenv("FIC_DEVICE_RESIZE", "sparse")
    with pytest.warns(UserWarning, match="FIC_DEVICE_RESIZE=sparse: the sparse form is the CPU's"):
        assert device_resize.build_on_device("cuda:0") is banded


@pytest.mark.skipif(not _PER_THREAD_COUNT, reason="torch's native thread pool has one thread count for the process")
def test_the_cpu_resize_runs_on_one_thread_and_puts_the_count_back(monkeypatch):
    """On a CPU the resize runs beside the step: with one intra-op thread, the caller's count put back after."""
    from datamodules.sample import device_resize

    seen = []

    def resize(*args):
        seen.append(torch.get_num_threads())
        return "labels"

    monkeypatch.setattr(device_resize, "_ONE_THREAD", {})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert device_resize._on_one_thread(resize)() == "labels"
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_torch_that_cannot_script_gets_the_eager_ops_said_once(monkeypatch):
    from datamodules.sample import device_resize

    def refuse(fn):
        raise RuntimeError("TorchScript was removed")

    monkeypatch.setattr(device_resize, "_SCRIPTED", {})
    monkeypatch.setattr(device_resize, "_SAID", set())
    monkeypatch.setenv("FIC_DEVICE_RESIZE", "banded")
    monkeypatch.setattr(torch.jit, "script", refuse)
    with pytest.warns(UserWarning, match="TorchScript could not compile the device resize"):
        assert inspect.unwrap(device_resize.build_on_device("cpu")) is device_resize.assemble
    assert inspect.unwrap(device_resize.build_on_device("cpu")) is device_resize.assemble  # decided once: no warning


def test_a_mode_that_does_not_exist_is_named_with_the_ones_that_do(monkeypatch):
    monkeypatch.setenv("FIC_DEVICE_RESIZE", "fast")
    from datamodules.sample import device_resize

    with pytest.raises(ValueError, match=r"FIC_DEVICE_RESIZE='fast'.*auto, triton, sparse, banded, eager, dense"):
        device_resize.build_on_device("cpu")
