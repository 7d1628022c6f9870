"""DALI backend: decoding on the GPU ("mixed") where there is one, else on the CPU.

The Index's samples are DALI's explicit file list (or a packed LMDB is read through a
parallel `external_source`), so every file has the label the other backends give it.
Batches are NCHW views of channels-last (NHWC) memory, so a channels_last model takes them without
a copy, with int64 labels:
- `mixed` (GPU): float (fp16 under 16-mixed), normalised by DALI on the device;
- `cpu`: uint8, a quarter of the bytes of float, pinned when the trainer runs on CUDA, and
  normalised on the device in `on_after_batch_transfer` like every other backend.

Threads, memory and epoch boundaries: `datamodules/dali/loader.py`.

Sharding: train reads with shard_id = global rank, num_shards = world size, pad_last_batch, and
stick_to_shard=False: all ranks move to the next shard together each epoch, so shards stay
disjoint within every epoch and each rank sees all the data over world-size epochs; DROP (every
rank runs the steps of the smallest shard). Val gives each rank its own slice of the files
(every world-size-th, as the LMDB source) as one whole DALI shard, with PARTIAL: each rank its
exact shard in its own number of batches, no duplicates and never an empty batch.

CPU decoding: DALI reads, picks the random crop and decodes only that region; the sample
path's resize kernel makes the batch (`loader.HostFinish`), because DALI's own CPU resize
cost more than its decoding (pipelines.py). Validation then takes the other backends' exact
geometry (shorter side, centre crop): on the built-in test images its batches equal
ImageFolder's (tests/test_dali.py). Under a DALI auto-augment policy, and with `mixed`, DALI
resizes itself: against torchvision's resize + centre crop that is 1.5 grey levels mean
difference on ImageNet-size images (224 crop), from DALI rounding the longer side and the crop
offset differently (a 1 px shift on some images).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from datamodules.base import ImageDataModule
from datamodules.budget.memory import MemoryPlan
from datamodules.budget.sizing import Layout
from datamodules.dali.loader import (
    DEVICE_MEMORY_PADDING,
    HOST_MEMORY_PADDING,
    MAX_MIXED_THREADS,
    DALILoader,
    HostFinish,
    dali_memory_bill,
    dali_memory_plan,
    dali_threads,
)
from datamodules.errors import DataError
from datamodules.index import Index

INSTALL_HINT = "pip install -r requirements-dali-cu13.txt   (a torch built for CUDA 12: requirements-dali-cu12.txt)"
DEVICES = ("auto", "gpu", "cpu")
SOURCES = ("folder", "lmdb")
def require_dali() -> None:
    """Raise a DataError that says how to install DALI when it cannot be imported."""
    try:
        import nvidia.dali
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError as e:
        raise DataError(
            f"DALIDataModule needs NVIDIA DALI, which cannot be imported here ({e}). Install it with:\n"
            f"    {INSTALL_HINT}\n"
            "or use another backend, e.g. --data datamodules.ImageFolderDataModule."
        ) from e


class DALIDataModule(ImageDataModule):
    """ImageFolder tree (or a packed LMDB) decoded by NVIDIA DALI.

    Args (the shared ones, data_dir, batch_size, image_size..., pass through to ImageDataModule):
        dali_device: "auto" (GPU "mixed" decoding when the trainer runs on CUDA, else CPU), "gpu" or "cpu".
        source: "folder" reads the Index's files; "lmdb" reads `lmdb_path` packed by
            `python -m datamodules.lmdb` (default: the folder `<data_dir>.lmdb`).
        lmdb_path: the packed database for source "lmdb".
        num_threads: DALI CPU threads per pipeline (default: this process's share of the CPU affinity
            mask; at most 8 for GPU decoding, where each thread preallocates nvJPEG buffers).
        prefetch_queue_depth: batches DALI prepares ahead.
        hw_decoder_load: share of JPEG decoding given to the hardware decoder (A100/H100), GPU only.
        seed: DALI's random seed (shuffle, crops, flips); each rank and epoch derives its own.
    """

    def __init__(
        self,
        dali_device: str = "auto",
        source: str = "folder",
        lmdb_path: str | None = None,
        num_threads: int | None = None,
        prefetch_queue_depth: int = 2,
        hw_decoder_load: float = 0.65,
        seed: int = 42,
        **kwargs: Any,
    ) -> None:
        require_dali()
        from datamodules.dali.augment import check_dali_augment

        check_dali_augment(kwargs.get("auto_augment"), kwargs.get("random_erasing", 0.0))
        if kwargs.get("decode", "cpu") == "gpu":
            raise DataError("data.decode gpu is the other backends' GPU decode; DALIDataModule decodes with DALI and "
                            "takes its device from --data.dali_device: gpu (nvJPEG, 'mixed'), cpu, or auto (the GPU "
                            "when the trainer runs on CUDA). Drop --data.decode gpu and set --data.dali_device gpu.")
        if dali_device not in DEVICES:
            raise DataError(f"data.dali_device must be one of {DEVICES}, got {dali_device!r}.")
        if source not in SOURCES:
            raise DataError(f"data.source must be one of {SOURCES}, got {source!r}.")
        if dali_device == "gpu" and not torch.cuda.is_available():
            raise DataError("data.dali_device gpu needs CUDA, which is not available here; use auto or cpu.")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise DataError(f"data.hw_decoder_load must be in [0, 1], got {hw_decoder_load}.")
        if num_threads is not None and num_threads < 1:
            raise DataError(f"data.num_threads must be >= 1 or null (sized from the CPUs), got {num_threads}.")
        if prefetch_queue_depth < 1:
            raise DataError(f"data.prefetch_queue_depth must be >= 1, got {prefetch_queue_depth}.")
        self.dali_device = dali_device
        self.source = source
        self.lmdb_path = lmdb_path
        self.num_threads = num_threads
        self.prefetch_queue_depth = prefetch_queue_depth
        self.hw_decoder_load = hw_decoder_load
        self.seed = seed
        self.lmdb_meta: dict | None = None
        self.loaders: dict[str, DALILoader] = {}
        super().__init__(**kwargs)
        self.train_augment = None  # the pipeline applies auto_augment itself (datamodules/dali/augment.py)

    # -- data discovery -------------------------------------------------------------------
    def discover_classes(self) -> list[str]:
        if self.source == "folder":
            return super().discover_classes()
        from datamodules.lmdb.format import read_meta as read_lmdb_meta

        if self.lmdb_path is None:
            if self.data_dir is None:
                raise DataError("data.source lmdb needs data.lmdb_path (or data.data_dir, read as <data_dir>.lmdb).")
            self.lmdb_path = str(self.data_dir).rstrip("/\\") + ".lmdb"
        self.root = self.lmdb_path
        self.lmdb_meta = read_lmdb_meta(self.lmdb_path)
        return list(self.lmdb_meta["classes"])

    def load_indexes(self) -> dict[str, Index]:
        if self.source == "folder":
            return super().load_indexes()
        # The packer decoded every image fully and left bad ones out: nothing is bad here.
        meta = self.lmdb_meta
        return {
            split: Index(self.lmdb_path, split, self.classes, [(p, -1) for p in info["paths"]])
            for split, info in meta["splits"].items()
        }

    def make_dataset(self, split: str, index: Index):
        return index  # DALI reads the Index itself; this only gives len() to the base class

    # -- devices and sharding -------------------------------------------------------------
    def _trainer_device(self) -> torch.device | None:
        trainer = self.trainer
        return trainer.strategy.root_device if trainer is not None else None

    @property
    def decoder_device(self) -> str:
        """"mixed" or "cpu". `auto` follows the trainer's device (a `--trainer.accelerator cpu` run on a GPU
        machine decodes on the CPU and never creates a CUDA context); with no trainer, CUDA's presence."""
        if self.dali_device != "auto":
            return "mixed" if self.dali_device == "gpu" else "cpu"
        device = self._trainer_device()
        gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
        return "mixed" if gpu else "cpu"

    def _device_id(self) -> int | None:
        if self.decoder_device == "cpu":
            return None  # -1 would still try CUDA
        trainer = self.trainer
        if trainer is not None and trainer.strategy.root_device.type == "cuda":
            return trainer.strategy.root_device.index or 0
        return torch.cuda.current_device()

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _fp16(self) -> bool:
        trainer = self.trainer
        return self.decoder_device == "mixed" and trainer is not None and str(trainer.precision).startswith("16")

    def pipeline_threads(self) -> int:
        """DALI threads per pipeline: data.num_threads, or this process's share of its CPUs (bench reads it too)."""
        device = self.decoder_device
        # this process's CPUs: its whole per-task mask under srun, else its share of the node
        # (datamodules/budget/cpus.py)
        threads = dali_threads(device, usable=self.cpus(), requested=self.num_threads)
        bill = dali_memory_bill(device, threads)
        if bill["device"] > 1 << 30:  # only an explicit num_threads gets here
            warnings.warn(f"data.num_threads {threads} with GPU decoding preallocates "
                          f"{bill['device'] >> 20} MiB of GPU "
                          f"and {bill['pinned'] >> 20} MiB of pinned memory per pipeline (two per process); "
                          f"{MAX_MIXED_THREADS} threads are plenty for nvJPEG.", stacklevel=2)
        return threads

    def _resize_on_host(self, train: bool) -> bool:
        """CPU decoding resizes with the sample path's kernel (pipelines.py says why), except under a
        DALI auto-augment policy, which runs in the pipeline on the resized images."""
        return self.decoder_device == "cpu" and not (train and self.auto_augment)

    def _spec(self, train: bool):
        from datamodules.dali.pipelines import PipelineSpec

        size = self.train_size if train else self.val_image_size
        return PipelineSpec(
            train=train, decoder_device=self.decoder_device, image_size=size,
            val_resize=round(self.val_image_size / self.val_crop_ratio), min_scale=self.min_scale,
            fp16=self._fp16(), hw_decoder_load=self.hw_decoder_load,
            device_memory_padding=DEVICE_MEMORY_PADDING, host_memory_padding=HOST_MEMORY_PADDING,
            auto_augment=self.auto_augment if train else None, resize_on_host=self._resize_on_host(train),
        )

    # -- loaders --------------------------------------------------------------------------
    def _make_loader(self, split: str, train: bool) -> DALILoader:
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, DALIRaggedIterator

        from datamodules.dali import pipelines as dp

        index = self.indexes[split]
        rank, world = self._rank()
        batch = self.per_process_batch_size
        n = len(index)
        if train and n < self.batch_size:
            raise DataError(f"{split}/ of {self.root} has {n} images, fewer than one global batch "
                            f"({self.batch_size}); lower --data.batch_size.")
        if not train and n < world:
            raise DataError(f"{split}/ of {self.root} has {n} images, and each of the {world} processes needs at "
                            "least one to validate on; add images or run fewer processes.")
        device = self._trainer_device()
        if self.decoder_device == "mixed" and device is not None and device.type != "cuda":
            raise DataError(f"data.dali_device gpu decodes onto a CUDA device, but the trainer runs on {device}; "
                            "use --data.dali_device auto (or cpu), or train on the GPU.")
        pin = self.decoder_device == "cpu" and self.pin_memory and device is not None and device.type == "cuda"
        threads = self.pipeline_threads()
        common = {"batch_size": batch, "num_threads": threads, "device_id": self._device_id(),
                  "prefetch_queue_depth": self.prefetch_queue_depth}
        finish = None
        if self._resize_on_host(train):
            size = (lambda: self.train_size) if train else (lambda: self.val_image_size)
            finish = HostFinish(train, size, self.val_crop_ratio, threads, pin)

        def iterator(pipe, spec, lmdb: bool, **kw):
            names = dp.output_names(spec, lmdb)
            if finish is None:
                return DALIGenericIterator([pipe], names, **kw)
            ragged = [DALIRaggedIterator.SPARSE_LIST_TAG if n == "images" else DALIRaggedIterator.DENSE_TAG
                      for n in names]
            return DALIRaggedIterator([pipe], names, output_types=ragged, **kw)

        if self.source == "folder":
            files = [index.path(i) for i in range(n)]
            if train:
                # Shuffled once (the same on every rank) so a contiguous shard mixes all classes;
                # each epoch DALI's shuffle buffer reorders within the shard.
                positions = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
            else:
                # Val: this rank's own slice, read as one whole DALI shard (the LMDB path's split below). Under
                # DALI's sharding, pad_last_batch pads every shard to the batches of the largest one, and PARTIAL
                # then hands a shorter shard an EMPTY last batch (nvidia/dali/plugin/base_iterator.py: `_size` is
                # epoch_size_padded // shards, `_remove_padded` keeps shard size - counter + batch): 11 files,
                # 2 shards, batch 5 gave rank 0 batches of [5, 0], and torchmetrics fails on the empty one.
                positions = list(range(rank, n, world))
            files = [files[i] for i in positions]
            policy = LastBatchPolicy.DROP if train else LastBatchPolicy.PARTIAL
            # Train: every rank runs the steps of the smallest shard (what DALI's DROP does too). Val: each rank
            # its own shard's batches, so ranks may run different numbers of val steps. That is safe as long as
            # each runs at least one: Lightning's evaluation loop ends on StopIteration (pytorch_lightning/loops/
            # evaluation_loop.py, `run`) and syncs logged values once, at the epoch's end (trainer/connectors/
            # logger_connector/result.py, `compute`: sum and count both reduced, so the mean stays per sample);
            # DDP broadcasts buffers in the first no-grad forward only (torch/nn/parallel/distributed.py,
            # `require_forward_param_sync`).
            steps = (n // world) // batch if train else math.ceil(len(positions) / batch)

            def build(epoch: int):
                spec = self._spec(train)
                shard, shards = ((rank + epoch) % world, world) if train else (0, 1)
                pipe = dp.file_pipeline(spec, files, positions, shard, shards,
                                        seed=self.seed + 1000 * epoch + rank, **common)
                pipe.build()
                return iterator(pipe, spec, False, reader_name=dp.READER_NAME, last_batch_policy=policy,
                                auto_reset=False)

            table = torch.tensor(index.labels, dtype=torch.int64)
            return DALILoader(build, steps, table, pin=pin, finish=finish)

        shard_len = len(range(rank, n, world))
        steps = (n // world) // batch if train else math.ceil(shard_len / batch)
        trim = {} if train or shard_len % batch == 0 else {steps - 1: shard_len % batch}

        def build_lmdb(epoch: int):
            source = dp.LMDBSampleSource(self.lmdb_path, split, n, rank, world, batch, steps, train, self.seed, epoch)
            spec = self._spec(train)
            pipe = dp.external_pipeline(spec, source, seed=self.seed + 1000 * epoch + rank,
                                        py_num_workers=max(1, self.workers()), py_start_method="spawn", **common)
            pipe.start_py_workers()
            pipe.build()
            return iterator(pipe, spec, True, auto_reset=False, last_batch_policy=LastBatchPolicy.PARTIAL)

        return DALILoader(build_lmdb, steps, None, trim, pin=pin, finish=finish)

    @classmethod
    def plan_for(cls, args, layout: Layout, train_sizes=(), resident: int = 0) -> MemoryPlan:
        return dali_memory_plan(args, layout, train_sizes)

    def start_worker_server(self) -> None:
        """No fork server: DALI starts its own worker processes (describe_worker_start)."""

    def describe_worker_start(self) -> str:
        # DALI's parallel external source takes py_start_method "fork" or "spawn" only (nvidia/dali/pipeline.py,
        # `py_start_method`; _multiproc/pool.py, `ProcPool.from_contexts`), and "fork" only before any CUDA context
        # exists in the process (pipeline.py, `start_py_workers`), which Lightning has made by the time a loader is
        # built: spawn, whatever --data.worker_start says
        if self.source == "lmdb":
            return "DALI's external-source workers start by spawn"
        return "no worker processes (DALI's threads read the files)"

    def _loader(self, split: str, train: bool) -> DALILoader:
        self._show_plan(self.memory_plan(fit=True if train else None))
        key = f"{split}:{int(train)}"
        if key not in self.loaders:
            self.loaders[key] = self._make_loader(split, train)
        return self.loaders[key]

    def set_train_size(self, size: int) -> None:
        """Progressive resizing: the train pipeline is rebuilt at the next epoch, once per new size."""
        changed = int(size) != self.train_size
        super().set_train_size(size)
        loader = self.loaders.get("train:1")
        if changed and loader is not None:
            loader.close()  # the next iter() builds the pipeline with the new size (and that epoch's shard/seed)

    def teardown(self, stage: str | None = None) -> None:
        for loader in self.loaders.values():
            loader.close()
        self.loaders = {}
