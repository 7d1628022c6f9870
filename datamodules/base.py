"""What every backend shares: the init args users type, the Index, the global batch size.

A backend subclasses `ImageDataModule`, declares only its own init args (the rest pass through
**kwargs; LightningCLI resolves them from this signature) and implements `make_dataset(split,
index)`, usually as `self.sample_dataset(split, source, labels)`: the shared sample path of
datamodules/sample/. DALI overrides the dataloader methods entirely. The loaders made of the datasets are
datamodules/loaders.py's (`Loaders`); their workers and memory, datamodules/budget/sizing.py's (`LoaderSizing`).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from datamodules.budget.memory import DEFAULT_BUDGET_GIB, release_cached_pinned_memory
from datamodules.budget.sizing import LoaderSizing
from datamodules.errors import DataError
from datamodules.index import Index, find_classes, load_indexes
from datamodules.loaders import Loaders
from datamodules.processes.loader_workers import WorkerInit
from datamodules.processes.start import DEFAULT_START, WorkerStart, check_start
from datamodules.sample.augment import make_train_augment
from datamodules.sample.crop import Augment, TrainCrop, ValCrop
from datamodules.sample.dataset import SampleDataset, Source
from datamodules.sample.device_decode import DeviceDecode
from datamodules.sample.encoded import EncodedDataset
from datamodules.sample.pixel_limit import PILLOW_MAX_IMAGE_PIXELS, use_in_pillow, warn_large_files
from datamodules.sample.transforms import normalize

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILTIN_ROOT = REPO_ROOT / "data" / "builtin"


def resolve_data_dir(data_dir: str | os.PathLike | None, builtin: str) -> Path:
    """`data_dir`, or the built-in dataset (generated on first use) when it is None."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    from datamodules.builtin.tree import ensure_builtin

    return Path(ensure_builtin(builtin, root=BUILTIN_ROOT))


