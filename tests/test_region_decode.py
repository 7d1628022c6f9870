"""Region decode (datamodules/sample/region.py): only the crop's region of a JPEG, with the full decode's pixels."""
from __future__ import annotations

import io
import os
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from datamodules.builtin.tree import generate
from datamodules.errors import DataError
from datamodules.index import load_indexes
from datamodules.sample import region, region_libjpeg, region_nvimgcodec
from datamodules.sample.crop import TrainCrop
from datamodules.sample.dataset import FileSource, SampleDataset, idle_helper
from datamodules.sample.decode import decode, jpeg_frame
from datamodules.sample.loader_plan import LoaderPlan
from tests.helpers.cli import quick_args, run_main
from tests.helpers.trees import jpeg, make_tree, odd_images

pytestmark = pytest.mark.skipif(not region.available(), reason="no region decoder here (region decode off)")

DECODERS = {"libjpeg": region_libjpeg.load, "nvimgcodec": region_nvimgcodec.load}


@pytest.fixture(params=list(DECODERS))
def each_decoder(request, monkeypatch):
    """Each region decoder in turn as the one region.py uses (the libjpeg route, built here; nvImageCodec)."""
    decoder = DECODERS[request.param]()
    if decoder is None:
        pytest.skip(f"{request.param}: not here ({region_libjpeg.why_not or region_nvimgcodec.PIP_LINE})")
    monkeypatch.setattr(region, "decoder", decoder)
    return decoder

# Pillow's `subsampling`: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0; "L" a grayscale JPEG
LAYOUTS = [("4:4:4", "RGB", 0), ("4:2:2", "RGB", 1), ("4:2:0", "RGB", 2), ("gray", "L", 0)]


