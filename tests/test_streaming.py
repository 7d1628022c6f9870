"""Streaming LitData shards from a real S3 endpoint (moto_server on 127.0.0.1) and from a folder.

Every id once per epoch, pixels equal to ImageFolder's, the cache bound, DDP shards, exact
mid-epoch resume, and one paragraph (exit 2) for each way the store can fail.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from datamodules import ImageFolderDataModule, StreamingDataModule
from datamodules.index import DataError, load_indexes
from datamodules.shards.pack import pack
from tests.conftest import REPO, free_port, quick_args, run_main
from tests.s3_server import s3_fixture, shared_s3_fixture  # noqa: F401 - the fixtures s3 and shared_s3
from tests.streaming_helpers import IdRecordingStreamingDataModule, read_records

pytestmark = pytest.mark.timeout(300)
CHUNK_MB = 0.01  # the tiny set (240 + 80 JPEGs of about 1.2 KB) in chunks of 9 images: many chunks, many workers


def _dm(url: str, **kw) -> StreamingDataModule:
    args = {"data_dir": url, "batch_size": 24, "num_workers": 2, "image_size": 32, "val_crop_ratio": 1.0,
            "persistent_workers": False, **kw}
    dm = StreamingDataModule(**args)
    dm.setup("fit")
    return dm


def _epoch(loader) -> tuple[list[int], list[int], int]:
    ids, labels, batches = [], [], 0
    for images, y, idx in loader:
        assert images.dtype == torch.uint8
        ids += idx.tolist()
        labels += y.tolist()
        batches += 1
    return ids, labels, batches


@pytest.fixture(scope="module")
def s3_pack(shared_s3, tiny_data, tmp_path_factory):
    url = shared_s3.bucket("packs") + "/tiny"
    pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    return url


def test_pack_to_s3_then_one_epoch_sees_every_id_once(s3_pack, tiny_data, tmp_path):
    dm = _dm(s3_pack, cache_dir=str(tmp_path / "cache"), persistent_workers=True)
    indexes = load_indexes(tiny_data)
    train = dm.train_dataloader()
    for split, loader in (("train", train), ("val", dm.val_dataloader())):
        ids, labels, batches = _epoch(loader)
        assert sorted(ids) == list(range(len(indexes[split]))), split
        assert batches == len(loader)
        # the labels every other backend gives these files
        assert labels == [indexes[split].samples[i][1] for i in ids]
    dm.set_train_size(16)  # progressive resizing reaches the persistent workers at the next epoch
    sizes = {tuple(images.shape[-2:]) for images, _, _ in train}
    assert sizes == {(16, 16)}


def test_streamed_val_pixels_equal_imagefolders(s3_pack, tiny_data, tmp_path):
    streamed = _dm(s3_pack, cache_dir=str(tmp_path / "cache"), num_workers=0)
    folder = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=24, num_workers=0, image_size=32,
                                   val_crop_ratio=1.0)
    folder.setup("fit")
    images, labels, ids = next(iter(streamed.val_dataloader()))
    for image, label, i in zip(images, labels, ids.tolist()):
        ref, ref_label = folder.datasets["val"][i]
        assert int(label) == ref_label
        assert torch.equal(image, ref), f"val sample {i} differs from ImageFolder's"


def test_the_cache_stays_under_max_cache_size(s3_pack, tmp_path):
    cache = tmp_path / "cache"
    budget = 200_000  # bytes: about the least 2 workers need (3 chunks each + one in flight, and val's share)
    dm = _dm(s3_pack, cache_dir=str(cache), max_cache_size=f"{budget}B", max_pre_download=2, batch_size=8)
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            size = sum(f.stat().st_size for f in cache.rglob("chunk-*.bin*") if f.is_file())
            peak[0] = max(peak[0], size)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ids, _, _ = _epoch(dm.train_dataloader())
    finally:
        done.set()
        watcher.join()
    assert len(ids) == 240  # 277 KB of chunks went through a 200 KB cache
    assert 0 < peak[0] <= budget, f"the cache reached {peak[0]} bytes, over max_cache_size {budget}"
    with pytest.raises(DataError, match="max_cache_size 100000B is too small for 2 reader"):
        _dm(s3_pack, cache_dir=str(cache), max_cache_size="100000B")


# ------------------------------------------------------------------------------ failures: one paragraph each

def test_unreachable_endpoint_mid_epoch_is_one_paragraph(s3, tiny_data, tmp_path):
    url = s3.bucket("gone") + "/tiny"
    pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    # a cache smaller than the train split: the rest of the epoch must come from the store
    dm = _dm(url, cache_dir=str(tmp_path / "cache"), batch_size=8, max_cache_size="200000B")
    batches = iter(dm.train_dataloader())
    next(batches)
    s3.stop()  # the store goes away mid-epoch
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"Cannot reach the object store at http://127\.0\.0\.1:\d+ for s3://gone/tiny"):
        for _ in batches:
            pass
    assert time.monotonic() - t0 < 120  # bounded retries, not a hang
    with pytest.raises(DataError, match="Cannot reach the object store"):  # and at start
        StreamingDataModule(data_dir=url)


def test_refused_credentials_missing_prefix_and_bucket_are_one_paragraph_each(s3, tiny_data, tmp_path):
    url = s3.bucket("data") + "/tiny"
    pack(tiny_data, url, chunk_mb=1, progress=False)
    with pytest.raises(DataError, match=r"s3://data/nothing has no fic-shards.json: not a pack made by"):
        StreamingDataModule(data_dir="s3://data/nothing")
    with pytest.raises(DataError, match=r"The bucket of s3://nobucket/tiny does not exist"):
        StreamingDataModule(data_dir="s3://nobucket/tiny")
    with pytest.raises(DataError, match=r"has no fic-shards.json: not a pack"):
        StreamingDataModule(data_dir=str(tmp_path))  # a folder, neither a pack nor an ImageFolder tree
    s3.require_auth()  # the server now checks keys: "test" is none of its own
    with pytest.raises(DataError, match=r"The object store at http://127\.0\.0\.1:\d+ refused the credentials for "
                                        r"s3://data/tiny \(.*InvalidAccessKeyId"):
        StreamingDataModule(data_dir=url)


def test_truncated_chunk_is_named(s3, tiny_data, tmp_path):
    import boto3

    url = s3.bucket("broken") + "/tiny"
    pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    client = boto3.client("s3")
    body = client.get_object(Bucket="broken", Key="tiny/train/chunk-000003.bin")["Body"].read()
    client.put_object(Bucket="broken", Key="tiny/train/chunk-000003.bin", Body=body[: len(body) // 2])
    dm = _dm(url, cache_dir=str(tmp_path / "cache"), max_cache_size=None)
    with pytest.raises(DataError, match=r"Chunk train/chunk-000003.bin of the pack s3://broken/tiny is corrupt or "
                                        r"truncated \(is \d+ bytes, its index.json says \d+"):
        _epoch(dm.train_dataloader())


def test_full_cache_disk_is_one_paragraph(s3, tiny_data, tmp_path):
    url = s3.bucket("big") + "/tiny"
    pack(tiny_data, url, chunk_mb=0.1, progress=False)  # chunks of about 100 KB
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): no full disk to test with")
    try:
        dm = _dm(url, cache_dir=str(disk), max_cache_size=None, num_workers=0)
        with pytest.raises(DataError, match=r"The disk holding .*small-disk.* is full while streaming s3://big/tiny"):
            _epoch(dm.train_dataloader())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_worker_killed_is_one_paragraph(s3_pack, tmp_path):
    dm = _dm(s3_pack, cache_dir=str(tmp_path / "cache"), persistent_workers=True, batch_size=8)
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)  # what the kernel's OOM killer does
    try:
        with pytest.raises(DataError, match=r"A data-loading worker process died while streaming "
                                            r"s3://packs/tiny/train \(DataLoader worker \(pid"):
            for _ in batches:
                pass
    finally:
        loader._iterator._shutdown_workers()


# ------------------------------------------------------------------------------ resume, DDP, the packer

@pytest.mark.slow
def test_mid_epoch_resume_restores_the_loader_position(tiny_data, tmp_path):
    """Lightning #20550: reading trainer.estimated_stepping_batches in configure_optimizers keeps the fit loop
    from restoring a stateful loader, and the resumed epoch replays from its start (lightning_app/steps.py)."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_app.module import ImageClassifier

    dst = tmp_path / "pack"
    pack(tiny_data, str(dst), chunk_mb=CHUNK_MB, progress=False)
    records = tmp_path / "ids"

    def fit(max_steps: int, ckpt: str | None = None) -> None:
        pl.seed_everything(0)
        dm = IdRecordingStreamingDataModule(record_dir=str(records), data_dir=str(dst), batch_size=24, num_workers=0,
                                            image_size=32, val_crop_ratio=1.0)
        model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=24,
                                arch_kwargs={"width": 8}, pictures=[])
        every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = pl.Trainer(max_steps=max_steps, max_epochs=1, accelerator="cpu", logger=False, callbacks=[every],
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             default_root_dir=tmp_path)
        trainer.fit(model, dm, ckpt_path=ckpt)

    fit(max_steps=4)  # stops mid-epoch: 4 of the epoch's 10 steps, a checkpoint after step 4
    fit(max_steps=-1, ckpt=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    ids = [i for _, _, batch in read_records(str(records)) for i in batch]
    assert sorted(ids) == list(range(240)), f"{len(ids)} samples trained, {len(set(ids))} distinct"


def _record_args(url: str, root: Path, records: Path, *extra: str, epochs: int = 1) -> list[str]:
    return ["fit", "--config", "configs/data/streaming.yaml", *quick_args(url, root, epochs=epochs, batch=24),
            "--data.class_path", "tests.streaming_helpers.IdRecordingStreamingDataModule",
            "--data.data_dir", url, "--data.record_dir", str(records), "--data.num_workers", "2",
            "--data.cache_dir", str(root / "cache"), "--trainer.num_sanity_val_steps", "0", *extra]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_sees_each_id_once_and_no_secret_is_written(s3, tiny_data, tmp_path):
    url = s3.bucket("train") + "/tiny"
    pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    secret = "S3CR3T-given-in-storage-options"
    # no monitored metric: a step checkpoint waits for no val/acc1, so epoch 0 can be cut
    args = _record_args(url, tmp_path, tmp_path / "ids", "--checkpoint.every_n_train_steps", "2",
                        "--checkpoint.monitor", "null", "--checkpoint.filename", "step{step:03d}",
                        "--data.storage_options", f"{{aws_access_key_id: test, aws_secret_access_key: {secret}}}")
    kill = ["--trainer.callbacks+=tests.fault_helpers.SignalAt", "--trainer.callbacks.epoch=0",
            "--trainer.callbacks.batch=5", "--trainer.callbacks.sig=SIGKILL"]
    killed = run_main([*args, *kill], check=False)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    resumed = run_main([*args, "--ckpt_path", "last"])
    lines = read_records(str(tmp_path / "ids"))
    part1 = [ids for _, batch, ids in lines[:6] if batch < 4]  # the killed run's batches 0-5; 0-3 were checkpointed
    part2 = [ids for _, _, ids in lines[6:]]
    seen = [i for ids in part1 + part2 for i in ids]
    assert sorted(seen) == list(range(240)), f"{len(seen)} samples trained, {len(set(seen))} distinct"
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked and secret not in killed.stdout + killed.stderr + resumed.stdout + resumed.stderr, leaked
    assert "<redacted>" in (tmp_path / "version_0" / "config.yaml").read_text()


@pytest.mark.slow
def test_two_nodes_get_equal_batches_and_disjoint_ids(s3, tiny_data, tmp_path):
    url = s3.bucket("ddp") + "/tiny"
    pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    args = [*_record_args(url, tmp_path, tmp_path / "ids"), "--trainer.strategy", "ddp", "--trainer.devices", "1",
            "--trainer.num_nodes", "2", "--data.num_workers", "1"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "main.py", *args], cwd=REPO, env={**env, "NODE_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    ranks = [[ids for _, _, ids in read_records(str(tmp_path / "ids"), rank)] for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 10  # 240 images, 12 per process and step
    ids = [{i for batch in rank for i in batch} for rank in ranks]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == set(range(240))


@pytest.mark.slow
def test_a_killed_pack_is_refused_then_resumed(s3, slow_tree, tmp_path):
    import boto3

    url = s3.bucket("slow") + "/tree"
    cmd = [sys.executable, "-m", "datamodules.shards", "--src", str(slow_tree), "--dst", url, "--chunk-mb", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client, deadline = boto3.client("s3"), time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = client.list_objects_v2(Bucket="slow", Prefix="tree/.pack/train/").get("KeyCount", 0)
        if found >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -9, "the pack finished before it could be killed"
    failed = run_main(["fit", "--config", "configs/data/streaming.yaml", *quick_args(url, tmp_path)], check=False)
    assert failed.returncode == 2
    assert f"{url} has no fic-shards.json: an interrupted pack: run the same command again" in failed.stderr
    assert "Traceback" not in failed.stderr
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=True)
    assert "resuming train/ of s3://slow/tree" in again.stderr
    dm = StreamingDataModule(data_dir=url, cache_dir=str(tmp_path / "cache"), batch_size=16, num_workers=0,
                             image_size=32)
    dm.setup("fit")
    assert sorted(_epoch(dm.train_dataloader())[0]) == list(range(160))
