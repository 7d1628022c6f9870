"""Streaming LitData shards from a real S3 endpoint (moto's ThreadedMotoServer on 127.0.0.1) and from a folder.

Every id once per epoch, pixels equal to ImageFolder's, the cache bound, predict, DDP shards, exact
mid-epoch resume after SIGTERM and SIGKILL, and one paragraph (exit 2), with nothing else on stderr,
for each way the store can fail.

One moto server serves the session (`s3_session`) and the tiny built-in set is packed to it once
(`s3_pack`); tests that change what the server holds work on copies in buckets of their own. Only
the unreachable case, which stops its server, has one of its own.
"""
from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import obstore
import pytest
import torch

from datamodules import ImageFolderDataModule, StreamingDataModule
from datamodules.errors import DataError
from datamodules.index import load_indexes
from datamodules.shards.errors import explain
from datamodules.shards.pack import pack
from datamodules.shards.s3_clients import obstore_store, s3_client
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main, train_checkpoint
from tests.helpers.processes import finish_all, in_child, start_nodes
from tests.helpers.streaming import IdRecordingStreamingDataModule, read_records

pytestmark = pytest.mark.timeout(300)
CHUNK_MB = 0.01  # the tiny set (240 + 80 JPEGs of about 1.2 KB) in chunks of 9 images: many chunks, many workers
MAX_STDERR_LINES = 5


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


def _only_a_paragraph(stderr: str) -> None:
    """What a user reads on stderr when streaming fails: no traceback (LitData's, a worker's), a few lines."""
    assert "Traceback" not in stderr and "CRASHED" not in stderr, stderr[-3000:]
    assert len(stderr.strip().splitlines()) <= MAX_STDERR_LINES, stderr[-3000:]


@pytest.fixture(autouse=True)
def _no_obstore_in_this_process():
    """Downloads through obstore happen in DataLoader workers or `in_child`, never in the pytest process
    (see in_child)."""
    from litdata.streaming import downloader

    yield
    assert downloader._OBSTORE_INIT_PID != os.getpid(), "this test downloaded through obstore in the pytest process"


@pytest.fixture(scope="session")
def _packed(s3_session, tiny_data) -> str:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_session.env.items():
            mp.setenv(k, v)
        url = s3_session.bucket("packs") + "/tiny"
        pack(tiny_data, url, chunk_mb=CHUNK_MB, progress=False)
    return url


@pytest.fixture
def s3_pack(shared_s3, _packed) -> str:
    """s3://packs/tiny on the session's server (read it, never change it), the AWS_* variables set."""
    return _packed


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_pack_to_s3_then_one_epoch_sees_every_id_once(s3_pack, tiny_data, tmp_path, decode):
    dm = _dm(s3_pack, cache_dir=str(tmp_path / "cache"), persistent_workers=True, decode=decode)
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
    streamed = _dm(s3_pack, cache_dir=str(tmp_path / "cache"), num_workers=1)
    folder = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=24, num_workers=0, image_size=32,
                                   val_crop_ratio=1.0)
    folder.setup("fit")
    images, labels, ids = next(iter(streamed.val_dataloader()))
    for image, label, i in zip(images, labels, ids.tolist(), strict=False):
        ref, ref_label = folder.datasets["val"][i]
        assert int(label) == ref_label
        assert torch.equal(image, ref), f"val sample {i} differs from ImageFolder's"


def test_the_cache_stays_under_max_cache_size(s3_pack, tmp_path):
    cache = tmp_path / "cache"
    budget = 200_000  # bytes: about the least 2 workers need (3 chunks each + one in flight, and val's share)
    dm = _dm(s3_pack, cache_dir=str(cache), max_cache_size=f"{budget}B", max_pre_download=2, batch_size=8)
    peak, done, failed = [0], threading.Event(), []

    def size_now() -> int:
        total = 0
        for f in cache.rglob("chunk-*.bin*"):
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # evicted between the listing and the stat
                pass
        return total

    def watch() -> None:
        try:
            while not done.is_set():
                peak[0] = max(peak[0], size_now())
                time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - said by the test: a watcher that stopped early measured nothing
            failed.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ids, _, _ = _epoch(dm.train_dataloader())
    finally:
        done.set()
        watcher.join()
    assert not failed, f"the cache watcher stopped early: {failed}"
    assert len(ids) == 240  # 277 KB of chunks went through a 200 KB cache
    assert 0 < peak[0] <= budget, f"the cache reached {peak[0]} bytes, over max_cache_size {budget}"
    with pytest.raises(DataError, match="max_cache_size 100000B is too small for 2 reader"):
        _dm(s3_pack, cache_dir=str(cache), max_cache_size="100000B")


