"""The smaller things a newcomer tripped on: a warning said twice, a warning with nothing to warn about,
epochs counted from 0 in one line and from 1 in the next, lock files left behind, result files overwritten."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import warnings

import pytest
from pytorch_lightning.plugins.environments import LightningEnvironment

from lightning_app.cli import ClassifierCLI
from tests.helpers.cli import train_checkpoint


@pytest.mark.slow
def test_predict_names_a_bad_image_once(tiny_data, tmp_path):
    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "run", epochs=1, batch=40)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "good.jpg").write_bytes((tiny_data / "val" / "star" / "00000.jpg").read_bytes())
    (photos / "broken.jpg").write_text("not an image")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ClassifierCLI(args=["predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(photos),
                            "--data.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "logs"),
                            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"])
    assert sum("broken.jpg" in str(w.message) for w in seen) == 1, [str(w.message) for w in seen]


def test_compile_with_ddp_warns_only_when_there_is_an_all_reduce():
    from lightning_app.strategies import ClusterDDPStrategy, check_compile

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # every call's warning, not once per location
        for processes in (1, 2):
            environment = LightningEnvironment()
            environment.set_world_size(processes)
            check_compile(ClusterDDPStrategy(cluster_environment=environment))
    said = [str(w.message) for w in seen if "model.compile with DDP" in str(w.message)]
    assert len(said) == 1  # the 2-process strategy only


def test_progressive_resizing_counts_epochs_from_1(tiny_data, caplog):
    from datamodules import ImageFolderDataModule
    from lightning_app.callbacks.progressive_resizing import ProgressiveResizing

    class Trainer:  # what _apply reads: the datamodule
        datamodule = ImageFolderDataModule(data_dir=str(tiny_data), image_size=16, num_workers=0)

    resizing = ProgressiveResizing(start_size=16, end_size=32, start_epoch=0, end_epoch=1, step=16)
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"):
        resizing._apply(Trainer(), 1)  # zero-based epoch 1: the second epoch, "epoch 2" in the epoch lines
    assert "train crop 32 px from epoch 2." in caplog.text


def _hold(path: str, seconds: float, out) -> None:
    from datamodules.packing import file_lock

    with file_lock(path):
        out.put((os.getpid(), time.monotonic(), "in"))
        time.sleep(seconds)
        out.put((os.getpid(), time.monotonic(), "out"))


def test_file_lock_leaves_no_file_and_still_excludes(tmp_path):
    lock = tmp_path / ".out.lmdb.lock"
    queue = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_hold, args=(str(lock), 0.3, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    events = sorted((queue.get(timeout=5) for _ in range(6)), key=lambda e: e[1])
    assert [e[2] for e in events] == ["in", "out"] * 3  # never two holders at once, although each unlinks it
    assert not lock.exists()


def test_tools_and_the_index_cache_leave_no_lock_files(tiny_data, tmp_path, monkeypatch):
    from datamodules.index import load_indexes
    from datamodules.lmdb.pack import main as pack

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    load_indexes(tiny_data)
    assert list((tmp_path / "cache").rglob("*.json")) and not list((tmp_path / "cache").rglob("*.lock"))
    pack(["--src", str(tiny_data), "--dst", str(tmp_path / "out" / "tiny.lmdb"), "--workers", "1"])
    assert (tmp_path / "out" / "tiny.lmdb").exists()
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".lock")]


@pytest.mark.parametrize("arch", ["conv11", "resnet50"])
def test_bench_progressive_names_its_files_by_arch(arch):
    from bench.progressive import output_stem

    assert output_stem("cpu-2c", arch) == f"cpu-2c.progressive.{arch}"
