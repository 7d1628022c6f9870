"""The downscale tool and DownscaledDataModule: sizes, orientation, reruns, kills, broken files, in-memory sharing."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from datamodules.downscale.datamodule import DownscaledDataModule, MemorySource
from datamodules.downscale.writer import downscale, main, read_marker, target_size
from datamodules.errors import DataError
from datamodules.index import load_indexes
from datamodules.sample.dataset import FileSource
from datamodules.sample.images import decode_rgb
from tests.helpers import REPO
from tests.helpers.trees import make_tree


def test_target_size_keeps_aspect_and_never_upscales():
    assert target_size(470, 390, 160) == (193, 160)
    assert target_size(390, 470, 160) == (160, 193)
    assert target_size(100, 50, 160) == (100, 50)
    assert target_size(1200, 8, 4) == (600, 4)
    assert target_size(1, 1, 1) == (1, 1)


def _jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _asymmetric(height: int, width: int) -> np.ndarray:
    """Smooth (a 12x reduction keeps it) and different under every flip and quarter turn: two ramps and a corner."""
    y, x = np.mgrid[0:height, 0:width]
    corner = (x / width + y / height) > 1.3
    return np.stack([255 * x / width, 255 * y / height, 255 * corner], -1).astype(np.uint8)


# The 8 ways to flip and turn an image (PIL's Transpose members, and none).
TURNS = [None, *Image.Transpose]


def _distance(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).mean())


def test_sizes_orientation_and_formats(odd_tree, tmp_path):
    big = odd_tree / "train" / "bees" / "big.jpg"
    big.write_bytes(_jpeg(_asymmetric(300, 500), quality=95))
    for orientation in range(1, 9):  # a 400x200 image stored as it comes off a sensor, EXIF saying how to show it
        exif = Image.Exif()
        exif[0x0112] = orientation
        (odd_tree / "train" / "bees" / f"exif{orientation}.jpg").write_bytes(
            _jpeg(_asymmetric(200, 400), quality=95, exif=exif.tobytes()))
    out = downscale(odd_tree, tmp_path / "small", 24, quality=85, progress=False)
    assert (out / "train" / "empty").is_dir() and (out / "val" / "empty").is_dir()  # labels stay the same
    src_idx, out_idx = load_indexes(odd_tree, cache=False), load_indexes(out, cache=False)
    for split in ("train", "val"):
        assert out_idx[split].samples == src_idx[split].samples  # same paths, same labels
        for rel, _ in src_idx[split].samples:
            expected = decode_rgb(odd_tree / rel)  # orientation applied
            with Image.open(out / rel) as im:
                assert im.format == "JPEG" and im.mode == "RGB" and im.getexif().get(0x0112, 1) == 1
                assert im.size == target_size(*expected.size, 24), rel
    # a plain RGB JPEG already small enough is copied byte for byte (no second JPEG loss)
    assert (out / "train/ants/one_pixel.jpg").read_bytes() == (odd_tree / "train/ants/one_pixel.jpg").read_bytes()
    # the pixels are those of PIL's upright image, resized: closer to it than to any flip or turn of it
    for name in ["big.jpg", *(f"exif{o}.jpg" for o in range(1, 9))]:
        with Image.open(odd_tree / "train/bees" / name) as src:
            upright = ImageOps.exif_transpose(src).convert("RGB")
        got = decode_rgb(out / "train/bees" / name)
        assert got.size == ((40, 24) if name == "big.jpg" else (48, 24) if name[4] in "1234" else (24, 48))
        distances = {}
        for turn in TURNS:
            turned = upright if turn is None else upright.transpose(turn)
            if turned.size[0] * got.size[1] == turned.size[1] * got.size[0]:  # same shape as the output
                distances[turn] = _distance(got, turned.resize(got.size, Image.LANCZOS))
        assert distances[None] < 6, (name, distances)
        assert min(d for turn, d in distances.items() if turn is not None) > 30, (name, distances)
    assert not list(out.rglob("*.tmp-*"))
    assert read_marker(out)["counts"] == {"train": len(src_idx["train"]), "val": len(src_idx["val"])}


def test_rerun_redoes_only_changed_sources_and_removes_deleted(tiny_data, tmp_path):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(tiny_data, src)
    dst = downscale(src, tmp_path / "dst", 16, progress=False)
    first = {p: p.stat().st_mtime_ns for p in dst.rglob("*.jpg")}
    stamp = {p: os.stat(p).st_ino for p in first}
    # change one source, delete another
    changed = src / "train" / "bars" / "00000.jpg"
    changed.write_bytes(_jpeg(np.zeros((64, 64, 3), np.uint8)))
    os.utime(changed, ns=(time.time_ns() + 10**9,) * 2)
    (src / "val" / "ring" / "00001.jpg").unlink()
    downscale(src, dst, 16, progress=False)
    after = {p: os.stat(p).st_ino for p in dst.rglob("*.jpg")}
    assert dst / "val/ring/00001.jpg" not in after
    rewritten = {p for p in after if after[p] != stamp.get(p)}
    assert rewritten == {dst / "train/bars/00000.jpg"}
    assert np.asarray(decode_rgb(dst / "train/bars/00000.jpg")).max() < 10
    # other settings: everything is redone at the new size
    downscale(src, dst, 8, progress=False)
    assert Image.open(dst / "train/bars/00001.jpg").size == (8, 8)


def test_broken_sources_fail_unless_skipped(tmp_path, capsys):
    root = make_tree(tmp_path / "tree", {"a": 2, "b": 2})
    good = (root / "train/a/000.jpg").read_bytes()
    (root / "train/a/truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "val/b/garbled.jpg").write_bytes(good[:20] + bytes(100) + b"\xff\xd9")
    dst = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["--src", str(root), "--dst", str(dst), "--max-size", "16", "--quiet", "--workers", "1"])
    assert exc.value.code == 2  # bad input (datamodules/processes/exits.py)
    err = capsys.readouterr().err
    assert str(root / "train/a/truncated.jpg") in err and str(root / "val/b/garbled.jpg") in err
    assert read_marker(dst) is None  # incomplete: no marker
    main(["--src", str(root), "--dst", str(dst), "--max-size", "16", "--quiet", "--skip-invalid"])
    marker = read_marker(dst)
    assert sorted(p for p, _ in marker["skipped_files"]) == ["train/a/truncated.jpg", "val/b/garbled.jpg"]
    assert marker["counts"] == {"train": 4, "val": 4}
    assert not (dst / "val/b/garbled.jpg").exists()
    with pytest.raises(DataError, match="cannot be decoded"):
        DownscaledDataModule(str(root), max_size=16, cache_dir=str(tmp_path / "dm"), batch_size=2)
    dm = DownscaledDataModule(str(root), max_size=16, cache_dir=str(tmp_path / "dm"), batch_size=2,
                              skip_invalid=True, image_size=16)
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 4


def test_in_memory_source_is_one_shared_buffer(tiny_data, tmp_path):
    dm = DownscaledDataModule(str(tiny_data), max_size=24, in_memory=True, cache_dir=str(tmp_path / "c"),
                              batch_size=40, num_workers=2, image_size=24, val_image_size=24, val_crop_ratio=1.0)
    assert dm.num_classes == 10 and dm.root == tmp_path / "c"
    dm.setup("fit")
    ds = dm.datasets["val"]
    assert isinstance(ds.source, MemorySource) and ds.source.buffer.is_shared()
    assert ds.source.nbytes == sum((dm.root / rel).stat().st_size for rel, _ in dm.indexes["val"].samples)
    # a spawned process reads the same memory: bytes the parent writes after it started are what it reads
    ctx = torch.multiprocessing.get_context("spawn")
    go, got = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_read_after, args=(ds.source, go, got))
    child.start()  # the source is pickled into it here
    before = ds.source.buffer[:16].clone()
    try:
        ds.source.buffer[:16] = torch.arange(16, dtype=torch.uint8) + 100
        go.set()
        assert got.get(timeout=120) == list(range(100, 116))
    finally:
        ds.source.buffer[:16] = before
        child.join(60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (40, 3, 24, 24) and images.dtype == torch.uint8
    assert labels.tolist() == dm.indexes["val"].labels[:40]
    # same pixels as reading the downscaled files
    rel = dm.indexes["val"].samples[0][0]
    assert torch.equal(images[0], torch.from_numpy(np.array(decode_rgb(dm.root / rel))).permute(2, 0, 1))


def _read_after(source: MemorySource, go, got) -> None:  # in a spawned process
    go.wait(60)
    got.put(source.read(0)[:16].tolist())


def test_copy_is_read_a_batch_at_a_time_with_pils_pixels(tiny_data, tmp_path):
    dm = DownscaledDataModule(str(tiny_data), max_size=24, cache_dir=str(tmp_path / "c"), batch_size=8,
                              image_size=24, val_image_size=24, val_crop_ratio=1.0)
    dm.setup("fit")
    ds = dm.datasets["val"]
    assert isinstance(ds.source, FileSource)
    images, labels = ds.__getitems__(list(range(8)))  # what a DataLoader calls: one batch tensor
    assert labels.tolist() == dm.indexes["val"].labels[:8]
    for i, image in enumerate(images):
        rel = dm.indexes["val"].samples[i][0]
        # torchvision's JPEG decoder gives PIL's pixels exactly (val: no resize at 24 px on a 24 px copy)
        assert torch.equal(image, torch.from_numpy(np.array(decode_rgb(dm.root / rel))).permute(2, 0, 1))
    broken = dm.root / dm.indexes["val"].samples[3][0]
    broken.write_bytes(b"\xff\xd8\xff\xe0" + bytes(200))  # a JPEG header, then nothing
    with pytest.raises(DataError, match=f"cannot decode image {broken}"):
        ds.__getitems__([2, 3])


def test_separate_train_and_val_resolutions(tiny_data, tmp_path):
    dm = DownscaledDataModule(str(tiny_data), max_size=28, cache_dir=str(tmp_path / "c"), batch_size=40,
                              num_workers=0, image_size=20, val_image_size=28, val_crop_ratio=1.0)
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))[0].shape[-2:] == (20, 20)
    assert next(iter(dm.val_dataloader()))[0].shape[-2:] == (28, 28)
    # a finished copy passed as data_dir is used as it is
    again = DownscaledDataModule(str(tmp_path / "c"), max_size=32, batch_size=40)
    assert again.root == tmp_path / "c"


@pytest.mark.slow
def test_killed_downscale_resumes_to_the_same_files(slow_tree, tmp_path):
    dst = tmp_path / "small"
    cmd = [sys.executable, "-m", "datamodules.downscale", "--src", str(slow_tree), "--dst", str(dst),
           "--max-size", "48", "--workers", "1", "--quiet"]
    proc = subprocess.Popen(["nice", "-n", "19", *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(list(dst.glob("train/a/*.png"))) < 10 and proc.poll() is None:
        assert time.monotonic() < deadline, "the downscaler never wrote an output"
        time.sleep(0.02)
    assert proc.poll() is None, "the downscaler finished before it could be interrupted: make slow_tree larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_marker(dst) is None
    done_before = {p: p.stat().st_ino for p in dst.rglob("*.png")}
    assert 10 <= len(done_before) < 200
    downscale(slow_tree, dst, 48, workers=2, progress=False)
    reference = downscale(slow_tree, tmp_path / "reference", 48, workers=2, progress=False)
    files = sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files == sorted(p.relative_to(reference) for p in reference.rglob("*")
                           if p.is_file() and not p.name.startswith("."))
    assert len(files) == 200
    for rel in files:
        assert (dst / rel).read_bytes() == (reference / rel).read_bytes(), rel
    assert not list(dst.rglob("*.tmp-*"))
    kept = [p for p, ino in done_before.items() if p.stat().st_ino == ino]
    assert len(kept) >= len(done_before) - 1  # finished files were not redone (one may have been mid-write)