def test_index_json_is_waited_for_while_another_process_downloads_it(s3_pack, tmp_path):
    """All ranks of a node (and nodes sharing a cache folder) fetch index.json at once; litdata gives the
    process holding its download lock 1 s, then goes on without the file."""
    from litdata.streaming.downloader import get_downloader

    from datamodules.shards.downloader import register_downloader

    register_downloader()
    local = tmp_path / "index.json"
    hold = ("import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
            "print('held', flush=True); time.sleep(3)")
    holder = subprocess.Popen([sys.executable, "-c", hold, f"{local}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        get_downloader(f"{s3_pack}/train", str(tmp_path), []).download_file(f"{s3_pack}/train/index.json", str(local))
        assert json.loads(local.read_text())["chunks"], "index.json was not downloaded"
    finally:
        holder.kill()
        holder.wait()


def test_predict_streams_the_val_split_or_reads_a_folder(s3_pack, tiny_data, tmp_path):
    """No --data.predict_dir: the pack's val split; with one: that folder. One row per image either way, the
    path of the image's file, class names from the checkpoint, the same prediction for the same image."""
    from lightning_app.cli import ClassifierCLI

    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "fit", epochs=1, batch=24)
    common = ["predict", "--config", "configs/data/streaming.yaml", "--ckpt_path", str(ckpt), "--data.batch_size", "16",
              "--data.image_size", "32", "--data.val_crop_ratio", "1.0", "--trainer.accelerator", "cpu",
              "--trainer.enable_progress_bar", "false"]
    ClassifierCLI(args=[*common, "--data.data_dir", s3_pack, "--data.num_workers", "2", "--data.cache_dir",
                        str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path / "val")])
    ClassifierCLI(args=[*common, "--data.predict_dir", str(tiny_data / "val"), "--data.num_workers", "0",
                        "--trainer.default_root_dir", str(tmp_path / "folder")])
    rows = {}
    for run in ("val", "folder"):
        (out,) = (tmp_path / run).rglob("predictions.csv")
        with open(out, newline="") as f:
            rows[run] = {r["path"]: r for r in csv.DictReader(f)}
    files = sorted(str(p) for p in (tiny_data / "val").rglob("*.jpg"))
    assert sorted(rows["val"]) == files and sorted(rows["folder"]) == files  # one row per image, none twice
    names = set(torch.load(ckpt, map_location="cpu", weights_only=False)["class_names"])
    for path, row in rows["val"].items():
        other = rows["folder"][path]
        assert row["class"] in names and row["class"] == other["class"], path
        assert abs(float(row["prob"]) - float(other["prob"])) < 1e-4, path


# ------------------------------------------------------------------------------ failures: one paragraph each

def _obstore_get_explained(bucket: str, key: str, url: str) -> str:
    try:
        obstore.get(obstore_store(bucket, s3_client(None), None), key)  # the store the downloader uses
    except Exception as e:  # noqa: BLE001 - what it raises is the point
        return explain(e, url)
    return "no error"


def _download_both_ways(url: str, chunks: list, cache: str, name: str) -> list[str]:
    """What download_file and adownload_file raise for the chunk `name` (litdata fetches several chunks at
    once through the second, one at a time through the first), and whether a file was left."""
    from litdata.streaming.downloader import get_downloader

    from datamodules.shards.downloader import register_downloader

    register_downloader()
    downloader = get_downloader(f"{url}/train", cache, chunks)
    remote, local = f"{url}/train/{name}", os.path.join(cache, name)
    out = []
    for fetch in (lambda: downloader.download_file(remote, local),
                  lambda: asyncio.run(downloader.adownload_file(remote, local))):
        try:
            fetch()
            out.append("no error")
        except Exception as e:  # noqa: BLE001 - what it raises is the point
            out.append(f"{type(e).__name__}: {e}")
    return out + [f"left a file: {os.path.exists(local)}"]

