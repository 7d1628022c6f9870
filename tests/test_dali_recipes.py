"""DALI with the recipe switches: progressive resizing (one pipeline build per size) and auto-augment."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl

from datamodules import DALIDataModule
from datamodules.errors import DataError
from lightning_app.callbacks.progressive_resizing import ProgressiveResizing
from lightning_app.module import ImageClassifier
from tests.helpers.callbacks import SizeRecorder
from tests.helpers.optional import needs_dali

pytestmark = needs_dali  # in CI (FIC_REQUIRE_DALI=1) a missing DALI fails the run instead


class CountingDALI(DALIDataModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.builds: list[int] = []

    def _make_loader(self, split, train):
        loader = super()._make_loader(split, train)
        if train:
            build = loader._build

            def counted(epoch):
                self.builds.append(self.train_size)
                return build(epoch)

            loader._build = counted
        return loader


@pytest.mark.slow
def test_dali_follows_the_size_schedule_with_one_build_per_size(tiny_data, tmp_path):
    dm = CountingDALI(data_dir=str(tiny_data), batch_size=32, image_size=32, dali_device="cpu", num_threads=1,
                      auto_augment="trivialaugment")
    model = ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=32, arch_kwargs={"width": 8})
    sizes = SizeRecorder()
    trainer = pl.Trainer(max_epochs=4, limit_val_batches=1, num_sanity_val_steps=0, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[ProgressiveResizing(16, 32, 0, 2, step=8), sizes])
    trainer.fit(model, dm)
    per_epoch = {e: {h for ep, h, _ in sizes.seen if ep == e} for e in range(4)}
    assert per_epoch == {0: {16}, 1: {24}, 2: {32}, 3: {32}}
    # A size change costs one build (24 px lives one epoch). The other builds are the loader's own:
    # Lightning's iterable check and every epoch it leaves unfinished (see the integration note).
    assert dm.builds.count(24) == 1 and dm.builds == sorted(dm.builds) and set(dm.builds) == {16, 24, 32}


def test_dali_refuses_random_erasing_and_unknown_policies(tiny_data):
    with pytest.raises(DataError, match="data.random_erasing"):
        DALIDataModule(data_dir=str(tiny_data), dali_device="cpu", random_erasing=0.1)
    with pytest.raises(DataError, match="data.auto_augment"):
        DALIDataModule(data_dir=str(tiny_data), dali_device="cpu", auto_augment="augmix")
