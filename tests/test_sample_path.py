"""The shared sample path: decode (same pixels as PIL), crop/flip, the batch, and the hooks other features use."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from datamodules import ImageFolderDataModule
from datamodules.builtin.tree import generate
from datamodules.errors import DataError
from datamodules.index import load_indexes
from datamodules.sample.crop import TrainCrop, ValCrop, resize
from datamodules.sample.dataset import SampleDataset
from datamodules.sample.decode import decode, fast_jpeg
from datamodules.sample.images import decode_rgb
from datamodules.sample.loader_plan import LoaderPlan
from datamodules.sample.transforms import val_transform
from tests.helpers import REPO
from tests.helpers.trees import copy_tree, jpeg, odd_images

# The val path resizes a uint8 tensor with PyTorch's antialiased bilinear kernel; today's reference
# resizes the PIL image. Both compute Pillow's filter, rounding differently: pixels may differ by 1.
VAL_MAX_DIFF = 1
VAL_MEAN_DIFF = 0.05


def reference(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(decode_rgb(data))).permute(2, 0, 1)


@pytest.fixture(scope="module")
def imagenet_size(tmp_path_factory):
    """A sample of the built-in ImageNet-size images (about 470x390, quality 94)."""
    return generate(tmp_path_factory.mktemp("imnet") / "tree", "imagenet", train_per_class=2, val_per_class=1,
                    progress=False)


def test_odd_images_decode_to_pils_pixels_and_only_plain_jpegs_take_the_fast_decoder():
    fast = {}
    for name, data in odd_images().items():
        fast[name] = fast_jpeg(data)[0]
        got = decode(bytearray(data))
        assert got.dtype == torch.uint8 and got.shape[0] == 3, name
        assert torch.equal(got, reference(data)), name
    assert fast == {"gray.jpg": True, "cmyk.jpg": False, "rgba.png": False, "sixteen_bit.png": False,
                    "png_named.JPEG": False, "exif_rotated.jpg": True, "one_pixel.jpg": True,
                    "very_wide.jpg": True, "palette.png": False}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_matches_pil(orientation):
    rng = np.random.default_rng(orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8)), exif=exif.tobytes())
    assert fast_jpeg(data) == (True, True)
    assert torch.equal(decode(bytearray(data)), reference(data))


def test_cmyk_and_xmp_go_to_pil_and_keep_its_pixels():
    rng = np.random.default_rng(3)
    rgb = Image.fromarray(rng.integers(0, 255, (24, 40, 3), dtype=np.uint8))
    cmyk = jpeg(rgb.convert("CMYK"))
    assert fast_jpeg(cmyk)[0] is False
    assert torch.equal(decode(cmyk), reference(cmyk))
    # an XMP packet can carry an orientation that PIL honours and libjpeg-turbo ignores
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    with_xmp = jpeg(rgb, xmp=xmp)
    assert fast_jpeg(with_xmp)[0] is False
    assert torch.equal(decode(with_xmp), reference(with_xmp))
    for kw in ({"progressive": True}, {"subsampling": 0}, {"subsampling": 2, "quality": 40}):
        data = jpeg(rgb, **kw)
        assert fast_jpeg(data)[0] is True
        assert torch.equal(decode(data), reference(data)), kw


def test_imagenet_size_images_decode_exactly_and_val_matches_torchvision_within_one(imagenet_size):
    index = load_indexes(imagenet_size, cache=False)["train"]
    diffs = []
    for i in range(len(index)):
        data = Path(index.path(i)).read_bytes()
        image = decode(bytearray(data))
        assert torch.equal(image, reference(data)), index.path(i)
        for size, ratio in ((224, 0.875), (64, 1.0)):
            got = ValCrop(ratio)(image, size)
            want = val_transform(size, ratio)(decode_rgb(data))
            assert got.shape == want.shape
            diffs.append((got.int() - want.int()).abs().float())
    assert max(d.max().item() for d in diffs) <= VAL_MAX_DIFF
    assert max(d.mean().item() for d in diffs) <= VAL_MEAN_DIFF


def test_train_crop_scales_flips_and_augments():
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8)
    whole = TrainCrop(min_scale=1.0)  # scale 1 on a square image: the whole image
    outs = [whole(image, 24, random.Random(s)) for s in range(40)]
    assert all(o.shape == (3, 24, 24) and o.dtype == torch.uint8 for o in outs)
    assert all(torch.equal(o, image) or torch.equal(o, image.flip(-1)) for o in outs)
    assert any(torch.equal(o, image) for o in outs) and any(torch.equal(o, image.flip(-1)) for o in outs)
    ramp = torch.linspace(0, 255, 60).round().to(torch.uint8).expand(3, 40, 60)  # a horizontal ramp
    out = TrainCrop(min_scale=0.25)(ramp, 32, random.Random(0))
    assert out.shape == (3, 32, 32)
    rows = out[0].int()
    assert (rows == rows[:1]).all()  # still a ramp: every row the same
    assert (rows.diff(dim=1) >= 0).all() or (rows.diff(dim=1) <= 0).all()  # monotonic, one way or flipped
    big = torch.randint(0, 256, (3, 90, 110), dtype=torch.uint8)  # the flip may run after the resize: same pixels
    assert torch.equal(resize(big.flip(-1), 32, 32), resize(big, 32, 32).flip(-1))
    inverted = TrainCrop(min_scale=1.0, augment=lambda x: 255 - x)(image, 24, random.Random(1))
    assert torch.equal(inverted, 255 - image) or torch.equal(inverted, 255 - image.flip(-1))


def test_a_sample_written_into_its_batch_slot_is_the_sample_made_on_its_own():
    """crop.py writes an unflipped sample straight into the batch (the resize's out=): the same pixels as a sample
    made alone, for crops smaller and larger than the output, flipped or not, an output of the crop's own size,
    an augment, and the val crop; the slot's neighbours untouched."""
    image = torch.randint(0, 256, (90, 110, 3), dtype=torch.uint8).permute(2, 0, 1)  # HWC memory, as decoded
    batch = torch.zeros((3, 3, 32, 32), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    crops = [TrainCrop(0.02), TrainCrop(0.9), TrainCrop(0.9, augment=lambda x: 255 - x)]
    flips = set()
    for crop in crops:
        for seed in range(40):
            plan = crop.plan(90, 110, 32, random.Random(seed))
            flips.add((plan.flip, plan.height * plan.width < 32 * 32))
            alone = crop(image, 32, random.Random(seed))
            got = crop(image, 32, random.Random(seed), out=batch[1])
            assert got.data_ptr() == batch[1].data_ptr() and torch.equal(batch[1], alone), (seed, plan)
            assert not batch[0].any() and not batch[2].any()
    assert flips == {(False, False), (False, True), (True, False), (True, True)}
    square = image[:, :32, :32]
    resize(square, 32, 32, out=batch[1])
    assert torch.equal(batch[1], square)
    ValCrop()(image, 32, out=batch[1])
    assert torch.equal(batch[1], ValCrop()(image, 32)) and not batch[0].any() and not batch[2].any()


@pytest.mark.parametrize("decode_threads", [1, 4])  # decoded in the calling thread (+ idle helper) / on the pool
def test_a_batch_is_one_tensor_with_the_indexs_labels_and_seeded_crops(tiny_data, decode_threads):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=0, image_size=20)
    dm.setup("fit")
    plan = LoaderPlan(decode_threads=decode_threads)
    ds = dm.datasets["train"].planned(plan)
    assert isinstance(ds, SampleDataset)
    torch.manual_seed(0)
    seeds = torch.randint(2**62, (4,)).tolist()  # what __getitems__ draws first
    alone = torch.stack([ds.sample(i, 20, random.Random(s)) for i, s in zip([0, 5, 30, 100], seeds, strict=False)])
    torch.manual_seed(0)
    images, labels = ds.__getitems__([0, 5, 30, 100])
    torch.manual_seed(0)
    again, _ = ds.__getitems__([0, 5, 30, 100])
    assert images.shape == (4, 3, 20, 20) and images.dtype == torch.uint8
    assert torch.equal(images, again)  # the crops come from torch's seed, whatever order the threads ran in
    assert torch.equal(images, alone)  # whichever thread built which sample
    assert labels.tolist() == [dm.indexes["train"].labels[i] for i in (0, 5, 30, 100)]
    # val: the val crop of the decoded file, the same as one sample on its own
    val = dm.datasets["val"].planned(plan)
    batch, _ = val.__getitems__([3, 4])
    assert torch.equal(batch[1], val[4][0])
    with torch.inference_mode():  # trainer.validate with num_workers=0: the sample threads write an inference tensor
        again, _ = val.__getitems__([3, 4])
    assert torch.equal(again, batch)


@pytest.mark.parametrize("decode_threads", [1, 4])
def test_a_file_gone_since_the_scan_is_named(tiny_data, tmp_path, decode_threads):
    root = copy_tree(tiny_data, tmp_path / "copy")
    dm = ImageFolderDataModule(data_dir=str(root), batch_size=8, num_workers=0, image_size=20)
    dm.setup("fit")
    ds = dm.datasets["train"].planned(LoaderPlan(decode_threads=decode_threads))
    gone = Path(ds.source.paths[6])
    gone.unlink()
    with pytest.raises(DataError, match=rf"cannot decode image .*{gone.name}.*No such file"):
        ds.__getitems__(list(range(8)))
    ds.__getitems__(list(range(8, 16)))  # the next batch is unharmed


def test_set_train_size_reaches_persistent_workers_and_augment_runs_in_them(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=40, num_workers=1, image_size=24,
                               persistent_workers=True)
    dm.train_augment = _blackout
    dm.setup("fit")
    loader = dm.train_dataloader()
    first = [images for images, _ in loader]
    assert {tuple(x.shape[-2:]) for x in first} == {(24, 24)}
    assert all(int(x.max()) == 0 for x in first)  # the augment hook ran in the worker
    dm.set_train_size(16)  # between epochs, as progressive resizing does at an epoch's start
    second = [images for images, _ in loader]
    assert {tuple(x.shape[-2:]) for x in second} == {(16, 16)}
    assert loader._iterator is not None and loader._iterator._workers  # the same persistent worker
    loader._iterator._shutdown_workers()


def _blackout(image: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(image)


NEEDS_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="reads the affinity mask (Linux)")


@NEEDS_AFFINITY
def test_num_workers_auto_is_this_processs_share_of_the_cpus(tiny_data):
    mask = os.sched_getaffinity(0)  # the CPUs this process may run on (SLURM, taskset and containers set it)
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8)
    assert dm.num_workers == "auto"
    assert dm.workers() == len(mask)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.num_workers == len(mask)
    assert loader.dataset.decode_threads == 1  # one CPU per worker: it decodes in its own thread
    assert ImageFolderDataModule(data_dir=str(tiny_data), num_workers=0).workers() == 0
    in_process = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=0)
    in_process.setup("fit")
    assert in_process.train_dataloader().dataset.decode_threads == len(mask)  # every CPU decodes side by side
    if len(mask) > 1:  # as `taskset -c N` or SLURM's --cpus-per-task 1 leaves it: the mask, not the machine
        os.sched_setaffinity(0, {min(mask)})
        try:
            assert dm.workers() == 1
        finally:
            os.sched_setaffinity(0, mask)