class ImageDataModule(LoaderSizing, Loaders, pl.LightningDataModule):
    """Shared init args (docs/design.md, "Names that must not change without a note": the flags of main.py).

    Args:
        data_dir: root holding train/ and val/ (ImageFolder layout); None = the built-in dataset.
        builtin: preset of the built-in dataset used when data_dir is None.
        batch_size: GLOBAL batch size, split evenly across all processes (devices x nodes).
        num_workers: DataLoader worker processes per training process; "auto" = this process's
            share of the CPUs it may run on (affinity mask / processes on the node), see `workers()`.
        image_size: training crop size (px).
        val_image_size: validation crop size (px); default: image_size.
        val_crop_ratio: validation resizes the shorter side to val_image_size / val_crop_ratio.
        min_scale: smallest area fraction of the random resized crop (ImageNet recipes: 0.08).
        pin_memory: page-locked host batches for faster, asynchronous copies to the GPU.
        persistent_workers: keep workers alive between epochs.
        skip_invalid: leave unreadable files out (listed in a warning) instead of failing.
        predict_dir: `predict` reads every image under this folder (datamodules/predict.py); without
            data_dir, no training tree is read or generated and the classes come from the checkpoint.
        auto_augment: per-sample policy after crop and flip: trivialaugment, randaugment, autoaugment, or null.
        random_erasing: probability of erasing a random rectangle (filled with the mean colour), 0 = off.
        pinned_budget_gib, shm_budget_gib, host_budget_gib: memory this training process's loaders may
            hold (GiB): page-locked batches, shared-memory batch buffers, and both plus a dataset held in
            RAM. Batches in flight (then workers) are sized to fit; the plan is printed at start-up
            (datamodules/budget/memory.py). Per process: a node with 8 GPUs holds 8 times as much.
        decode: where JPEGs are decoded and cropped. cpu: in the loader workers (libjpeg-turbo). gpu: workers
            only read the bytes and draw the crops; the training device decodes each batch in one call
            (nvJPEG on a GPU) and crops it (datamodules/sample/device_decode.py); files it cannot take are
            decoded in the workers. cpu is the default until the offline GPU check has timed gpu on a GPU
            (docs/data.md, "Which decode").
        cpu_decode_share: with decode gpu, the share of the files the device could decode that the workers
            decode instead: 0 (the default) leaves every such file to the device; null balances it after every
            batch so that neither the workers nor the device wait (datamodules/sample/balance.py; on an H200 with
            16 CPUs it did not beat 0: docs/data.md, "Which decode").
        worker_start: how loader workers start (datamodules/processes/start.py). forkserver: forked from a
            single-threaded server that imported torch once; each worker unpickles its dataset. fork: forked
            from the training process (on Python 3.10/3.11 it can hang a worker: a start-up warning says
            how). spawn: a fresh interpreter per worker. Never the interpreter's default, which Python 3.14
            changed to forkserver.
        max_image_pixels: an image above this many pixels (by its header) is named in a warning at start-up, one
            above twice it is refused as an unreadable file is; every decoder keeps to it (Pillow's limits by
            default; null: no limit; datamodules/sample/pixel_limit.py).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        builtin: str = "small",
        batch_size: int = 256,
        num_workers: int | Literal["auto"] = "auto",
        image_size: int = 224,
        val_image_size: int | None = None,
        val_crop_ratio: float = 0.875,
        min_scale: float = 0.25,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        skip_invalid: bool = False,
        predict_dir: str | None = None,
        auto_augment: str | None = None,
        random_erasing: float = 0.0,
        pinned_budget_gib: float = DEFAULT_BUDGET_GIB["pinned"],
        shm_budget_gib: float = DEFAULT_BUDGET_GIB["shm"],
        host_budget_gib: float = DEFAULT_BUDGET_GIB["host"],
        decode: Literal["cpu", "gpu"] = "cpu",
        cpu_decode_share: float | None = 0.0,
        worker_start: WorkerStart = DEFAULT_START,
        max_image_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise DataError(f"data.batch_size must be >= 1, got {batch_size}.")
        if num_workers != "auto" and (not isinstance(num_workers, int) or num_workers < 0):
            raise DataError(f'data.num_workers must be "auto" or an integer >= 0, got {num_workers!r}.')
        if decode not in ("cpu", "gpu"):
            raise DataError(f'data.decode must be "cpu" or "gpu", got {decode!r}.')
        if (cpu_decode_share != 0 and decode != "gpu") or (cpu_decode_share is not None
                                                            and not 0 <= cpu_decode_share <= 1):
            raise DataError(f"data.cpu_decode_share is the workers' share under --data.decode gpu: null (balanced) or "
                            f"a number in [0, 1], with decode gpu; got {cpu_decode_share!r} with decode {decode}.")
        if decode == "gpu" and (auto_augment is not None or random_erasing > 0):
            raise DataError(
                "data.decode gpu crops on the device, where the per-sample data.auto_augment and "
                "data.random_erasing do not run. Use --data.decode cpu with them, or leave them off.")
        check_start(worker_start)
        use_in_pillow(max_image_pixels)
        if not 0 < min_scale <= 1:
            raise DataError(f"data.min_scale must be in (0, 1], got {min_scale}.")
        for name, value in (("pinned", pinned_budget_gib), ("shm", shm_budget_gib), ("host", host_budget_gib)):
            if not value > 0:
                raise DataError(f"data.{name}_budget_gib must be > 0 GiB, got {value}.")
        self.scheduled_train_sizes: list[int] = []  # every train size a schedule will use (ProgressiveResizing)
        self._plan_shown = False
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.image_size = image_size
        self.val_image_size = val_image_size or image_size
        self.val_crop_ratio = val_crop_ratio
        self.min_scale = min_scale
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.skip_invalid = skip_invalid
        self.builtin = builtin
        # The train crop size lives in shared memory: persistent (forked or spawned) DataLoader workers
        # read it once per batch, so set_train_size reaches them between epochs.
        self._train_size = torch.tensor([image_size], dtype=torch.int64).share_memory_()
        self.auto_augment = auto_augment
        self.random_erasing = random_erasing
        self.decode = decode
        self.cpu_decode_share = cpu_decode_share
        self.worker_start = worker_start
        self.max_image_pixels = max_image_pixels
        self.device_decoders: dict[str, DeviceDecode] = {}  # per split, when batches are decoded on the device
        self._said_cpu_decode = False  # the start-up warning of --data.decode gpu without CUDA, once
        # per-sample hook after crop+flip (may be replaced before setup())
        self.train_augment: Augment | None = make_train_augment(auto_augment, random_erasing)
        # Read now (cheaply, and before any process group starts) so a bad layout fails
        # at once and num_classes can be linked to the model.
        self.predict_dir = predict_dir
        self.classes = [] if predict_dir is not None and data_dir is None else self.discover_classes()
        self.indexes: dict[str, Index] = {}
        self.datasets: dict[str, Dataset] = {}

    # -- what a backend may override -------------------------------------------------------
    def discover_classes(self) -> list[str]:
        self.root = resolve_data_dir(self.data_dir, self.builtin)
        return find_classes(self.root)

    def load_indexes(self) -> dict[str, Index]:
        return load_indexes(self.root, max_pixels=self.max_image_pixels)

    def make_dataset(self, split: str, index: Index) -> Dataset:
        raise NotImplementedError

    def sample_dataset(self, split: str, source: Source, labels: list[int]) -> SampleDataset:
        """The shared sample path over `source`: train = random crop + flip (+ train_augment), else val crop.
        With device decode the workers pack encoded batches instead (datamodules/sample/encoded.py)."""
        kind = EncodedDataset if self.decodes_on_device else SampleDataset
        if split == "train":
            return kind(source, labels, TrainCrop(self.min_scale, self.train_augment), self._train_size)
        return kind(source, labels, ValCrop(self.val_crop_ratio), self.val_image_size)

    @property
    def device(self) -> torch.device:
        """The training device of this process (CUDA's when no trainer is attached and one is available)."""
        trainer = self.trainer
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def decodes_on_device(self) -> bool:
        """Whether the workers pack encoded batches for the training device to decode (--data.decode gpu)."""
        return self.decode == "gpu"

    @property
    def train_size(self) -> int:
        """The train crop size in force (image_size unless progressive resizing changed it)."""
        return int(self._train_size[0])

    def set_train_size(self, size: int) -> None:
        """Change the train crop size from the next batch a worker starts (call at an epoch's start).

        Batches already prefetched keep the old size; a batch never mixes sizes. Workers drop their ring
        buffers of the old size as they are given back (sample/batches.py), and the pinned blocks cached
        for the old size are freed here.
        """
        if size < 1:
            raise DataError(f"train size must be >= 1, got {size}.")
        changed = int(size) != self.train_size
        self._train_size[0] = int(size)
        if changed:
            release_cached_pinned_memory()

    # -- shared behaviour -----------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def world_size(self) -> int:
        trainer = self.trainer
        return trainer.world_size if trainer is not None else 1

    @property
    def per_process_batch_size(self) -> int:
        world = self.world_size
        if self.batch_size < world:
            raise DataError(
                f"data.batch_size {self.batch_size} is the GLOBAL batch size and must be at least "
                f"the number of processes ({world})."
            )
        if self.batch_size % world and getattr(self, "_uneven_said", None) != world:
            self._uneven_said = world  # once: the loaders and the sizing each ask, every epoch
            rank_zero_warn(f"--data.batch_size {self.batch_size} is not divisible by the {world} processes: each uses "
                           f"{self.batch_size // world}, a global batch of {self.batch_size // world * world}. Pass a "
                           f"multiple of {world}.")
        return self.batch_size // world

    def setup(self, stage: str | None = None) -> None:
        if self.indexes or (stage == "predict" and self.predict_dir is not None):
            return
        self.start_worker_server()
        indexes = self.load_indexes()
        for split, index in indexes.items():
            warn_large_files(index.root, split, index.large_files, self.max_image_pixels)
            if index.bad_files:
                if not self.skip_invalid:
                    index.raise_if_bad()
                warnings.warn(
                    f"skipping {len(index.bad_files)} unreadable file(s) in {split}/, e.g. "
                    f"{index.bad_files[0][0]} ({index.bad_files[0][1]})",
                    stacklevel=2,
                )
            if index.empty_classes:
                warnings.warn(
                    f"{split}/ has empty class folder(s) {index.empty_classes}: they keep their labels.",
                    stacklevel=2,
                )
        self.indexes = indexes
        self.datasets = {split: self.make_dataset(split, index) for split, index in indexes.items()}

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def train_batches(self) -> int:
        """Batches per epoch on this process (lightning_app/lr_schedule.py counts the LR schedule from it): the
        DistributedSampler's drop_last share, then whole batches (DALI's train loader counts the same)."""
        return (len(self.indexes["train"]) // self.world_size) // self.per_process_batch_size

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def predict_dataloader(self) -> DataLoader:
        if self.predict_dir is None:
            return self._loader("val", train=False)
        from datamodules.predict import PredictDataset  # Lightning adds a DistributedSampler under DDP

        dataset = PredictDataset(self.predict_dir, self.val_image_size, self.val_crop_ratio)
        workers = self.workers()
        return DataLoader(dataset, batch_size=self.per_process_batch_size, num_workers=workers,
                          pin_memory=self.pins_memory, worker_init_fn=WorkerInit(),
                          **self.loader_start(workers))

    def on_after_batch_transfer(self, batch, dataloader_idx: int):  # uint8 from every backend but DALI `mixed`
        images, labels = batch[0], batch[1]
        return normalize(images), labels

