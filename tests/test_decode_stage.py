"""`DecodeStage(loader, decoder)` (datamodules/sample/decode_stage.py): one wrapper, made in one place
(`ImageDataModule.on_device`), gives every backend's loader the device decode under --data.decode gpu."""
from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter

from datamodules import DownscaledDataModule, ImageFolderDataModule, LMDBDataModule, StreamingDataModule
from datamodules.downscale.writer import ensure_downscaled
from datamodules.lmdb.pack import pack as pack_lmdb
from datamodules.resume import ResumableLoader
from datamodules.sample.batches import SampleLoader
from datamodules.sample.decode_stage import DecodeStage
from datamodules.shards.loader import ShardLoader
from datamodules.shards.pack import pack as pack_shards
from lightning_app.module import ImageClassifier
from tests.helpers.cli import quick_args, run_main

COMMON = {"batch_size": 8, "num_workers": 0, "image_size": 16, "decode": "gpu", "persistent_workers": False}


@pytest.fixture(scope="module")
def backends(tiny_data, tmp_path_factory) -> dict:
    made = tmp_path_factory.mktemp("stage")
    return {
        "imagefolder": (ImageFolderDataModule, {"data_dir": str(tiny_data)}),
        "lmdb": (LMDBDataModule, {"data_dir": str(pack_lmdb(tiny_data, made / "tiny.lmdb", progress=False))}),
        "downscaled": (DownscaledDataModule, {"data_dir": str(ensure_downscaled(tiny_data, made / "down", 24))}),
        "shards": (StreamingDataModule, {"data_dir": str(_shards(tiny_data, made / "tiny.shards"))}),
    }


def _shards(tree, dst):
    pack_shards(tree, str(dst), progress=False)
    return dst


@pytest.mark.parametrize("backend", ["imagefolder", "lmdb", "downscaled", "shards"])
def test_every_backend_gets_the_same_stage_around_its_own_loader(backends, backend):
    kind, kwargs = backends[backend]
    dm = kind(**kwargs, **COMMON)
    dm.setup("fit")
    train, val = dm.train_dataloader(), dm.val_dataloader()
    own = (ShardLoader, ShardLoader) if backend == "shards" else (ResumableLoader, SampleLoader)
    for stage, loader_class in zip((train, val), own, strict=True):
        assert type(stage) is DecodeStage and type(stage.loader) is loader_class
        assert not hasattr(stage.loader, "device_stage")  # no loader class knows about the stage
        assert len(stage) == len(stage.loader) and stage.dataset is stage.loader.dataset
        assert stage.sampler is getattr(stage.loader, "sampler", None)
    batch = next(iter(train))
    assert batch[0].shape == (8, 3, 16, 16) and batch[0].dtype == torch.uint8 and batch[1].shape == (8,)
    assert len(batch) == (3 if backend == "shards" else 2)  # a streamed batch keeps its sample ids
    counts = dm.device_decoders["train"].counts
    assert counts["device"] + counts["cpu"] in (8, 16)  # this batch, and the next if the stage took it yet


class _Indices(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch")
        self.seen: list[list[int]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.seen.append(list(batch_indices or []))


def test_predict_through_the_stage_gets_lightnings_batch_indices(tiny_data, tmp_path):
    """Lightning gives predict's loader an index-recording batch sampler only when it is a DataLoader
    (trainer/connectors/data_connector.py, `_prepare_dataloader`): the wrapped loader gets it from that same
    function, and the stage passes `batch_sampler` through, so predictions.csv keys its rows by dataset index."""
    dm = ImageFolderDataModule(data_dir=str(tiny_data), **COMMON)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=16, global_batch_size=8,
                            arch_kwargs={"width": 8}, pictures=[])
    indices = _Indices()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[indices], enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # the model's predictions.csv there
    trainer.predict(model, datamodule=dm, return_predictions=False)
    assert sorted(i for batch in indices.seen for i in batch) == list(range(len(dm.indexes["val"])))


@pytest.mark.slow
def test_under_ddp_each_rank_validates_its_own_share_through_the_stage(tiny_data, tmp_path):
    """2 gloo processes: Lightning's DistributedSampler reaches the wrapped val loader (the stage is no DataLoader,
    which Lightning would give it to), so the ranks share the 80 val images instead of each validating all."""
    out = tmp_path / "val"
    run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=1, batch=16), "--trainer.strategy", "ddp",
              "--trainer.devices", "2", "--data.decode", "gpu", "--data.num_workers", "0",
              "--data.image_size", "16", "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]",
              "--trainer.callbacks+=tests.helpers.callbacks.ValCounter", f"--trainer.callbacks.out_dir={out}"])
    seen = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [[40], [40]], seen
