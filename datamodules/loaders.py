"""How an ImageDataModule turns its datasets into loaders: one plan per loader (`loader_plan`: its workers, their
start and memory, what its dataset does per batch), the dataset built with it, the train sampler (the same shuffle
on any layout), and with --data.decode gpu the DecodeStage that decodes on the device.
A mixin of ImageDataModule (datamodules/base.py), beside LoaderSizing (datamodules/budget/sizing.py), whose
`memory_plan`, `workers` and `cpus` it reads."""
from __future__ import annotations

import os

import torch
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from datamodules.errors import DataError
from datamodules.processes import forksafe
from datamodules.processes.evaluation_loader import EvaluationLoader
from datamodules.processes.loader_workers import WorkerInit, end_stuck_workers_at_exit
from datamodules.processes.start import start_server_early, worker_context
from datamodules.resume import EpochSampler, ResumableLoader
from datamodules.sample import region
from datamodules.sample.balance import WorkerDecodeShare, shared_overflow
from datamodules.sample.batches import SampleLoader, built_batch
from datamodules.sample.dataset import SampleDataset
from datamodules.sample.decode_stage import DecodeStage
from datamodules.sample.device_decode import DeviceDecode
from datamodules.sample.encoded import EncodedDataset
from datamodules.sample.loader_plan import LoaderPlan


class Loaders:
    """The loader methods of ImageDataModule (see the module doc)."""

    _said_cpu_decode = False  # the start-up warning of --data.decode gpu without CUDA, once
    region_decode = True  # a plan's region_decode (sample/loader_plan.py); bench's whole-decode rows set it False

    def _loader(self, split: str, train: bool) -> DataLoader | DecodeStage:
        """The loader of `split`: its plan, its dataset built with it, the sampler, the workers, the device stage."""
        plan = self.loader_plan(train, encoded=isinstance(self.datasets[split], EncodedDataset))
        batch = self.per_process_batch_size
        if train:
            self.check_one_batch(split, batch)
        dataset = self.datasets[split]
        if isinstance(dataset, SampleDataset):
            dataset = dataset.planned(plan)
        end_stuck_workers_at_exit()
        if plan.workers > 0 and plan.start == "fork":  # a server or a new interpreter has no inherited locks
            forksafe.warm_before_fork(dataset)
        kind = ResumableLoader if train else SampleLoader if isinstance(dataset, SampleDataset) else EvaluationLoader
        loader = kind(dataset, batch_size=batch, collate_fn=built_batch if isinstance(dataset, SampleDataset) else None,
                      sampler=self.train_sampler(dataset) if train else None,
                      drop_last=train,  # equal steps on every rank, no tiny last batch in BatchNorm
                      **self.loader_args(plan))
        if isinstance(dataset, EncodedDataset):
            return self.on_device(loader, split, train, dataset.source.describe, plan.overflow)
        return loader

    def loader_plan(self, train: bool, encoded: bool = False) -> LoaderPlan:
        """Every decision about one loader, from the settings and this process's memory plan (shown once): the one
        value its dataset is built with. `encoded`: its workers pack batches for the device (--data.decode gpu)."""
        memory = self.memory_plan(fit=True if train else None)
        self._show_plan(memory)
        if train and self.region_decode:
            region.available()  # finds the region decoder here, building it if need be, before any worker starts
        sizing = memory.loader("train" if train else "val")
        workers = sizing.workers
        return LoaderPlan(
            workers=workers, prefetch=sizing.prefetch if workers > 0 else None,
            start=self.worker_start if workers > 0 else None,
            pin_memory=self.pins_memory and not encoded,  # nvJPEG stages the bytes itself
            persistent_workers=self.persistent_workers and workers > 0,
            decode_threads=max(1, self.cpus() // max(1, workers)), ring_slots=sizing.ring_slots,
            region_decode=self.region_decode,
            overflow=shared_overflow() if encoded else None,  # before the workers start: they read it (balance.py)
        )

    def loader_args(self, plan: LoaderPlan) -> dict:
        """A DataLoader's worker arguments under `plan`."""
        return {"num_workers": plan.workers, "pin_memory": plan.pin_memory,
                "persistent_workers": plan.persistent_workers, "prefetch_factor": plan.prefetch,
                "worker_init_fn": WorkerInit(), **self.loader_start(plan.workers)}

    def check_one_batch(self, split: str, batch: int) -> None:
        """A train split holds at least one global batch of `batch` per process (drop_last would leave no step)."""
        n = len(self.datasets[split])
        if n < batch * self.world_size:
            raise DataError(f"{split}/ of {self.root} has {n} images, fewer than one global batch "
                            f"({self.batch_size}); lower --data.batch_size.")

    def train_sampler(self, dataset: Dataset) -> EpochSampler:
        """The same shuffle whatever the layout: with seed s, epoch e's global batch k is the same images on 1
        process, N processes or N nodes (each rank takes every N-th of them). Lightning calls set_epoch on it, and
        leaves a DistributedSampler alone under DDP. Its state, and the loader's, go into mid-epoch checkpoints
        (datamodules/resume.py)."""
        trainer = self.trainer
        return EpochSampler(dataset, num_replicas=self.world_size, rank=trainer.global_rank if trainer is not None
                            else 0, shuffle=True, seed=int(os.environ.get("PL_GLOBAL_SEED", "0")), drop_last=True)

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