@NEEDS_AFFINITY
@pytest.mark.parametrize(("strategy", "processes"), [("ddp", 2), ("dp", 1)])
def test_num_workers_auto_divides_the_cpus_by_the_training_processes_on_the_node(tiny_data, strategy, processes):
    import pytorch_lightning as pl

    import lightning_app.cli  # noqa: F401 - registers the template's "dp" strategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8)
    dm.trainer = trainer
    assert dm.workers() == max(1, len(os.sched_getaffinity(0)) // processes)


def test_resize_of_a_hwc_view_equals_the_dense_copys():
    # A decoded image is a CHW view of HWC memory; resize() hands the kernel a dense batch stride for it.
    hwc = torch.randint(0, 256, (249, 390, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    view = hwc.permute(2, 0, 1)
    for size in ((224, 224), (256, 401)):
        as_is = F.interpolate(view[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
        assert torch.equal(resize(view, *size), as_is)  # the kernel on the batch stride of 3: same pixels
        assert torch.equal(resize(view.contiguous(), *size), as_is)  # and a plain CHW tensor
    crop = view[:, 10:200, 20:300]  # not contiguous: copied once
    assert torch.equal(resize(crop, 224, 224), resize(crop.contiguous(), 224, 224))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_idle_helper_alone_runs_at_the_lowest_priority():
    from datamodules.sample.dataset import idle_helper

    def policy() -> tuple[int, int]:
        return threading.get_native_id(), os.sched_getscheduler(0)

    before = policy()
    tid, helper = idle_helper().submit(policy).result()
    assert tid != before[0] and helper == os.SCHED_IDLE
    assert policy() == before and before[1] != os.SCHED_IDLE  # the calling thread keeps its policy


@pytest.mark.parametrize("stall_in", ["read", "hand-over"])
def test_a_stalled_idle_helper_neither_delays_the_batch_nor_writes_into_it_later(tiny_data, monkeypatch, stall_in):
    """The helper runs at the lowest priority: on a busy machine it may stop anywhere for a long while.

    It stalls in its first read (before it has built anything), or in handing over the sample it built
    (where it once copied into the batch holding the lock this thread takes for every sample). Every
    read of this thread waits until the helper is stalled, so the batch is built around a stalled helper.
    """
    from datamodules.sample import dataset

    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=0, image_size=20)
    dm.setup("fit")
    ds = dm.datasets["train"].planned(LoaderPlan(decode_threads=1))
    files = ds.source
    stalled, release = threading.Event(), threading.Event()

    def in_the_helper() -> None:  # stalls the helper; the other threads wait until it is stalled
        if threading.current_thread().name.startswith("idle"):
            stalled.set()
            release.wait(60)
        else:
            stalled.wait(60)

    class Reads:
        def read(self, i: int):
            if stall_in == "read" or not threading.current_thread().name.startswith("idle"):
                in_the_helper()
            return files.read(i)

        describe = files.describe

    hand_over = dataset._hand_over
    if stall_in == "hand-over":
        monkeypatch.setattr(dataset, "_hand_over", lambda *a: (in_the_helper(), hand_over(*a)))
    ds.source = Reads()
    torch.manual_seed(0)
    seeds = torch.randint(2**62, (8,)).tolist()
    torch.manual_seed(0)
    out = []
    builder = threading.Thread(target=lambda: out.append(ds.__getitems__(list(range(8)))))
    builder.start()
    builder.join(30)
    try:
        assert stalled.is_set(), "the helper never reached its stall"
        assert not builder.is_alive(), f"the batch waited for the helper stalled in its {stall_in}"
        images = out[0][0]
        ds.source = files
        assert torch.equal(images, torch.stack([ds.sample(i, 20, random.Random(s)) for i, s in enumerate(seeds)]))
        images.zero_()  # as if the buffer went on to hold another batch
    finally:
        release.set()
        builder.join(60)
    dataset.idle_helper().submit(lambda: None).result(30)  # the helper has finished its stalled sample
    assert int(images.max()) == 0  # and did not write it into the batch


def test_a_read_only_buffer_decodes_without_torch_s_warning():
    # torch warns once per process, so a fresh interpreter: bytes and a read-only view (an LMDB value's memory map)
    code = ("import warnings, torch; warnings.filterwarnings('error', message='The given buffer')\n"
            "from datamodules.sample.decode import decode\n"
            "from tests.helpers.trees import odd_images\n"
            "data = odd_images()['gray.jpg']\n"
            "for given in (data, memoryview(data), bytearray(data), memoryview(bytearray(data))):\n"
            "    assert decode(given).shape[0] == 3\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "not writable" not in done.stderr, done.stderr