def photo(height: int, width: int, mode: str, subsampling: int, seed: int = 0) -> bytes:
    """A smooth random picture with noise (chroma that varies across MCU edges), as a JPEG."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 255, (height // 6 + 2, width // 6 + 2, 3), dtype=np.uint8))
    pixels = np.asarray(coarse.resize((width, height), Image.BICUBIC)).astype(int)
    pixels = np.clip(pixels + rng.integers(-30, 30, pixels.shape), 0, 255).astype(np.uint8)
    return jpeg(Image.fromarray(pixels).convert(mode), quality=90, subsampling=subsampling)


def boxes(height: int, width: int, rng: random.Random) -> list[tuple[int, int, int, int]]:
    """(top, left, h, w): 1-pixel boxes at every corner and along every border, 1- and 2-pixel strips, boxes
    on and beside the 16-pixel grid, the whole image, and random boxes at odd offsets."""
    out = [(0, 0, height, width)]
    for t in (0, height - 1):
        out += [(t, c, 1, 1) for c in range(width)]
    for c in (0, width - 1):
        out += [(t, c, 1, 1) for t in range(height)]
    out += [(0, c, height, w) for c in (0, 15, 16, 17, width - 2) for w in (1, 2) if c + w <= width]
    out += [(t, 0, h, width) for t in (0, 15, 16, 17, height - 2) for h in (1, 2) if t + h <= height]
    out += [(16, 16, 16, 16), (15, 17, 18, 14), (17, 15, 1, 1), (31, 33, 3, 3)]
    for _ in range(150):
        t, c = rng.randrange(height), rng.randrange(width)
        out.append((t, c, rng.randint(1, height - t), rng.randint(1, width - c)))
    return out


@pytest.mark.parametrize("name,mode,subsampling", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_every_box_of_a_region_decode_equals_the_full_decode(name, mode, subsampling, each_decoder):
    for height, width in ((37, 51), (64, 80), (50, 130)):  # off the MCU grid, on it, 2 pixels past it
        data = photo(height, width, mode, subsampling)
        frame = jpeg_frame(data)
        assert region.region_takes(frame)
        full = decode(bytearray(data))
        differing = []
        for t, c, h, w in boxes(height, width, random.Random(height)):
            grown = region.region_of(frame, t, c, h, w)
            pixels = region.decode_region(data, grown)
            got = pixels[:, t - grown[0]:t - grown[0] + h, c - grown[1]:c - grown[1] + w]
            if not torch.equal(got, full[:, t:t + h, c:c + w]):
                differing.append((t, c, h, w))
        assert not differing, f"{name} {height}x{width}: {len(differing)} boxes differ, e.g. {differing[:5]}"


def test_the_mcu_is_read_from_the_frame_header():
    sizes = {name: (jpeg_frame(photo(20, 20, mode, sub)).mcu_height, jpeg_frame(photo(20, 20, mode, sub)).mcu_width)
             for name, mode, sub in LAYOUTS}
    assert sizes == {"4:4:4": (8, 8), "4:2:2": (8, 16), "4:2:0": (16, 16), "gray": (8, 8)}


def samples(dataset: SampleDataset, seeds: range, size: int = 24) -> list[torch.Tensor]:
    return [dataset.sample(i, size, random.Random(seed)) for i in range(len(dataset)) for seed in seeds]


def test_a_train_sample_is_the_same_with_and_without_region_decode_and_the_rest_decode_whole(tmp_path):
    files = dict(odd_images())
    rgb = Image.fromarray(np.random.default_rng(5).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    files["progressive.jpg"] = jpeg(rgb, progressive=True)
    files["photo_420.jpg"] = photo(90, 70, "RGB", 2)
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    crop = TrainCrop(0.08, augment=lambda image, rng: image.roll(rng.randrange(3), -1))
    crop.augment.takes_rng = True  # draws from the sample's rng after the box and the flip

    def dataset(on: bool) -> SampleDataset:
        return SampleDataset(FileSource(paths, "fix"), [0] * len(paths), crop, 24, LoaderPlan(region_decode=on))

    on, off = dataset(True), dataset(False)
    got, want = samples(on, range(6)), samples(off, range(6))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    on.decode_counts.flush(0)
    off.decode_counts.flush(0)
    # each file once, whatever the seeds: by region gray, one_pixel, very_wide and photo_420; whole cmyk, 4 PNGs, the
    # EXIF-rotated and the progressive JPEG
    assert on.decode_counts.table.sum(0).tolist() == [4, 7]
    assert off.decode_counts.table.sum(0).tolist() == [0, 11]
    assert "region decode: 4 train images, 7 decoded whole" in on.decode_counts.line()


def test_only_an_orientation_pil_would_apply_keeps_a_file_from_the_region_decode():
    """An XMP packet without tiff:Orientation or with 1, or an EXIF orientation 0 (no turn: PIL's exif_transpose
    and torchvision alike), takes the region decode with the full decode's pixels; XMP or EXIF naming a turn does
    not."""
    rgb = Image.fromarray(np.random.default_rng(7).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    described = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
                 b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" %s/></rdf:RDF></x:xmpmeta>')
    exif = {k: Image.Exif() for k in (0, 6)}
    for k, e in exif.items():
        e[0x0112] = k
    files = {"xmp without orientation": (jpeg(rgb, xmp=described % b'tiff:Make="x"'), True),
             "EXIF orientation 0": (jpeg(rgb, exif=exif[0].tobytes()), True),
             "xmp orientation 1": (jpeg(rgb, xmp=described % b'tiff:Orientation="1"'), True),
             "xmp orientation 6": (jpeg(rgb, xmp=described % b'tiff:Orientation="6"'), False),
             "EXIF orientation 6": (jpeg(rgb, exif=exif[6].tobytes()), False)}
    taken = {name: region.region_takes(jpeg_frame(data)) for name, (data, _) in files.items()}
    assert taken == {name: by_region for name, (_, by_region) in files.items()}
    crop = TrainCrop(0.08)
    for name, (data, _) in files.items():
        reference = torch.from_numpy(np.array(ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))))
        assert torch.equal(decode(bytearray(data)), reference.permute(2, 0, 1)), name
        for seed in range(8):
            box = region.decode_box(bytearray(data), crop, 24, random.Random(seed))
            if box is not None:
                assert torch.equal(crop.cut(box.pixels, box.plan, random.Random(seed), box.origin),
                                   crop(decode(bytearray(data)), 24, random.Random(seed))), name


def test_a_file_the_decoder_refuses_takes_the_full_decode_which_names_the_error(tmp_path, each_decoder):
    whole = photo(200, 200, "RGB", 2)
    (tmp_path / "truncated.jpg").write_bytes(whole[:len(whole) // 2])  # no end-of-image marker
    assert region.decode_region(whole[:len(whole) // 2], (0, 0, 100, 100)) is None
    messages = []
    for on in (True, False):
        made = SampleDataset(FileSource([str(tmp_path / "truncated.jpg")], "Remove it."), [0], TrainCrop(), 16,
                             LoaderPlan(region_decode=on))
        with pytest.raises(DataError) as error:
            made.sample(0, 16, random.Random(0))
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "truncated.jpg" in messages[0] and messages[0].endswith("Remove it.")


def test_without_a_decoder_every_file_decodes_whole_and_the_line_says_how_to_get_one(tmp_path, monkeypatch):
    # no compiler and nothing built yet; nvImageCodec as where its import fails
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(region_nvimgcodec, "load", lambda: None)
    monkeypatch.setattr(region, "_looked", False)
    monkeypatch.setattr(region, "decoder", None)  # put back after the test, with `_looked`
    (tmp_path / "a.jpg").write_bytes(photo(40, 40, "RGB", 2))
    made = SampleDataset(FileSource([str(tmp_path / "a.jpg")], "fix"), [0], TrainCrop(), 16)
    made.sample(0, 16, random.Random(0))
    made.decode_counts.flush(0)
    assert made.decode_counts.table.sum(0).tolist() == [0, 1]
    line = made.decode_counts.line()
    assert line.startswith("region decode off: the libjpeg-turbo route could not be built (") and "no-such-cc" in line
    assert region_nvimgcodec.PIP_LINE in line and "all 1 train images were decoded whole" in line


def test_loader_workers_count_into_the_training_processes_table(tiny_data):
    index = load_indexes(tiny_data, cache=False)["train"]
    made = SampleDataset(FileSource(index, "fix"), [0] * len(index), TrainCrop(), 16)
    here = made.__getitems__(list(range(8)))[0]
    loader = torch.utils.data.DataLoader(made, batch_size=8, num_workers=2, collate_fn=lambda batch: batch,
                                         multiprocessing_context="fork")
    batches = list(loader)
    assert len(batches) == len(index) // 8 + (len(index) % 8 > 0)
    assert here.shape == (8, 3, 16, 16)
    assert made.decode_counts.table.sum(0).tolist() == [8 + len(index), 0]  # every tiny JPEG by region


def test_a_sample_the_idle_helper_finishes_after_its_batch_has_left_is_not_counted_again(tiny_data):
    """The helper (dataset.py, `_fill_here`) stalls in its first read until the batch has left without it."""
    index = load_indexes(tiny_data, cache=False)["train"]
    files = FileSource(index, "fix")
    made = SampleDataset(files, [0] * len(index), TrainCrop(), 16, LoaderPlan(decode_threads=1))
    stalled, release = threading.Event(), threading.Event()

    class Reads:
        describe = files.describe

        def read(self, i: int):
            if threading.current_thread().name.startswith("idle"):
                stalled.set()
                release.wait(60)
            else:  # this batch's own reads wait until the helper has taken a sample
                stalled.wait(60)
            return files.read(i)

    made.source = Reads()
    try:
        made.__getitems__(list(range(8)))
        assert stalled.is_set(), "the helper never took a sample"
    finally:
        release.set()
    idle_helper().submit(lambda: None).result(60)  # it has finished its sample, after the batch
    made.source = files
    made.__getitems__(list(range(8, 16)))  # the next batch
    assert made.decode_counts.table.sum(0).tolist() == [16, 0]


def real_crops(root: Path, seeds: range, min_scale: float, size: int = 224, every: bool = True) -> int:
    """Every train image of `root`, one sample per seed, with and without region decode: 0 differing pixels;
    `every`: each of them by region (else only most: a photo's EXIF rotation or XMP packet takes the full decode)."""
    index = load_indexes(root, cache=False)["train"]
    crop = TrainCrop(min_scale)
    on = SampleDataset(FileSource(index, "fix"), [0] * len(index), crop, size)
    off = SampleDataset(FileSource(index, "fix"), [0] * len(index), crop, size, LoaderPlan(region_decode=False))
    compared = 0
    for i in range(len(index)):
        data = FileSource(index, "fix").read(i)
        for seed in seeds:
            a = on.sample(i, size, random.Random(seed), data)
            b = off.sample(i, size, random.Random(seed), data)
            assert torch.equal(a, b), (index.path(i), seed)
            compared += 1
    on.decode_counts.flush(0)
    by_region, whole = on.decode_counts.table[0].tolist()
    assert whole == 0 if every else by_region >= 9 * whole, (by_region, whole)
    return compared


def test_test_data_crops_are_the_same(tiny_data, each_decoder):
    assert real_crops(tiny_data, range(2), 0.08, size=24) >= 240


@pytest.mark.slow
def test_a_thousand_imagenet_size_crops_are_the_same(tmp_path):
    root = generate(tmp_path / "imnet", "imagenet", train_per_class=25, val_per_class=1, progress=False)
    assert real_crops(root, range(2), 0.08) + real_crops(root, range(2, 4), 0.25) >= 1000


PHOTOS = "REGION_DECODE_PHOTOS"  # a tree of real photos (train/<class>/*.jpg), e.g. built as docs/data.md says


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(PHOTOS), reason=f"{PHOTOS} is not set: no folder of real photos to compare on")
def test_crops_of_the_photos_in_the_folder_the_environment_names_are_the_same(each_decoder):
    root = Path(os.environ[PHOTOS])
    compared = real_crops(root, range(1), 0.25, every=False) + real_crops(root, range(1, 2), 0.08, every=False)
    print(f"{compared} crops of {root} at min_scale 0.25 and 0.08 by {each_decoder.name}: 0 differing pixels")
    assert compared >= 1000


