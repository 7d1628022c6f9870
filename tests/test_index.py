"""The Index: layout validation, what counts as a sample, bad files, the scan cache."""
from __future__ import annotations

import os
import sys

import pytest
from PIL import Image

import datamodules.index as ix
from datamodules.errors import DataError
from datamodules.index import find_classes, load_index, load_indexes
from datamodules.sample.images import check_file, decode_rgb
from tests.helpers import REPO
from tests.helpers.processes import finish_all, start_command
from tests.helpers.trees import make_tree, odd_images


def test_classes_sorted_hidden_and_clutter_ignored(odd_tree):
    assert find_classes(odd_tree) == ["ants", "bees", "empty"]
    index = load_index(odd_tree, "train")
    names = {os.path.basename(p) for p, _ in index.samples}
    assert names.isdisjoint({".DS_Store", "notes.txt", ".hidden.jpg", "x.jpg"})
    assert set(odd_images()) <= names
    assert index.empty_classes == ["empty"]
    assert index.bad_files == []
    assert {label for _, label in index.samples} == {0, 1}  # "empty" keeps label 2, with no samples


def test_unusual_images_decode_to_rgb(odd_tree):
    for name in odd_images():
        img = decode_rgb(odd_tree / "train" / "ants" / name)
        assert img.mode == "RGB", name
    assert decode_rgb(odd_tree / "train" / "ants" / "exif_rotated.jpg").size == (40, 60)  # 60x40 rotated
    # 16-bit mid-grey must stay mid-grey, not clip to white
    assert decode_rgb(odd_tree / "train" / "ants" / "sixteen_bit.png").getpixel((0, 0)) == (128, 128, 128)
    assert decode_rgb(odd_tree / "train" / "ants" / "very_wide.jpg").size == (1200, 8)


def test_missing_root_names_the_path(tmp_path):
    with pytest.raises(DataError, match="nowhere.*does not exist.*train/<class>"):
        find_classes(tmp_path / "nowhere")


def test_missing_split_names_it(tmp_path):
    make_tree(tmp_path, {"a": 1}, splits=("train",))
    with pytest.raises(DataError, match="no val/ folder"):
        find_classes(tmp_path)


def test_val_classes_must_match_train(tmp_path):
    make_tree(tmp_path, {"cat": 1, "dog": 1})
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "wolf")
    with pytest.raises(DataError, match=r"only in train/: \['dog'\]; only in val/: \['wolf'\]"):
        find_classes(tmp_path)


def test_split_without_images_is_an_error(tmp_path):
    make_tree(tmp_path, {"cat": 0, "dog": 0})
    with pytest.raises(DataError, match="holds no usable image files"):
        load_index(tmp_path, "train")


