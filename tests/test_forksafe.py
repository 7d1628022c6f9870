"""A DataLoader forked after a DALI pipeline was dropped (--data.worker_start fork): the worker must not finalise the
pipeline (datamodules/processes/forksafe.py). Before the fix the worker died of SIGSEGV in DALI's
Executor2::Shutdown."""
from __future__ import annotations

import gc

from torch.utils.data import DataLoader, Dataset

from datamodules.dali.datamodule import DALIDataModule
from datamodules.processes.start import worker_context
from tests.helpers.optional import needs_dali

pytestmark = needs_dali  # in CI (FIC_REQUIRE_DALI=1) a missing DALI fails the run instead


class CollectsGarbage(Dataset):
    """Each item runs a full collection in the worker, as any allocation-heavy worker eventually does."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


def test_a_worker_forked_after_a_dropped_dali_pipeline_survives(tiny_data):
    dm = DALIDataModule(data_dir=str(tiny_data), batch_size=8, num_workers=1, image_size=32, num_threads=2,
                        dali_device="cpu")
    dm.setup("fit")
    loader = dm.train_dataloader()
    next(iter(loader))  # the pipeline's executor threads run now
    del dm, loader  # garbage in reference cycles, left for the parent's next collection
    # forked from this process, as our loaders' workers are under --data.worker_start fork
    loader = DataLoader(CollectsGarbage(), batch_size=2, num_workers=1, multiprocessing_context=worker_context("fork"))
    got = [int(i) for batch in loader for i in batch]
    assert got == [0, 1, 2, 3]
    gc.collect()  # the parent finalises the pipeline, with its threads
