"""ImageFolderDataModule: shared init args, batches, bad input before and during loading."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from datamodules import DataError, ImageFolderDataModule
from datamodules.sample.batches import SampleLoader, built_batch
from datamodules.sample.crop import ValCrop
from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from tests.helpers.trees import copy_tree, make_tree


def test_batches_are_normalised_on_transfer_and_labelled_by_the_index(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=24)
    assert dm.num_classes == 10  # readable right after __init__ (linked to the model)
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (16, 3, 24, 24)
    assert labels.dtype == torch.int64
    x, _ = dm.on_after_batch_transfer((images, labels), 0)
    expected = (images[:, 0].float() / 255 - IMAGENET_MEAN[0]) / IMAGENET_STD[0]
    assert torch.allclose(x[:, 0], expected, atol=1e-5)
    val_images, val_labels = next(iter(dm.val_dataloader()))
    assert val_images.shape[-2:] == (24, 24)
    # validation is unshuffled: labels are exactly the Index's, in order
    assert val_labels.tolist() == dm.indexes["val"].labels[:16]


def test_folder_name_decides_the_label(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=0, image_size=32)
    dm.setup("fit")
    for path, label in dm.indexes["train"].samples:
        assert path.split("/")[1] == dm.classes[label]


def test_unusual_images_load_as_three_channels(odd_tree):
    dm = ImageFolderDataModule(data_dir=str(odd_tree), batch_size=4, num_workers=0, image_size=32, val_crop_ratio=1.0)
    assert dm.classes == ["ants", "bees", "empty"]
    dm.setup("fit")
    for images, _ in dm.train_dataloader():
        assert images.shape[1:] == (3, 32, 32)
    val = torch.cat([images for images, _ in dm.val_dataloader()])  # unshuffled: the Index's order
    crop = ValCrop(1.0)
    for (rel, _), got in zip(dm.indexes["val"].samples, val, strict=True):
        name = Path(rel).name
        if name == "sixteen_bit.png":  # 32768 of 65535: mid grey (PIL's own convert would clip it to white)
            assert (got == 128).all()
            continue
        with Image.open(odd_tree / rel) as img:  # PIL's RGB of the upright image, the same crop
            want = torch.from_numpy(np.array(ImageOps.exif_transpose(img).convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(got, crop(want, 32)), rel
        if name == "gray.jpg":
            assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])
        if name == "one_pixel.jpg":  # a red dot, stretched
            assert (got.flatten(1).float().mean(1) - torch.tensor([200.0, 10.0, 10.0])).abs().max() < 4


@pytest.mark.parametrize("bad", ["missing", "no_val", "mismatch"])
def test_bad_layout_fails_at_construction(tmp_path, bad):
    root = tmp_path / "data"
    if bad != "missing":
        make_tree(root, {"cat": 1, "dog": 1}, splits=("train",) if bad == "no_val" else ("train", "val"))
    if bad == "mismatch":
        (root / "val" / "dog").rename(root / "val" / "fox")
    with pytest.raises(DataError, match=str(root)):
        ImageFolderDataModule(data_dir=str(root))


def test_bad_files_fail_setup_unless_skipped(tiny_data, tmp_path):
    root = copy_tree(tiny_data, tmp_path / "copy")
    bad = root / "train" / "circle" / "00003.jpg"
    bad.write_text("this is not a jpeg")
    dm = ImageFolderDataModule(data_dir=str(root), batch_size=8, num_workers=0, image_size=32)
    with pytest.raises(DataError, match="00003.jpg"):
        dm.setup("fit")
    dm = ImageFolderDataModule(data_dir=str(root), batch_size=8, num_workers=0, image_size=32, skip_invalid=True)
    with pytest.warns(UserWarning, match="skipping 1 unreadable"):
        dm.setup("fit")
    assert "train/circle/00003.jpg" not in dict(dm.indexes["train"].samples)


@pytest.mark.parametrize("decode_threads", [1, 4])  # the worker decodes in its own thread / on its pool
def test_decode_error_in_a_worker_names_the_file(tiny_data, tmp_path, decode_threads):
    # Passes the cheap checks (JPEG start and end markers) but the body is garbage.
    root = copy_tree(tiny_data, tmp_path / "copy")
    bad = root / "val" / "star" / "00001.jpg"
    data = bad.read_bytes()
    bad.write_bytes(data[:4] + b"\x00" * (len(data) - 6) + b"\xff\xd9")
    dm = ImageFolderDataModule(data_dir=str(root), batch_size=8, num_workers=1, image_size=32,
                               persistent_workers=False)
    dm.setup("fit")
    plan = replace(dm.loader_plan(train=False), decode_threads=decode_threads)  # the val loader's, these threads
    loader = SampleLoader(dm.datasets["val"].planned(plan), batch_size=8, collate_fn=built_batch,
                          **dm.loader_args(plan))
    with pytest.raises(DataError, match=r"cannot decode image .*star/00001\.jpg") as e:
        for _ in loader:
            pass
    assert "Traceback" not in str(e.value) and "in DataLoader worker process 0" in str(e.value)


def test_fewer_images_than_a_batch_is_a_clear_error(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=1024, num_workers=0)
    dm.setup("fit")
    with pytest.raises(DataError, match="fewer than one global batch"):
        dm.train_dataloader()