def test_unreachable_endpoint_mid_epoch_is_one_paragraph(s3, s3_session, _packed, tmp_path, capfd):
    url = s3_session.copy(_packed, "s3://gone/tiny", to=s3)  # this test's own server: it stops it
    # a cache smaller than the train split: the rest of the epoch must come from the store
    dm = _dm(url, cache_dir=str(tmp_path / "cache"), batch_size=8, max_cache_size="200000B", persistent_workers=True)
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    s3.stop()  # the store goes away mid-epoch
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"Cannot reach the object store at http://127\.0\.0\.1:\d+ for s3://gone/tiny"):
        for _ in batches:
            pass
    assert time.monotonic() - t0 < 120  # bounded retries, not a hang
    with pytest.raises(DataError, match="Cannot reach the object store"):  # and at start
        StreamingDataModule(data_dir=url)
    # obstore's error (what a worker's download raises unless obstore was started before the fork) goes on
    # with a multi-line dump: the paragraph quotes its first line
    paragraph = in_child(_obstore_get_explained, "gone", "tiny/train/index.json", url)
    assert re.search(r"refused the connection \(GenericError: [^\n]*GET http://127\.0\.0\.1:\d+/gone/tiny/train/index\.json",
                     paragraph), paragraph
    loader._iterator._shutdown_workers()  # whatever the workers print, they print by now
    _only_a_paragraph(capfd.readouterr().err)


def test_refused_credentials_missing_prefix_and_bucket_are_one_paragraph_each(shared_s3, s3_pack, tmp_path):
    with pytest.raises(DataError, match=r"s3://packs/nothing has no fic-shards.json: not a pack made by"):
        StreamingDataModule(data_dir="s3://packs/nothing")
    with pytest.raises(DataError, match=r"The bucket of s3://nobucket/tiny does not exist"):
        StreamingDataModule(data_dir="s3://nobucket/tiny")
    with pytest.raises(DataError, match=r"has no fic-shards.json: not a pack"):
        StreamingDataModule(data_dir=str(tmp_path))  # a folder, neither a pack nor an ImageFolder tree
    with shared_s3.auth_required(), pytest.raises(  # "test" is none of the server's own keys
            DataError, match=r"The object store at http://127\.0\.0\.1:\d+ refused the credentials for s3://packs/tiny "
                             r"\(.*InvalidAccessKeyId"):
        StreamingDataModule(data_dir=s3_pack)