def test_bad_files_are_listed_with_reasons(tmp_path):
    make_tree(tmp_path, {"cat": 3, "dog": 3})
    good = (tmp_path / "train" / "cat" / "000.jpg").read_bytes()
    (tmp_path / "train" / "cat" / "empty.jpg").write_bytes(b"")
    (tmp_path / "train" / "cat" / "text.jpg").write_text("<html>not found</html>")
    (tmp_path / "train" / "dog" / "cut.jpg").write_bytes(good[: len(good) // 2])
    index = load_index(tmp_path, "train")
    reasons = dict(index.bad_files)
    assert "empty file" in reasons["train/cat/empty.jpg"]
    assert "not an image" in reasons["train/cat/text.jpg"]
    assert "truncated JPEG" in reasons["train/dog/cut.jpg"]
    assert len(index) == 6
    with pytest.raises(DataError, match=r"(?s)3 unreadable.*cut\.jpg.*skip_invalid"):
        index.raise_if_bad()


def test_jpeg_end_marker_found_at_any_size(tmp_path):
    # The marker must be found even when it straddles the head/tail read boundary.
    for size in (1023, 1024, 1025, 1026, 2049):
        path = tmp_path / f"{size}.jpg"
        path.write_bytes(b"\xff\xd8\xff" + b"\x00" * (size - 5) + b"\xff\xd9")
        assert check_file(path) is None, size


def test_cache_skips_rescan_until_the_tree_changes(tmp_path):
    make_tree(tmp_path, {"cat": 2, "dog": 2})
    first = load_indexes(tmp_path)
    # Corrupting a file in place leaves folder mtimes alone: the cached scan is used.
    (tmp_path / "train" / "cat" / "000.jpg").write_bytes(b"")
    assert load_index(tmp_path, "train").samples == first["train"].samples
    # Adding a file changes its folder: the split is scanned again.
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "dog" / "new.jpg")
    again = load_index(tmp_path, "train")
    assert "train/dog/new.jpg" in dict(again.samples)
    assert "train/cat/000.jpg" in dict(again.bad_files)


def test_cached_bad_file_repaired_in_place_is_rescanned(tmp_path):
    make_tree(tmp_path, {"cat": 2, "dog": 2})
    path = tmp_path / "train" / "cat" / "000.jpg"
    good = path.read_bytes()
    path.write_bytes(b"")
    assert load_index(tmp_path, "train").bad_files
    path.write_bytes(good)
    assert not load_index(tmp_path, "train").bad_files


_SCAN_ONCE = """
import os, sys, time
from pathlib import Path
import datamodules.index as ix
arrived = Path(sys.argv[2])
real_lock, real_scan = ix.file_lock, ix.scan_split
def announced_lock(path):  # this process is about to wait for the scan lock
    (arrived / str(os.getpid())).touch()
    return real_lock(path)
def scan_once_both_wait(*a, **k):  # a barrier: scans only once both processes are at the lock
    print("SCANNED", flush=True)
    deadline = time.monotonic() + 30
    while len(list(arrived.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return real_scan(*a, **k)
ix.file_lock, ix.scan_split = announced_lock, scan_once_both_wait
print(len(ix.load_index(sys.argv[1], "train")))
"""


def test_processes_starting_together_scan_once_and_share_the_cache(tiny_data, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    procs = [start_command([sys.executable, "-c", _SCAN_ONCE, str(tiny_data), str(arrived)], env) for _ in range(2)]
    _, outs = finish_all(procs, timeout=120)
    assert all(p.returncode == 0 for p in procs), outs
    assert len(list(arrived.iterdir())) == 2  # both asked for the lock while one of them was scanning
    assert sum(o.count("SCANNED") for o in outs) == 1, outs
    assert {o.split()[-1] for o in outs} == {"240"}


def test_threaded_scan_lists_the_same_samples_and_bad_files_as_one_thread(odd_tree):
    (odd_tree / "train" / "bees" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(100))
    root = str(odd_tree)
    classes = find_classes(root)
    one = ix.scan_split(root, "train", classes, True, threads=1)
    many = ix.scan_split(root, "train", classes, True, threads=8)
    assert one == many
    assert [p for p, _ in many.bad_files] == ["train/bees/cut.jpg"]


def test_val_is_interleaved_by_class_so_any_prefix_holds_every_class(tmp_path):
    root = make_tree(tmp_path / "t", {"a": 5, "b": 2, "c": 3}, size=(8, 8))
    labels = load_index(root, "val").labels
    assert labels == [0, 1, 2, 0, 1, 2, 0, 2, 0, 0]
    assert load_index(root, "train").labels == [0] * 5 + [1] * 2 + [2] * 3  # train: every loader shuffles it


@pytest.mark.parametrize("backend", ["imagefolder", "lmdb", "downscaled"])
def test_first_64_val_images_of_a_class_sorted_tree_hold_every_class(backend, tiny_data, tmp_path):
    # what `--trainer.limit_val_batches 2` at batch 32 validates (docs/training.md's recipe smoke test)
    from datamodules import DownscaledDataModule, ImageFolderDataModule, LMDBDataModule

    common = {"batch_size": 32, "num_workers": 0, "image_size": 32}
    dm = {"imagefolder": lambda: ImageFolderDataModule(str(tiny_data), **common),
          "lmdb": lambda: LMDBDataModule(str(tiny_data), cache_dir=str(tmp_path / "tiny.lmdb"), **common),
          "downscaled": lambda: DownscaledDataModule(str(tiny_data), max_size=24, cache_dir=str(tmp_path / "d"),
                                                     **common)}[backend]()
    dm.setup("validate")
    loader = iter(dm.val_dataloader())
    seen = {int(y) for _ in range(2) for y in next(loader)[1]}
    assert seen == set(range(dm.num_classes)) and dm.num_classes == 10
