"""DALI's side of a loader: how many threads and how much memory a pipeline takes, and the
re-iterable loader that Lightning iterates.

Threads and memory: `dali_threads` sizes each pipeline's threads from this process's share of
the CPU affinity mask (SLURM's and containers' cpusets, not `os.cpu_count()`), capped for `mixed`,
where nvJPEG preallocates buffers per thread (`dali_memory_bill`).

Epoch boundaries: DALI ignores a reset asked for mid-epoch, and Lightning's sanity check,
`limit_*_batches`, `fast_dev_run` and a mid-epoch resume all stop iterating mid-epoch. The
loader therefore rebuilds its pipeline when an epoch was left unfinished, so each
`iter(loader)` starts a fresh epoch (with the shard and seed that epoch would have had).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from datamodules.budget.cpus import cpus_per_process
from datamodules.budget.memory import CONSUMER_BATCHES, WORKER_OWN_BYTES, Budget, MemoryPlan, pinned_block_bytes
from datamodules.errors import DataError
from datamodules.sample.batches import batch_layout, fill_batch, new_batch
from datamodules.sample.crop import ValCrop, resize

# nvJPEG preallocates, PER DALI THREAD, one device buffer of device_memory_padding and two pinned host
# buffers of host_memory_padding (DALI 2.4 docs of fn.decoders.image, nvidia/dali/ops/decoders/__init__.pyi;
# dali/operators/imgcodec/image_decoder.h). DALI's own defaults: 16 MiB and 8 MiB. 16 MiB holds a decoded
# 5.6-megapixel RGB image, 8 MiB a large encoded JPEG: ImageNet never reallocates, and a rarer giant
# image costs one reallocation, not gigabytes reserved on every thread of every pipeline.
DEVICE_MEMORY_PADDING = 16 << 20
HOST_MEMORY_PADDING = 8 << 20
# With `mixed`, threads only parse and Huffman-decode the share the hardware decoder does not take;
# NVIDIA's ImageNet examples use 4 to 8 per GPU. More threads add preallocated buffers, not speed.
MAX_MIXED_THREADS = 8


def dali_threads(decoder_device: str, processes_per_node: int = 1, usable: int | None = None,
                 requested: int | None = None) -> int:
    """DALI CPU threads for one pipeline of one training process.

    `usable`: CPUs in this process's affinity mask (default: measured, `datamodules.budget.cpus`); the
    process gets its share of them for `processes_per_node` processes. `mixed` is capped at
    MAX_MIXED_THREADS; an explicit `requested` count is taken as given.
    """
    if requested:
        return int(requested)
    if usable is None:
        share = cpus_per_process(processes_per_node)
    else:
        share = max(1, usable // max(1, processes_per_node))
    return min(share, MAX_MIXED_THREADS) if decoder_device == "mixed" else share


def dali_memory_bill(decoder_device: str, threads: int) -> dict[str, int]:
    """Bytes one pipeline preallocates for nvJPEG: {"device": GPU memory, "pinned": page-locked host memory}."""
    if decoder_device != "mixed":
        return {"device": 0, "pinned": 0}
    return {"device": threads * DEVICE_MEMORY_PADDING, "pinned": threads * 2 * HOST_MEMORY_PADDING}


@dataclass(frozen=True)
class DALIPlan:
    """One DALI pipeline's memory (a `datamodules.budget.memory.MemoryPlan` entry).

    pinned: nvJPEG's buffers (`dali_memory_bill`) and, with CPU decoding for a GPU run, the pinned batches
    HostFinish makes (one being finished plus the consumer's two, in blocks of torch's caching host
    allocator). Not counted: DALI's own queue of `queue` decoded batches in pageable host memory (their
    size depends on the images) and, for mixed, its GPU memory (`device`).
    """

    split: str
    batch: int
    size: int
    decoder: str
    threads: int
    queue: int
    pin: bool

    @property
    def batch_bytes(self) -> int:
        return batch_layout(self.batch, self.size)[2]

    @property
    def pinned(self) -> int:
        batches = (1 + CONSUMER_BATCHES) * pinned_block_bytes(self.batch_bytes) if self.pin else 0
        return dali_memory_bill(self.decoder, self.threads)["pinned"] + batches

    @property
    def device(self) -> int:
        return dali_memory_bill(self.decoder, self.threads)["device"]

    shm = 0

    def describe(self) -> str:
        return (f"{self.split}: DALI {self.decoder}, {self.threads} thread{'s' * (self.threads > 1)}, "
                f"{self.queue} batches queued, {self.size} px")


def dali_memory_plan(args, layout, train_sizes=()) -> MemoryPlan:
    """A DALIDataModule's pipelines (`DALIPlan`) for init args `args` on `layout` (datamodules/budget/sizing.py)."""
    device = args.get("dali_device", "auto")
    decoder = "mixed" if device == "gpu" or (device == "auto" and layout.cuda) else "cpu"
    threads = dali_threads(decoder, usable=layout.cpus, requested=args.get("num_threads"))
    image = int(args["image_size"])
    batch = max(1, int(args["batch_size"]) // layout.world)
    pin = decoder == "cpu" and layout.cuda and bool(args.get("pin_memory", True))
    queue = int(args.get("prefetch_queue_depth", 2))
    sizes = [("train", max([image, *train_sizes]))] if layout.fit else []
    pipelines = [DALIPlan(split, batch, size, decoder, threads, queue, pin)
                 for split, size in [*sizes, ("val", int(args.get("val_image_size") or image))]]
    # an LMDB source reads in DALI's external-source workers, spawned: each its own interpreter (datamodule.py)
    spawned = 0
    if args.get("source") == "lmdb":
        spawned = layout.cpus if args.get("num_workers", "auto") == "auto" else max(1, int(args["num_workers"]))
    return MemoryPlan(pipelines, Budget.of(args), helpers=spawned * WORKER_OWN_BYTES["spawn"])


class HostFinish:
    """DALI's CPU-decoded images (HWC uint8, each its own size) -> one uint8 (N, 3, S, S) channels-last batch.

    The shared sample path's resize (datamodules/sample/crop.py): train resizes DALI's random crop to
    S x S and flips it where DALI's coin says so; val resizes the shorter side and takes the centre
    crop (`ValCrop`). Runs on `threads` threads (the resize releases the GIL) while DALI's own threads
    decode the next batch. `size()` is read per batch (progressive resizing rebuilds the pipeline).
    """

    def __init__(self, train: bool, size: Callable[[], int], crop_ratio: float, threads: int, pin: bool) -> None:
        self.train, self.size, self.pin = train, size, pin
        self.val_crop = ValCrop(crop_ratio)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, images: list[torch.Tensor], mirror: torch.Tensor | None) -> torch.Tensor:
        size = self.size()
        flips = mirror.view(-1).tolist() if mirror is not None else [0] * len(images)

        def sample(k: int) -> torch.Tensor:
            image = images[k].permute(2, 0, 1)  # CHW view of HWC: channels-last, what resize wants
            if not self.train:
                return self.val_crop(image, size)
            out = resize(image, size, size)
            return out.flip(-1) if flips[k] else out

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dali-resize")
        return fill_batch(new_batch(len(images), size, pin=self.pin), sample, self._pool)


