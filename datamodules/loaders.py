"""How an ImageDataModule turns its datasets into loaders: the train sampler (the same shuffle on any layout), the
workers, their start method and memory plan, and with --data.decode gpu the DecodeStage that decodes on the device.
A mixin of ImageDataModule (datamodules/base.py), beside LoaderSizing (datamodules/budget/sizing.py), whose
`memory_plan`, `workers` and `cpus` it reads."""
from __future__ import annotations

import os

import torch
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from datamodules.errors import DataError
from datamodules.processes import forksafe
from datamodules.processes.loader_workers import WorkerInit, end_stuck_workers_at_exit
from datamodules.processes.start import start_server_early, worker_context
from datamodules.resume import EpochSampler, ResumableLoader
from datamodules.sample.balance import WorkerDecodeShare, shared_overflow
from datamodules.sample.batches import SampleLoader, built_batch
from datamodules.sample.dataset import SampleDataset
from datamodules.sample.decode_stage import DecodeStage
from datamodules.sample.device_decode import DeviceDecode
from datamodules.sample.encoded import EncodedDataset


class Loaders:
    """The loader methods of ImageDataModule (see the module doc)."""

    _said_cpu_decode = False  # the start-up warning of --data.decode gpu without CUDA, once

    def _loader(self, split: str, train: bool) -> DataLoader | DecodeStage:
        plan = self.memory_plan(fit=True if train else None)
        self._show_plan(plan)
        sizing = plan.loader("train" if train else "val")
        workers = sizing.workers
        batch_size = self.per_process_batch_size
        if train and len(self.datasets[split]) < batch_size * self.world_size:
            raise DataError(
                f"{split}/ of {self.root} has {len(self.datasets[split])} images, fewer than one global batch "
                f"({self.batch_size}); lower --data.batch_size."
            )
        sampler = None
        if train:
            # The same shuffle whatever the layout: with seed s, epoch e's global batch k is the same
            # images on 1 process, N processes or N nodes (each rank takes every N-th of them).
            # Lightning calls set_epoch on it, and leaves a DistributedSampler alone under DDP. Its state, and the
            # loader's, go into mid-epoch checkpoints (datamodules/resume.py).
            trainer = self.trainer
            sampler = EpochSampler(
                self.datasets[split], num_replicas=self.world_size,
                rank=trainer.global_rank if trainer is not None else 0, shuffle=True,
                seed=int(os.environ.get("PL_GLOBAL_SEED", "0")), drop_last=True,
            )
        dataset = self.datasets[split]
        if isinstance(dataset, SampleDataset):
            dataset.decode_threads = max(1, self.cpus() // max(1, workers))
            dataset.ring_slots = sizing.ring_slots
            dataset.region_decode = getattr(self, "region_decode", True)  # False: bench loaders' whole-decode rows
        loader = ResumableLoader if train else SampleLoader if isinstance(dataset, SampleDataset) else DataLoader
        end_stuck_workers_at_exit()
        if workers > 0 and self.worker_start == "fork":  # a server or a new interpreter has no inherited locks
            forksafe.warm_before_fork(dataset)
        encoded = isinstance(dataset, EncodedDataset)
        if encoded and dataset.overflow is None:
            dataset.overflow = shared_overflow()  # before the workers start: they read it (balance.py)
        made = loader(
            dataset,
            batch_size=batch_size,
            collate_fn=built_batch if isinstance(dataset, SampleDataset) else None,
            sampler=sampler,
            drop_last=train,  # equal steps on every rank, no tiny last batch in BatchNorm
            num_workers=workers,
            pin_memory=self.pins_memory and not encoded,  # nvJPEG stages the bytes itself
            persistent_workers=self.persistent_workers and workers > 0,
            prefetch_factor=sizing.prefetch if workers > 0 else None,
            worker_init_fn=WorkerInit(),
            **self.loader_start(workers),
        )
        return self.on_device(made, split, train, dataset.source.describe, dataset.overflow) if encoded else made

    def on_device(self, loader: DataLoader, split: str, train: bool, describe, overflow: torch.Tensor,
                  ids: bool = False) -> DecodeStage:
        """--data.decode gpu: `loader`'s EncodedBatches decoded on the training device, by a DecodeStage wrapping it
        (datamodules/sample/decode_stage.py): the one place every backend's stage is made. `describe` names a
        sample's file in an error; `overflow` is the workers' decode share (balance.py); `ids`: the sample ids go on
        as the batch's third element (a streamed batch's, as on the CPU path).

        Lightning adds its samplers only to a DataLoader, which the stage is not: the wrapped loader gets them here
        from Lightning's own function (trainer/connectors/data_connector.py, `_prepare_dataloader`), as it would
        without the stage: an evaluation loader's DistributedSampler under DDP, predict's index wrapper. A train
        loader's EpochSampler (a DistributedSampler) and a LitData loader (an IterableDataset) keep their own.
        """
        trainer = self.trainer
        if trainer is not None and isinstance(loader, DataLoader):
            mode = (RunningStage.TRAINING if train else RunningStage.PREDICTING
                    if trainer.state.fn == TrainerFn.PREDICTING else RunningStage.VALIDATING)
            loader = trainer._data_connector._prepare_dataloader(loader, shuffle=train, mode=mode)
        if self.device.type != "cuda" and not self._said_cpu_decode:
            self._said_cpu_decode = True
            rank_zero_warn(f"--data.decode gpu: the training device is {self.device.type}, not CUDA, so the device "
                           "decode runs on the CPU here, on one thread beside the step: slower than --data.decode cpu, "
                           "whose loader workers decode in parallel. Use --data.decode cpu on this machine.")
        decoder = self.device_decoders.get(split)
        if decoder is None or decoder.device != self.device:
            decoder = self.device_decoders[split] = DeviceDecode(self.device, describe)
        decoder.share = WorkerDecodeShare(overflow, getattr(loader, "num_workers", 0), self.cpu_decode_share)
        decoder.pass_ids = ids
        return DecodeStage(loader, decoder)

    def start_worker_server(self) -> None:
        """The fork server of --data.worker_start forkserver, started before the data is scanned (start.py)."""
        if self.workers() > 0:
            start_server_early(self.worker_start)

    def loader_start(self, workers: int) -> dict:
        """`multiprocessing_context=` for a loader with `workers` worker processes: --data.worker_start's context
        (a loader without workers takes none; DataLoader refuses one)."""
        if workers <= 0:
            return {}
        return {"multiprocessing_context": worker_context(self.worker_start)}

    @property
    def pins_memory(self) -> bool:
        """Pin only when batches go to a CUDA device: pinning creates a CUDA context, even for a CPU run."""
        trainer = self.trainer
        on_cuda = trainer.strategy.root_device.type == "cuda" if trainer is not None else torch.cuda.is_available()
        return self.pin_memory and on_cuda
