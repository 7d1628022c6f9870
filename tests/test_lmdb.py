"""The LMDB packer, reader and DataModule: format, odd and broken images, errors, workers, fork/spawn, resume."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from datamodules.errors import DataError
from datamodules.index import load_indexes
from datamodules.lmdb.datamodule import (
    FORMAT,
    LMDBDataModule,
    LMDBReader,
    LMDBSource,
    main,
    pack,
    read_meta,
    sample_key,
    unpack_value,
)
from datamodules.sample.batches import SampleLoader, built_batch
from datamodules.sample.images import decode_rgb
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main
from tests.helpers.trees import make_tree


@pytest.fixture(scope="module")
def tiny_db(tiny_data, tmp_path_factory) -> Path:
    return pack(tiny_data, tmp_path_factory.mktemp("db") / "tiny.lmdb", progress=False)


def test_pack_follows_the_format_contract(tiny_data, tiny_db):
    assert sorted(os.listdir(tiny_db)) == ["data.mdb", "lock.mdb"]
    assert not list(tiny_db.parent.glob("*.partial"))
    meta = read_meta(tiny_db)
    assert meta["format"] == FORMAT and meta["version"] == 1 and meta["reencoded"] == 0
    assert meta["source_root"] == str(tiny_data)
    indexes = load_indexes(tiny_data)
    assert meta["classes"] == indexes["train"].classes
    env = lmdb.open(str(tiny_db), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            assert txn.stat()["entries"] == 240 + 80 + 1
            for split in ("train", "val"):
                samples = indexes[split].samples
                assert meta["splits"][split]["count"] == len(samples) and meta["splits"][split]["skipped"] == 0
                assert meta["splits"][split]["paths"] == [p for p, _ in samples]
                assert meta["splits"][split]["labels"] == [label for _, label in samples]
                for i, (rel, label) in enumerate(samples):
                    raw = txn.get(f"{split}/{i:08d}".encode())
                    assert raw[:4] == b"FIC1" and int.from_bytes(raw[4:8], "little") == label
                    assert raw[8:] == (tiny_data / rel).read_bytes()  # plain JPEGs are stored as they are
    finally:
        env.close()


def test_reader_api_and_rerun_reuses_the_database(tiny_data, tiny_db):
    reader = LMDBReader(tiny_db)
    assert reader.count("train") == 240 and reader.count("val") == 80 and len(reader.classes) == 10
    data, label = reader.get("val", 79)
    assert label == 9 and data[:2] == b"\xff\xd8"
    with pytest.raises(IndexError):
        reader.get("val", 80)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._txn is None and clone.get("val", 79) == (data, label)
    mtime = (tiny_db / "data.mdb").stat().st_mtime_ns
    assert pack(tiny_data, tiny_db, progress=False) == tiny_db  # up to date: not rewritten
    assert (tiny_db / "data.mdb").stat().st_mtime_ns == mtime
    reader.close()
    clone.close()


def test_unusual_images_decode_exactly_as_imagefolder(odd_tree, tmp_path):
    db = pack(odd_tree, tmp_path / "odd.lmdb", progress=False)
    reader = LMDBReader(db)
    reencoded = 0
    for split in ("train", "val"):
        paths = reader.meta["splits"][split]["paths"]
        assert not any(".git" in p or p.endswith(("notes.txt", ".DS_Store", ".hidden.jpg")) for p in paths)
        for i, rel in enumerate(paths):
            data, _ = reader.get(split, i)
            original = (odd_tree / rel).read_bytes()
            reencoded += data != original
            if rel.endswith("gray.jpg"):
                assert data == original  # a grayscale JPEG is kept: every reader decodes it to PIL's RGB
            expected = np.asarray(decode_rgb(odd_tree / rel))
            got = np.asarray(decode_rgb(data))
            assert got.shape == expected.shape and np.array_equal(got, expected), rel
    # everything but the plain RGB and grayscale JPEGs is stored as PNG (cmyk, rgba, 16-bit, png_named, exif, palette)
    assert reencoded == reader.meta["reencoded"] == 2 * 6
    reader.close()


def _broken_tree(root: Path) -> tuple[Path, list[str]]:
    make_tree(root, {"a": 3, "b": 3})
    good = (root / "train" / "a" / "000.jpg").read_bytes()
    broken = {
        "train/a/zero.jpg": b"",
        "train/a/text.jpg": b"hello, not an image",
        "train/b/truncated.jpg": good[: len(good) // 2],
        # passes the cheap checks (JPEG start, FF D9 at the end) but cannot be decoded
        "val/b/garbled.jpg": good[:20] + bytes(200) + b"\xff\xd9",
    }
    for rel, data in broken.items():
        (root / rel).write_bytes(data)
    return root, sorted(broken)


def test_broken_files_are_listed_and_fail_the_pack_unless_skipped(tmp_path, capsys):
    root, broken = _broken_tree(tmp_path / "tree")
    dst = tmp_path / "out.lmdb"
    with pytest.raises(SystemExit) as exc:
        main(["--src", str(root), "--dst", str(dst), "--quiet", "--workers", "1"])
    assert exc.value.code == 2  # bad input (datamodules/processes/exits.py)
    err = capsys.readouterr().err
    for rel in broken:
        assert str(root / rel) in err
    assert "--skip-invalid" in err and not dst.exists()
    main(["--src", str(root), "--dst", str(dst), "--quiet", "--workers", "2", "--skip-invalid"])
    meta = read_meta(dst)
    assert meta["splits"]["train"] == {**meta["splits"]["train"], "count": 6, "skipped": 3}
    assert meta["splits"]["val"]["count"] == 6 and meta["splits"]["val"]["skipped"] == 1
    skipped = sorted(p for s in ("train", "val") for p, _ in meta["splits"][s]["skipped_files"])
    assert skipped == broken
    with pytest.warns(UserWarning, match="skip-invalid"):
        dm = LMDBDataModule(str(dst), batch_size=4, num_workers=0, image_size=32)
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 6
    dm.reader.close()


def test_bad_paths_are_clear_errors(tmp_path, tiny_db):
    with pytest.raises(DataError, match=r"does not exist.*datamodules\.lmdb") as e:
        LMDBReader(tmp_path / "missing.lmdb")
    assert "missing.lmdb" in str(e.value)
    not_db = tmp_path / "file.lmdb"
    not_db.write_text("hello")
    with pytest.raises(DataError, match="is not an LMDB database") as e:
        LMDBDataModule(str(not_db), batch_size=4)
    assert str(not_db) in str(e.value)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="is not an LMDB database"):
        LMDBReader(tmp_path / "folder")
    incomplete = tmp_path / "incomplete.lmdb"
    env = lmdb.open(str(incomplete), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(sample_key("train", 0), b"FIC1\x00\x00\x00\x00...")
    env.close()
    with pytest.raises(DataError, match="incomplete") as e:
        LMDBDataModule(str(incomplete), batch_size=4)
    assert str(incomplete) in str(e.value)
    with pytest.raises(DataError, match="FIC1"):
        unpack_value(b"JUNKJUNKJUNK")


def test_datamodule_matches_imagefolder_labels_with_workers(tiny_data, tiny_db):
    dm = LMDBDataModule(str(tiny_db), batch_size=80, num_workers=2, image_size=32, val_crop_ratio=1.0)
    assert dm.num_classes == 10
    dm.setup("fit")
    # the parent holds the environment open when the workers fork: each must still open its own
    assert dm.reader.get("train", 0)[1] == 0 and dm.reader._txn is not None
    labels, n = [], 0
    for images, y in dm.val_dataloader():
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 32, 32)
        labels += y.tolist()
        n += len(y)
    assert labels == load_indexes(tiny_data)["val"].labels
    batches = list(dm.train_dataloader())
    assert len(batches) == 3 and sorted(torch.cat([b[1] for b in batches]).tolist()) == sorted(
        load_indexes(tiny_data)["train"].labels)
    dm.reader.close()


@pytest.mark.slow
def test_spawned_workers_open_their_own_environment(tiny_db):
    dm = LMDBDataModule(str(tiny_db), batch_size=40, num_workers=1, image_size=32)
    dm.setup("validate")
    loader = SampleLoader(dm.datasets["val"], batch_size=40, num_workers=1, multiprocessing_context="spawn",
                        collate_fn=built_batch)  # the dataset writes whole batches itself
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [dm.reader.get("val", i)[1] for i in range(80)]
    dm.reader.close()


def _values(db: Path) -> tuple[dict, dict]:
    env = lmdb.open(str(db), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            items = {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()
    meta = json.loads(items.pop(b"__meta__"))
    meta.pop("created")
    return items, meta


@pytest.mark.slow
def test_killed_pack_resumes_to_the_same_database(slow_tree, tmp_path, capsys):
    dst = tmp_path / "slow.lmdb"
    partial = tmp_path / ".slow.lmdb.partial" / "data.mdb"
    cmd = [sys.executable, "-m", "datamodules.lmdb", "--src", str(slow_tree), "--dst", str(dst),
           "--workers", "1", "--commit-every", "10", "--quiet"]
    proc = subprocess.Popen(["nice", "-n", "19", *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    # kill once a few commits are durable (a commit of 10 noise images is about 2 MB)
    while not (partial.exists() and partial.stat().st_size > 5_000_000) and proc.poll() is None:
        assert time.monotonic() < deadline, "the packer never wrote to its temporary database"
        time.sleep(0.02)
    assert proc.poll() is None, "the packer finished before it could be interrupted: make slow_tree larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dst.exists(), "an interrupted pack must never leave a database at --dst"
    with pytest.raises(DataError, match="does not exist"):
        LMDBReader(dst)
    pack(slow_tree, dst, workers=2)
    assert "resuming" in capsys.readouterr().err
    reference = pack(slow_tree, tmp_path / "reference.lmdb", progress=False, workers=2)
    assert _values(dst) == _values(reference)
    assert not partial.parent.exists()


@pytest.mark.slow
def test_ddp_two_processes_with_workers_deliver_one_processs_batches_and_labels(tiny_data, tiny_db, tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "samples"
    args = ["fit", "--config", "configs/data/lmdb.yaml", *quick_args(tiny_db, tmp_path, epochs=1, batch=32),
            "--data.num_workers", "2", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder", f"--trainer.callbacks.out_dir={out}"]
    proc = run_main(args)
    assert "Done: best val/acc1" in proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}_epoch0.json").read_text()) for r in (0, 1)]  # what the loaders delivered
    # the labels of the files packed at those indices
    paths = LMDBReader(tiny_db).meta["splits"]["train"]["paths"]
    truth = dict(load_indexes(tiny_data, cache=False)["train"].samples)
    for rank in ranks:
        assert rank["labels"] == [[truth[paths[i]] for i in batch] for batch in rank["batches"]]
    # the global batches of one process with the same seed, step by step
    monkeypatch.setenv("PL_GLOBAL_SEED", ranks[0]["seed"])
    dm = LMDBDataModule(data_dir=str(tiny_db), batch_size=32, num_workers=0, image_size=16)
    dm.setup("fit")
    train = dm.datasets["train"]
    train.labels = torch.arange(len(train.labels)) * dm.num_classes + train.labels  # the index rides along
    single = [torch.div(labels, dm.num_classes, rounding_mode="floor").tolist() for _, labels in dm.train_dataloader()]
    assert ranks[0]["steps"] == ranks[1]["steps"] == len(single) == 7  # 120 samples per rank, 16 a batch
    for k, batch in enumerate(single):
        assert not set(ranks[0]["batches"][k]) & set(ranks[1]["batches"][k])
        assert set(ranks[0]["batches"][k]) | set(ranks[1]["batches"][k]) == set(batch), f"step {k} differs"


def test_killed_just_before_the_rename_only_renames(tiny_data, tmp_path):
    dst = pack(tiny_data, tmp_path / "t.lmdb", progress=False)
    before = _values(dst)
    os.rename(dst, tmp_path / ".t.lmdb.partial")  # the state a kill between last commit and rename leaves
    mtime = (tmp_path / ".t.lmdb.partial" / "data.mdb").stat().st_mtime_ns
    assert pack(tiny_data, dst, progress=False) == dst
    assert (dst / "data.mdb").stat().st_mtime_ns == mtime and _values(dst) == before


PREFETCHES = hasattr(os, "posix_fadvise") and Path("/proc/self/maps").exists()


@pytest.mark.skipif(not PREFETCHES, reason="prefetching needs posix_fadvise and /proc/self/maps")
def test_prefetch_targets_the_values_own_bytes_in_data_mdb(tiny_db):
    source = LMDBSource(LMDBReader(tiny_db), "val")
    view = source.read(5)  # opens the map, then prefetches the value
    _, fd, base = source.prefetch._state
    assert fd is not None and base is not None, "prefetching is off on a platform that has what it needs"
    offset = np.frombuffer(view, dtype=np.uint8).ctypes.data - base
    with open(tiny_db / "data.mdb", "rb") as f:
        f.seek(offset)
        assert f.read(len(view)) == bytes(view)
    source.reader.close()


@pytest.mark.skipif(not PREFETCHES, reason="prefetching needs posix_fadvise and /proc/self/maps")
def test_prefetch_opened_by_many_sample_threads_at_once(tiny_db):
    """The sample threads of a worker hit a fresh MapPrefetch together: none may see a half-opened state."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    source = LMDBSource(LMDBReader(tiny_db), "val")
    views = [source.read(i) for i in range(8)]
    for _ in range(50):
        prefetch = type(source.prefetch)(source.reader.path)  # fresh: not yet opened in this process
        start = threading.Barrier(8)

        def call(view, prefetch=prefetch, start=start):
            start.wait()
            prefetch(view)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(call, views))  # re-raises what any thread raised
        pid, fd, base = prefetch._state
        assert pid == os.getpid() and fd is not None and base is not None  # opened once, and on
        os.close(fd)
    source.reader.close()