class DALILoader:
    """One split's DALI iterator as a re-iterable loader of (images, labels).

    `build(epoch)` makes a fresh DALI iterator whose first epoch is `epoch`. The loader
    resets it after a finished epoch and rebuilds it after an unfinished one.
    `last_indices` holds the Index positions of the latest batch (the samples' identity).
    """

    def __init__(self, build: Callable[[int], Any], steps: int, label_table: torch.Tensor | None,
                 last_batch_sizes: dict[int, int] | None = None, pin: bool = False,
                 finish: HostFinish | None = None) -> None:
        self._build = build
        self._pin = pin
        self._finish = finish
        self._steps = steps
        self._labels = label_table
        self._trim = last_batch_sizes or {}
        self._it = None
        self._epoch = 0  # epochs started
        self._finished = True
        self.last_indices: torch.Tensor | None = None
        self.rebuilds = 0

    def __len__(self) -> int:
        return self._steps

    def prepare(self) -> None:
        """Build the pipeline of the next epoch now (e.g. before a clock starts); `iter()` then uses it."""
        if self._it is None:
            self._it = self._build(self._epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._it is None or not self._finished:
            if self._it is not None:
                self.rebuilds += 1
            self.close()
            self._it = self._build(self._epoch)
        self._finished = False
        self._epoch += 1
        return self._generate(self._it)

    def _generate(self, it) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while step < self._steps:
            try:
                data = next(it)[0]
            except StopIteration:
                break
            except RuntimeError as e:
                raise DataError(
                    f"DALI failed to read or decode a sample: {e}\nThe cheap file checks passed, so a file is "
                    "corrupt beyond its header/end marker: find it with the ImageFolder backend "
                    "(--data datamodules.ImageFolderDataModule names the file), then fix or delete it."
                ) from e
            # DALI emits HWC: the NCHW view of it is channels-last memory (no copy here or in the model).
            images, index = data["images"], data["index"].view(-1).long()
            if isinstance(images, list):  # one tensor per sample, at its decoded size
                images = self._finish(images, data.get("mirror"))
            else:
                if self._pin and not images.is_cuda and not images.is_pinned():
                    images = images.pin_memory()  # DALI's iterator returns pageable CPU tensors
                images = images.permute(0, 3, 1, 2)
            labels = data["label"].view(-1).long() if "label" in data else self._labels[index.cpu()]
            keep = self._trim.get(step)
            if keep is not None:
                images, index, labels = images[:keep], index[:keep], labels[:keep]
            self.last_indices = index.cpu()
            step += 1
            if step == self._steps:
                # The epoch ends with this batch: reset now, not after the consumer asks for one more
                # (a consumer that stops at exactly `steps` batches, like `--max-batches`, never asks).
                # DROP stops with an incomplete batch still in the pipeline: DALI's reset drains it. The
                # batch stays valid: with DALI 2.4's default (dynamic) executor the iterator hands each
                # output over by DLPack, owned by its tensor; with the older executors it copies
                # (DALIGenericIterator._get_outputs, nvidia/dali/plugin/pytorch/__init__.py).
                self._end_epoch(it)
            yield images, labels
        if not self._finished:
            self._end_epoch(it)  # DALI's own epoch ended first (StopIteration)

    def _end_epoch(self, it) -> None:
        it.reset()
        self._finished = True

    def close(self) -> None:
        self._it = None