def test_a_truncated_chunk_is_named_and_is_all_the_user_reads(shared_s3, s3_pack, tiny_data, tmp_path, capfd):
    from lightning_app.cli import main

    url = shared_s3.copy(s3_pack, "s3://broken/tiny")
    client = shared_s3.client()
    body = client.get_object(Bucket="broken", Key="tiny/train/chunk-000003.bin")["Body"].read()
    client.put_object(Bucket="broken", Key="tiny/train/chunk-000003.bin", Body=body[: len(body) // 2])
    args = ["fit", "--config", "configs/data/streaming.yaml", *quick_args(url, tmp_path, batch=24),
            "--data.num_workers", "2", "--data.cache_dir", str(tmp_path / "cache"), "--data.max_cache_size", "null",
            "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]"]
    with pytest.raises(SystemExit) as exit_:
        main(args)  # what `python main.py fit ...` runs; the workers print to this process's stderr
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert "Chunk train/chunk-000003.bin of the pack s3://broken/tiny is corrupt or truncated (is " in err, err[-3000:]
    _only_a_paragraph(err)
    chunks = json.loads(client.get_object(Bucket="broken", Key="tiny/train/index.json")["Body"].read())["chunks"]
    sync, concurrent, left = in_child(_download_both_ways, url, chunks, str(tmp_path / "direct"), "chunk-000003.bin")
    for raised in (sync, concurrent):
        assert re.fullmatch(r"ChunkSizeError: s3://broken/tiny/train/chunk-000003\.bin is \d+ bytes, its index\.json "
                            r"says \d+", raised), raised
    assert left == "left a file: False"


def test_full_cache_disk_is_one_paragraph(s3_pack, tmp_path):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): no full disk to test with")
    try:  # the train split's 277 KB of chunks do not fit
        dm = _dm(s3_pack, cache_dir=str(disk), max_cache_size=None, num_workers=1)
        with pytest.raises(DataError, match=r"The disk holding .*small-disk.* is full while streaming s3://packs/tiny"):
            _epoch(dm.train_dataloader())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_litdata_without_the_crash_report_we_wrap_is_refused(monkeypatch):
    """prefetch.py wraps PrepareChunksThread._report_crash of litdata 0.2.76; another litdata fails loudly."""
    from litdata.streaming import reader

    from datamodules.shards.prefetch import quiet_explained_crashes

    class ReportsElsewhere(reader.PrepareChunksThread):  # a litdata whose run() no longer calls _report_crash
        def run(self) -> None:
            self._run_loop()

    monkeypatch.setattr(reader, "PrepareChunksThread", ReportsElsewhere)
    with pytest.raises(DataError, match=r"written against litdata 0\.2\.76.*pip install litdata==0\.2\.76"):
        quiet_explained_crashes()


def test_a_worker_killed_is_one_paragraph(s3_pack, tmp_path, capfd):
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
    _only_a_paragraph(capfd.readouterr().err)


# ------------------------------------------------------------------------------ resume, DDP, the packer

@pytest.mark.slow
@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_mid_epoch_resume_restores_the_loader_position(tiny_data, tmp_path, decode):
    """Lightning #20550: reading trainer.estimated_stepping_batches in configure_optimizers keeps the fit loop
    from restoring a stateful loader, and the resumed epoch replays from its start (lightning_app/lr_schedule.py).
    With decode gpu the stage a batch ahead saves the state of the batches it handed on."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_app.module import ImageClassifier

    dst = tmp_path / "pack"
    pack(tiny_data, str(dst), chunk_mb=CHUNK_MB, progress=False)
    records = tmp_path / "ids"

    def fit(max_steps: int, ckpt: str | None = None) -> None:
        pl.seed_everything(0)
        dm = IdRecordingStreamingDataModule(record_dir=str(records), data_dir=str(dst), batch_size=24, num_workers=0,
                                            image_size=32, val_crop_ratio=1.0, decode=decode)
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
            "--data.class_path", "tests.helpers.streaming.IdRecordingStreamingDataModule",
            "--data.data_dir", url, "--data.record_dir", str(records), "--data.num_workers", "2",
            "--data.cache_dir", str(root / "cache"), "--trainer.num_sanity_val_steps", "0",
            "--model.pictures", "[]", *extra]


def _signal_at(batch: int, sig: str) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=0",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.sig={sig}"]


@pytest.mark.slow
def test_sigterm_then_sigkill_mid_epoch_each_resumed_sees_each_id_once_and_no_secret_is_written(s3_pack, tmp_path):
    """One epoch of 10 steps in three parts: SIGTERM at batch 4 (CheckpointOnSigterm saves last.ckpt after it),
    resumed; SIGKILL at batch 8 (the step checkpoint of step 8 is the newest), resumed to the end."""
    secret = "S3CR3T-given-in-storage-options"
    # no monitored metric: a step checkpoint waits for no val/acc1, so epoch 0 can be cut
    args = _record_args(s3_pack, tmp_path, tmp_path / "ids", "--checkpoint.every_n_train_steps", "2",
                        "--checkpoint.monitor", "null", "--checkpoint.filename", "step{step:03d}",
                        "--trainer.limit_val_batches", "0",
                        "--data.storage_options", f"{{aws_access_key_id: test, aws_secret_access_key: {secret}}}")
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    runs, parts, seen = [], [], 0
    for sig, batch, saved_step, code in (("SIGTERM", 4, 5, 0), ("SIGKILL", 8, 8, -9), (None, None, 10, 0)):
        resume = ["--ckpt_path", "last"] if runs else []
        run = run_main([*args, *resume, *(_signal_at(batch, sig) if sig else [])], check=False)
        out = run.stdout + run.stderr
        assert run.returncode == code, out[-3000:]
        assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == saved_step
        lines = read_records(str(tmp_path / "ids"))[seen:]
        seen += len(lines)
        first = lines[0][1]
        assert first == (parts[-1][-1][0] + 1 if parts else 0), f"run {len(runs)} started at batch {first}"
        parts.append([(b, ids) for _, b, ids in lines if b < saved_step])  # the batches its checkpoint holds
        runs.append(out)
    assert "SIGTERM: saved" in runs[0]
    ids = [i for part in parts for _, batch in part for i in batch]
    assert sorted(ids) == list(range(240)), f"{len(ids)} samples trained, {len(set(ids))} distinct"
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked and not any(secret in out for out in runs), leaked
    assert "<redacted>" in (tmp_path / "version_0" / "config.yaml").read_text()


@pytest.mark.slow
def test_two_nodes_get_equal_batches_and_disjoint_ids(s3_pack, tmp_path):
    # both "nodes" name one --data.cache_dir, as nodes on a shared file system do: each caches in its own node<N>
    # folder (LitData frees a cache per node: a shared one lost a chunk node 0 was reading, 1 CI run in 5)
    args = [*_record_args(s3_pack, tmp_path, tmp_path / "ids"), "--trainer.strategy", "ddp", "--trainer.devices", "1",
            "--trainer.num_nodes", "2", "--data.num_workers", "1"]
    codes, outs = finish_all(start_nodes(args), timeout=280)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    cached = {path.name: [p.name for p in path.rglob("index.json")] for path in (tmp_path / "cache").iterdir()}
    assert sorted(cached) == ["node0", "node1"] and all(cached.values()), cached
    ranks = [[ids for _, _, ids in read_records(str(tmp_path / "ids"), rank)] for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 10  # 240 images, 12 per process and step
    ids = [{i for batch in rank for i in batch} for rank in ranks]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == set(range(240))


@pytest.mark.slow
def test_a_killed_pack_is_refused_then_resumed(shared_s3, slow_tree, tmp_path, capsys):
    from lightning_app.cli import main

    url = shared_s3.bucket("slow") + "/tree"
    cmd = [sys.executable, "-m", "datamodules.shards", "--src", str(slow_tree), "--dst", url, "--chunk-mb", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client, deadline = shared_s3.client(), time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = client.list_objects_v2(Bucket="slow", Prefix="tree/.pack/train/").get("KeyCount", 0)
        if found >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -9, "the pack finished before it could be killed"
    with pytest.raises(SystemExit) as exit_:  # what `python main.py fit ...` runs
        main(["fit", "--config", "configs/data/streaming.yaml", *quick_args(url, tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{url} has no fic-shards.json: an interrupted pack: run the same command again" in err
    assert "Traceback" not in err
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=True)
    assert "resuming train/ of s3://slow/tree" in again.stderr
    dm = StreamingDataModule(data_dir=url, cache_dir=str(tmp_path / "cache"), batch_size=16, num_workers=1,
                             image_size=32)
    dm.setup("fit")
    assert sorted(_epoch(dm.train_dataloader())[0]) == list(range(160))


def _chunk_of_each_id(url: str, cache_dir: str) -> dict[int, int]:
    """{Index id: the chunk of the pack holding it}, read in the pack's own order in one process."""
    from datamodules.shards.loader import ShardDataset

    dataset = ShardDataset(url, shuffle=False, drop_last=False, cache_dir=cache_dir)
    ids = [int(item[3]) for item in dataset]
    ends = [interval[2] for interval in dataset.cache.get_chunk_intervals()]
    return {i: next(k for k, end in enumerate(ends) if position < end) for position, i in enumerate(ids)}


@pytest.mark.slow
def test_two_nodes_keep_later_epochs_on_the_chunks_each_node_holds(s3_pack, tmp_path):
    """2 nodes of 1 process: LitData guesses 1 node without CUDA (the world over torch.cuda.device_count() with
    it) and deals every epoch's chunks anew over all ranks. Told the trainer's 2 nodes, it keeps each later epoch
    on the chunks its node read in the first (litdata/streaming/shuffle.py, FullShuffle): no new downloads."""
    args = [*_record_args(s3_pack, tmp_path, tmp_path / "ids", epochs=2), "--trainer.strategy", "ddp",
            "--trainer.devices", "1", "--trainer.num_nodes", "2", "--data.num_workers", "1"]
    codes, outs = finish_all(start_nodes(args), timeout=280)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    chunk_of = in_child(_chunk_of_each_id, f"{s3_pack}/train", str(tmp_path / "pack-order"))
    for rank in (0, 1):
        epochs = [[ids for epoch, _, ids in read_records(str(tmp_path / "ids"), rank) if epoch == e] for e in (0, 1)]
        assert len(epochs[0]) == len(epochs[1]) == 10  # 240 images, 12 per process and step
        held = {chunk_of[i] for batch in epochs[0] for i in batch}
        read_later = {chunk_of[i] for batch in epochs[1] for i in batch}
        assert read_later <= held, f"rank {rank} read chunks {sorted(read_later - held)} its node never held"