@pytest.mark.slow
def test_the_end_of_run_line_counts_the_train_images_decoded_by_region_in_the_workers(tmp_path):
    root = make_tree(tmp_path / "data", {"a": 12, "b": 12}, size=(64, 48))
    rgb = Image.fromarray(np.random.default_rng(5).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    for i in range(8):
        (root / "train" / "b" / f"progressive{i}.jpg").write_bytes(jpeg(rgb, progressive=True))
    # unseeded: the per-epoch reseed (lightning_app/callbacks/reseed.py) makes a seeded run's first iterator again,
    # and its persistent workers' batches decoded ahead are counted too (decoded, then dropped)
    run = run_main(["fit", *quick_args(root, tmp_path, epochs=1, batch=8), "--data.num_workers", "2",
                    "--data.image_size", "32", "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]",
                    "--seed_everything", "false"])
    done = next(line for line in (run.stdout + run.stderr).splitlines() if line.startswith("Done:"))
    found = re.search(r"region decode: (\d+) train images, (\d+) decoded whole \(progressive", done)
    assert found, done
    by_region, whole = int(found[1]), int(found[2])
    # the 32 train files (4 batches of 8), once: the 24 baseline ones by region, the 8 progressive ones whole
    assert (by_region, whole) == (24, 8), done


def test_a_file_past_the_pixel_limit_takes_the_full_decode_which_refuses_it_by_name(tmp_path, monkeypatch):
    (tmp_path / "big.jpg").write_bytes(photo(60, 80, "RGB", 2))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # as --data.max_image_pixels 1000 sets it (pixel_limit.py)
    assert not region.region_takes(jpeg_frame((tmp_path / "big.jpg").read_bytes()))
    made = SampleDataset(FileSource([str(tmp_path / "big.jpg")], "Downscale it."), [0], TrainCrop(), 16)
    with pytest.raises(DataError, match=r"big\.jpg: .*decompression bomb"):
        made.sample(0, 16, random.Random(0))
