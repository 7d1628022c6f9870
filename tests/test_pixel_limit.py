"""One pixel limit on every decoder (datamodules/sample/pixel_limit.py): judged from real files' headers at the
start-up scan, Pillow's limits by default, --data.max_image_pixels to move them."""
from __future__ import annotations

import struct
import warnings
import zlib

import pytest
import torch
from PIL import Image

from datamodules import ImageFolderDataModule
from datamodules.errors import DataError
from datamodules.processes.loader_workers import WorkerInit
from datamodules.sample.decode import decode, jpeg_frame
from datamodules.sample.pixel_limit import PILLOW_MAX_IMAGE_PIXELS
from tests.helpers.trees import jpeg, make_tree, png


@pytest.fixture(autouse=True)
def _pillow_limit_as_it_was():
    yield
    Image.MAX_IMAGE_PIXELS = PILLOW_MAX_IMAGE_PIXELS


def with_frame_size(data: bytes, width: int, height: int) -> bytes:
    """A real JPEG whose frame header (SOF) says width x height: a decoder believing it would allocate that much."""
    at = data.index(b"\xff\xc0")
    out = bytearray(data)
    out[at + 5:at + 9] = struct.pack(">HH", height, width)
    assert jpeg_frame(bytes(out)).width == width
    return bytes(out)


def with_png_size(data: bytes, width: int, height: int) -> bytes:
    """A real PNG whose IHDR says width x height, its CRC made right (Pillow checks it)."""
    out = bytearray(data)
    out[16:24] = struct.pack(">II", width, height)
    out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
    return bytes(out)


def small_image() -> Image.Image:
    return Image.new("RGB", (16, 16), (120, 30, 200))


def test_a_20000_square_jpeg_is_refused_at_start_up_with_its_name(tmp_path):
    tree = make_tree(tmp_path, {"a": 2, "b": 2})
    bomb = tree / "train" / "a" / "huge.jpg"
    bomb.write_bytes(with_frame_size(jpeg(small_image()), 20000, 20000))
    dm = ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0)
    with pytest.raises(DataError, match=r"huge\.jpg: 400,000,000 pixels, over twice --data\.max_image_pixels"):
        dm.setup("fit")


def test_a_png_over_the_limit_is_refused_as_the_jpeg_is(tmp_path):
    tree = make_tree(tmp_path, {"a": 2, "b": 2})
    (tree / "val" / "b" / "huge.png").write_bytes(with_png_size(png(small_image()), 20000, 20000))
    dm = ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0)
    with pytest.raises(DataError, match=r"huge\.png: 400,000,000 pixels"):
        dm.setup("fit")


def test_a_file_above_the_warning_limit_is_named_at_every_start(tmp_path):
    tree = make_tree(tmp_path, {"a": 2, "b": 2})
    (tree / "train" / "b" / "large.jpg").write_bytes(with_frame_size(jpeg(small_image()), 10000, 10000))
    for _start in ("scan", "cached scan"):
        dm = ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0)
        with pytest.warns(UserWarning, match=r"1 image\(s\) of train/ above --data\.max_image_pixels \(89,478,485\): "
                                             r".*large\.jpg \(100,000,000 pixels\)"):
            dm.setup("fit")
        assert len(dm.indexes["train"]) == 5


def test_the_setting_moves_the_limit_and_the_scan_cache_follows_it(tmp_path):
    tree = make_tree(tmp_path, {"a": 2, "b": 2}, size=(48, 40))  # 1,920 pixels each
    (tree / "val" / "a" / "big.jpg").write_bytes(jpeg(Image.new("RGB", (100, 100))))
    ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0).setup("fit")  # cached
    low = ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0, max_image_pixels=2000)
    assert low.hparams["max_image_pixels"] == 2000  # recorded in run.json as every data setting (runs/identity.py)
    with pytest.raises(DataError, match=r"big\.jpg: 10,000 pixels, over twice --data\.max_image_pixels \(2,000;"):
        low.setup("fit")
    bomb = tree / "train" / "a" / "huge.jpg"
    bomb.write_bytes(with_frame_size(jpeg(small_image()), 20000, 20000))
    unlimited = ImageFolderDataModule(data_dir=str(tree), batch_size=2, image_size=16, num_workers=0,
                                      max_image_pixels=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unlimited.setup("fit")
    assert len(unlimited.indexes["train"]) == 5 and len(unlimited.indexes["val"]) == 5


@pytest.mark.parametrize("value", [0, -5, 1.5, "many"])
def test_a_wrong_setting_is_one_paragraph(tmp_path, value):
    tree = make_tree(tmp_path, {"a": 1, "b": 1})
    with pytest.raises(DataError, match=r"data\.max_image_pixels must be a whole number of pixels >= 1, or null"):
        ImageFolderDataModule(data_dir=str(tree), max_image_pixels=value)


def test_the_fast_jpeg_decode_keeps_to_pillows_limit():
    data = jpeg(Image.new("RGB", (48, 40), (1, 2, 3)))
    assert decode(data).shape == (3, 40, 48)
    Image.MAX_IMAGE_PIXELS = 900  # as --data.max_image_pixels 900 sets it in the process and its workers
    with pytest.raises(Image.DecompressionBombError):
        decode(data)


class PillowLimitSeen(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return Image.MAX_IMAGE_PIXELS or 0


@pytest.mark.slow
def test_loader_workers_keep_to_the_setting_under_the_fork_server(tmp_path):
    tree = make_tree(tmp_path, {"a": 1, "b": 1})
    dm = ImageFolderDataModule(data_dir=str(tree), num_workers=1, max_image_pixels=1234, worker_start="forkserver")
    loader = torch.utils.data.DataLoader(PillowLimitSeen(), num_workers=1, worker_init_fn=WorkerInit(),
                                         **dm.loader_start(1))
    assert [int(b) for b in loader] == [1234]  # a fork server's worker imports Pillow afresh, at its default
