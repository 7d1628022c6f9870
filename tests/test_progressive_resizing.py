"""Progressive resizing: the schedule, the size every batch of every epoch has, resumes, TensorBoard."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules import ImageFolderDataModule
from lightning_app.callbacks.progressive_resizing import ProgressiveResizing, scheduled_size
from lightning_app.module import ImageClassifier
from tests.helpers.callbacks import SizeRecorder
from tests.helpers.cli import quick_args, run_main
from tests.helpers.processes import free_port


def ffcv_get_resolution(epoch, min_res, max_res, end_ramp, start_ramp):
    """FFCV's ImageNetTrainer.get_resolution (ffcv-imagenet train_imagenet.py), the reference."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


@pytest.mark.parametrize("ramp", [(160, 192, 11, 13), (160, 192, 65, 76), (128, 256, 2, 20), (160, 224, 0, 5)])
def test_schedule_matches_ffcv(ramp):
    lo, hi, start, end = ramp
    for epoch in range(end + 3):
        assert scheduled_size(epoch, lo, hi, start, end) == ffcv_get_resolution(epoch, lo, hi, end, start)


def test_schedule_with_small_steps_stays_within_its_sizes():
    sizes = [scheduled_size(e, 64, 96, 1, 5, step=8) for e in range(8)]
    assert sizes == [64, 64, 72, 80, 88, 96, 96, 96]
    # 32 clamped up to 40
    assert [scheduled_size(e, 40, 50, 0, 4, step=32) for e in range(6)] == [40, 40, 40, 40, 50, 50]
    with pytest.raises(ValueError, match="end_epoch > start_epoch"):
        ProgressiveResizing(64, 96, 3, 3)


def _fit(data, root, epochs, recorder, ckpt_path=None, workers=1):
    dm = ImageFolderDataModule(data_dir=str(data), batch_size=32, num_workers=workers, image_size=32,
                               persistent_workers=True)
    model = ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=32, arch_kwargs={"width": 8})
    every_epoch = ModelCheckpoint(dirpath=root / "ckpt", filename="e{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=epochs, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", enable_progress_bar=False, default_root_dir=root,
                         logger=TensorBoardLogger(root, name="tb", version=0 if ckpt_path is None else 1),
                         callbacks=[ProgressiveResizing(16, 32, 0, 2, step=8), recorder, every_epoch])
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.slow
def test_every_batch_has_its_epochs_size_with_persistent_workers_and_after_resume(tiny_data, tmp_path):
    expected = {0: 16, 1: 24, 2: 32, 3: 32}
    plain = SizeRecorder()
    _, model = _fit(tiny_data, tmp_path, 3, plain)
    assert [(e, h) for e, h, _ in plain.seen] == [(e, expected[e]) for e in (0, 0, 1, 1, 2, 2)]
    assert all(h == w for _, h, w in plain.seen)
    assert model.hparams.image_size == 32  # the model (ResNet's stem choice) is built once, for data.image_size

    # resume after epoch 0 (its first epoch is 1: 24 px) and run on to epoch 3
    resumed = SizeRecorder()
    _fit(tiny_data, tmp_path, 4, resumed, ckpt_path=str(tmp_path / "ckpt" / "eepoch=0.ckpt"))
    assert [(e, h) for e, h, _ in resumed.seen] == [(e, expected[e]) for e in (1, 1, 2, 2, 3, 3)]

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/image_size")] == [16.0, 24.0, 32.0]


def test_set_train_size_changes_the_loader_batches(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert next(iter(loader))[0].shape[-2:] == (32, 32)
    dm.set_train_size(24)
    batch = next(iter(loader))[0]
    assert batch.shape[-2:] == (24, 24) and batch.dtype.is_floating_point is False
    with pytest.raises(Exception, match="train size"):
        dm.set_train_size(0)


def test_without_a_resizable_datamodule_the_error_says_so():
    callback = ProgressiveResizing(16, 32, 0, 2)

    class Bare:
        datamodule = pl.LightningDataModule()
        current_epoch = 0

    with pytest.raises(ValueError, match="set_train_size"):
        callback._apply(Bare(), 0)


def test_progressive_resizing_counts_epochs_from_1(tiny_data, caplog):
    class Trainer:  # what _apply reads: the datamodule
        datamodule = ImageFolderDataModule(data_dir=str(tiny_data), image_size=16, num_workers=0)

    resizing = ProgressiveResizing(start_size=16, end_size=32, start_epoch=0, end_epoch=1, step=16)
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"):
        resizing._apply(Trainer(), 1)  # zero-based epoch 1: the second epoch, "epoch 2" in the epoch lines
    assert "train crop 32 px from epoch 2." in caplog.text


@pytest.mark.slow
def test_progressive_vs_plain_bench_writes_both_curves(tiny_data, tmp_path):
    """A smoke run of the wall-clock comparison (2 tiny epochs each): its files, not its timings."""
    import json

    from bench.progressive import main

    result = main(["--data-dir", str(tiny_data), "--image-size", "32", "--start-size", "16", "--step", "8",
                   "--epochs", "2", "--ramp", "0", "0.5", "--budget", "300", "--batch-size", "32",
                   "--num-workers", "0", "--out", str(tmp_path)])
    assert [p["train_size"] for p in result["plain"]["points"]] == [32, 32]
    assert [p["train_size"] for p in result["progressive"]["points"]] == [16, 32]
    for run in ("plain", "progressive"):
        seconds = [p["seconds"] for p in result[run]["points"]]
        assert seconds == sorted(seconds) and seconds[0] > 0
    # the arch in the name: runs of two archs keep both
    stem = tmp_path / f"{result['machine_name']}.progressive.conv11"
    assert json.loads((tmp_path / f"{stem.name}.json").read_text())["comparison"]["verdict"]
    assert "**Verdict:**" in (tmp_path / f"{stem.name}.md").read_text()
    assert (tmp_path / f"{stem.name}.png").stat().st_size > 1000


@pytest.mark.parametrize("arch", ["conv11", "resnet50"])
def test_bench_progressive_names_its_files_by_arch(arch):
    from bench.progressive import output_stem

    assert output_stem("cpu-2c", arch) == f"cpu-2c.progressive.{arch}"


@pytest.mark.slow
def test_progressive_resizing_under_ddp_from_the_cli(tiny_data, tmp_path):
    """Two gloo processes with persistent workers: every rank trains each epoch at that epoch's size."""
    import json

    out = tmp_path / "seen"
    config = tmp_path / "progressive.yaml"
    config.write_text(json.dumps({"trainer": {"callbacks+": [
        {"class_path": "lightning_app.callbacks.progressive_resizing.ProgressiveResizing",
         "init_args": {"start_size": 16, "end_size": 32, "start_epoch": 0, "end_epoch": 2, "step": 8}},
        {"class_path": "tests.helpers.callbacks.RankSizeRecorder", "init_args": {"out_dir": str(out)}}]}}))
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=3, batch=32), "--config", str(config),
            "--data.num_workers", "1", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.limit_train_batches", "2", "--trainer.num_sanity_val_steps", "0"]
    run_main(args, env={"MASTER_PORT": str(free_port())})
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert [(e, h) for e, h, _ in seen] == [(0, 16), (0, 16), (1, 24), (1, 24), (2, 32), (2, 32)]
    acc = EventAccumulator(str(next(tmp_path.glob("version_*"))), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/image_size")] == [16.0, 24.0, 32.0]
