"""A loader's plan is handed to its dataset when the dataset is built (datamodules/sample/loader_plan.py): building
and running a loader writes nothing into a dataset, on every backend that builds one, and with the device decode."""
from __future__ import annotations

from pathlib import Path

import pytest

from datamodules import DownscaledDataModule, ImageFolderDataModule, LMDBDataModule, StreamingDataModule
from datamodules.lmdb.pack import pack as pack_lmdb
from datamodules.sample.dataset import SampleDataset
from datamodules.sample.loader_plan import LoaderPlan
from datamodules.shards.loader import ShardBatches
from datamodules.shards.pack import pack as pack_shards

COMMON = {"batch_size": 8, "num_workers": 0, "image_size": 16, "val_crop_ratio": 1.0, "persistent_workers": False}


def imagefolder(data: Path, tmp: Path, **kw):
    return ImageFolderDataModule(str(data), **COMMON, **kw)


def lmdb(data: Path, tmp: Path, **kw):
    return LMDBDataModule(str(pack_lmdb(data, tmp / "tiny.lmdb", progress=False)), **COMMON, **kw)


def downscaled(data: Path, tmp: Path, **kw):
    return DownscaledDataModule(str(data), max_size=24, in_memory=True, cache_dir=str(tmp / "small"), **COMMON, **kw)


def shards(data: Path, tmp: Path, **kw):
    pack_shards(data, str(tmp / "tiny.shards"), chunk_mb=0.05, progress=False)
    return StreamingDataModule(str(tmp / "tiny.shards"), **COMMON, **kw)


BACKENDS = [(imagefolder, "cpu"), (imagefolder, "gpu"), (lmdb, "cpu"), (lmdb, "gpu"), (downscaled, "cpu"),
            (shards, "cpu"), (shards, "gpu")]


def attributes(made: object) -> dict[str, int]:
    """What an object holds, by identity (a write of an equal value counts as a write)."""
    return {name: id(value) for name, value in vars(made).items()}


@pytest.mark.parametrize(("make", "decode"), BACKENDS, ids=[f"{m.__name__}-{d}" for m, d in BACKENDS])
def test_building_and_running_a_loader_writes_nothing_into_a_dataset(tiny_data, tmp_path, make, decode):
    dm = make(tiny_data, tmp_path, decode=decode)
    dm.setup("fit")
    ours = {split: ds for split, ds in dm.datasets.items() if isinstance(ds, SampleDataset)}
    before = {split: attributes(ds) for split, ds in ours.items()}
    loaders = {"train": dm.train_dataloader(), "val": dm.val_dataloader()}
    for split, loader in loaders.items():
        collate = getattr(loader, "loader", loader).collate_fn  # the DataLoader a device stage wraps
        collate = getattr(collate, "collate_fn", collate)  # LitData wraps the shards' (StreamingDataLoaderCollateFn)
        built = collate if isinstance(collate, ShardBatches) else loader.dataset
        plan = built.plan
        just_built = attributes(built)
        next(iter(loader))  # a batch built in this process (no workers): the dataset's own code runs too
        assert attributes(built) == just_built, f"{split}: written into while its loader ran"
        # everything it holds came from its constructor: a fresh one from the same plan holds the same names
        fresh = (ShardBatches(built.crop, built.size, built.url, plan, built.with_paths)
                 if isinstance(built, ShardBatches) else dm.datasets[split].planned(plan))
        assert vars(built).keys() == vars(fresh).keys(), f"{split}: written into after it was built"
        assert plan.workers == loader.num_workers == 0 and plan.decode_threads == dm.cpus()
        assert plan.ring_slots == dm.memory_plan(fit=True).loader(split).ring_slots
        if decode == "gpu":  # the device stage writes the very overflow the workers read
            assert plan.overflow is not None and dm.device_decoders[split].share.overflow is plan.overflow
        else:
            assert plan.overflow is None
    assert {split: attributes(ds) for split, ds in ours.items()} == before  # the DataModule's own: untouched


def test_a_datasets_plan_is_read_only(tiny_data):
    dm = ImageFolderDataModule(str(tiny_data), **COMMON)
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    for name in ("decode_threads", "ring_slots", "region_decode"):
        with pytest.raises(AttributeError):
            setattr(dataset, name, 1)
    with pytest.raises(AttributeError):
        dataset.plan.ring_slots = 1
    assert dm.datasets["train"].plan == LoaderPlan()  # the DataModule's dataset keeps the no-loader plan
