"""The one sample path of the ImageFolder, LMDB and Downscaled backends: source -> decode -> crop -> batch.

A backend only says where a sample's encoded bytes come from (a `Source`); decoding
(`decode.decode`), crop and flip (`crop.TrainCrop` / `crop.ValCrop`) and batching are shared.

A DataLoader calls `SampleDataset.__getitems__(indices)` once per batch (torch/utils/data/_utils/
fetch.py, _MapDatasetFetcher). It writes every sample straight into one preallocated uint8
batch tensor (the resize writes an unflipped sample into its slot itself: crop.py), in shared memory when
it runs in a worker (a reused ring buffer: batches.py), and
the loader's `collate_fn` is `built_batch`, which returns it as it is.

Threads: file reads wait on the disk with the GIL released, so a small pool always reads a
batch's files ahead of its decoding (a cold cache would otherwise leave the CPU idle). Decoding
and the resize release the GIL too (decode.py says where), so with CPUs to spare (no workers, or
fewer workers than CPUs: the plan's `decode_threads` > 1) whole samples run side by side on the pool. With
one CPU per worker (`num_workers: auto`) the worker decodes in its own thread, one sample after
another from the front of the batch: threads taking turns on one CPU cost context switches and
evict each other's cache. One more
thread at the lowest priority (`idle_helper`) takes samples from the back of the batch: the kernel
runs it only on a CPU with nothing else to run, such as the one a worker leaves idle while its
peer builds the last batch of an epoch. A batch never waits for it (`_fill_here`).

Random crops are drawn from one `random.Random` per sample, seeded from torch's generator in the
calling thread, so a seeded run gives the same crops whatever order the threads finish in.
"""
from __future__ import annotations

import os
import pickle
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch
from torch.utils.data import Dataset, get_worker_info

from datamodules.errors import DataError
from datamodules.index import Index, IndexPaths
from datamodules.sample.batches import RingBatch, fill_batch, new_batch, warm_ring
from datamodules.sample.crop import TrainCrop, ValCrop
from datamodules.sample.decode import decode, pil_decode
from datamodules.sample.loader_plan import NO_LOADER, SAMPLE_THREADS, LoaderPlan
from datamodules.sample.region import RegionCounts, decode_box

Encoded = bytes | bytearray | memoryview | torch.Tensor


class Source(Protocol):
    """Where the encoded bytes of sample i come from."""

    def read(self, i: int) -> bytes | bytearray | memoryview: ...

    def describe(self, i: int, error: Exception) -> str:
        """The error message for an unusable sample: names it and says how to fix it."""


class FileSource:
    """One file per sample: the paths of an Index (or a list of paths); `fix` ends an error message."""

    def __init__(self, index: Index | Sequence[str], fix: str) -> None:
        self.paths = IndexPaths(index) if isinstance(index, Index) else list(index)
        self.fix = fix

    def read(self, i: int) -> bytearray:
        with open(self.paths[i], "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(data)
        return data if n == len(data) else data[:n]

    def describe(self, i: int, error: Exception) -> str:
        return f"cannot decode image {self.paths[i]}: {error}. {self.fix}"


_pool: tuple[int, ThreadPoolExecutor] | None = None


def sample_pool() -> ThreadPoolExecutor:
    """This process's sample threads (made after any fork: a pool never crosses one)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(SAMPLE_THREADS, thread_name_prefix="sample"))
    return _pool[1]


_helper: tuple[int, ThreadPoolExecutor] | None = None


def _lowest_priority() -> None:
    # SCHED_IDLE for this thread only ("very low priority background jobs", sched(7); pid 0 is the
    # calling thread, sched_setscheduler(2)): it runs when a CPU has nothing else to run. Elsewhere, or
    # where a sandbox refuses it, the helper keeps normal priority (an exception here would break the
    # pool, and with it every batch).
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def idle_helper() -> ThreadPoolExecutor:
    """This process's one lowest-priority thread (made after any fork), for CPU time no one else wants."""
    global _helper
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="idle", initializer=_lowest_priority))
    return _helper[1]


def read_ahead(source: Source, indices: Sequence[int], pool: ThreadPoolExecutor,
               groups: int = SAMPLE_THREADS) -> Iterator[Encoded | Exception]:
    """The encoded bytes of `indices` in order (or the read's exception), read on `pool` ahead of the caller.

    One task per contiguous group of samples, so a batch wakes the pool a few times, not once per sample.
    """
    def read(group: Sequence[int]) -> list[Encoded | Exception]:
        out: list[Encoded | Exception] = []
        for i in group:
            try:
                out.append(source.read(i))
            except Exception as e:  # noqa: BLE001 - re-raised, named, by SampleDataset.sample
                out.append(e)
        return out

    step = -(-len(indices) // groups)
    tasks = [pool.submit(read, indices[j:j + step]) for j in range(0, len(indices), step)]
    for task in tasks:
        yield from task.result()


def _hand_over(built: dict[int, torch.Tensor], k: int, sample: torch.Tensor) -> None:
    """The idle helper hands sample k over, built (a function of its own: a test stalls the helper in it)."""
    built[k] = sample


class SampleDataset(Dataset):
    """Samples of `source`, decoded, cropped to `size()` and written a whole batch at a time.

    `size` is read once per batch (a batch never mixes sizes); `crop` is `TrainCrop` or `ValCrop`. `plan`: what
    its loader decided (sample/loader_plan.py), fixed when the dataset is built: a DataModule's loader builds its
    own with `planned`, and never writes into a dataset. `counts`: the region decode's counts, shared with the
    dataset it was planned from (made here for a TrainCrop when None).
    """

    def __init__(self, source: Source, labels: Sequence[int] | torch.Tensor, crop: Callable, size: int | torch.Tensor,
                 plan: LoaderPlan = NO_LOADER, counts: RegionCounts | None = None) -> None:
        self.source = source
        self.labels = torch.as_tensor(labels if isinstance(labels, torch.Tensor) else list(labels), dtype=torch.int64)
        self.crop = crop
        self._size = size
        self.plan = plan
        self.decode_counts = counts if counts is not None or not isinstance(crop, TrainCrop) else RegionCounts()

    def planned(self, plan: LoaderPlan) -> SampleDataset:
        """The same samples under `plan`, for one loader: a new dataset (of this class) sharing this one's source,
        labels, crop, size and counts; this one is left as it was."""
        return type(self)(self.source, self.labels, self.crop, self._size, plan, self.decode_counts)

    @property
    def decode_threads(self) -> int:
        return self.plan.decode_threads

    @property
    def ring_slots(self) -> int:
        return self.plan.ring_slots

    @property
    def region_decode(self) -> bool:
        return self.plan.region_decode

    def __len__(self) -> int:
        return len(self.labels)

    def size(self) -> int:
        return int(self._size[0]) if isinstance(self._size, torch.Tensor) else int(self._size)

    def sample(self, i: int, size: int, rng: random.Random | None = None,
               data: Encoded | Exception | None = None, tally: dict[int, bool] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Sample i as a uint8 CHW tensor of size x size; `data`: its bytes (or read error) if already read;
        `tally`: its batch's region count (region.RegionCounts); `out`: its slot in the batch, written and returned
        (the resize writes it directly: crop.py)."""
        rng = rng or random.Random(int(torch.randint(2**62, ())))
        try:
            if isinstance(data, Exception):
                raise data
            data = self.source.read(i) if data is None else data
            box = None
            if self.decode_counts is not None:  # a TrainCrop: the box first, then only its region (region.py)
                box = decode_box(data, self.crop, size, rng) if self.region_decode else None
                self.decode_counts.count(i, box is not None and box.by_region, tally)
            image = decode(data) if box is None else box.pixels
        except Exception as e:
            raise DataError(self.source.describe(i, e)) from e
        if box is not None:
            return self.crop.cut(image, box.plan, rng, box.origin, out=out)
        if out is None or not isinstance(self.crop, (TrainCrop, ValCrop)):
            sample = self.crop(image, size, rng)
            return sample if out is None else out.copy_(sample)
        return self.crop(image, size, rng, out=out)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.sample(i, self.size()), int(self.labels[i])

    def state_dict(self) -> dict[str, bytes]:
        """In a loader worker: its torch generator, which every crop, flip and augmentation is drawn from (the
        seeds of `__getitems__`). A StatefulDataLoader keeps it with the loader's state (datamodules/resume.py)."""
        return {"torch_rng": torch.get_rng_state().numpy().tobytes()} if get_worker_info() is not None else {}

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        """Puts a worker's generator back; torchdata calls it after the worker's `worker_init_fn` seeded it
        (torchdata/stateful_dataloader/worker.py, `_worker_loop`), so the saved state wins."""
        if get_worker_info() is not None and "torch_rng" in state_dict:
            torch.set_rng_state(torch.frombuffer(bytearray(state_dict["torch_rng"]), dtype=torch.uint8))

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.size()
        images = new_batch(len(indices), size, slots=self.ring_slots)
        seeds = torch.randint(2**62, (len(indices),)).tolist()
        tally = RegionCounts.tally()
        # A failure (a DataError naming the sample) is re-raised here, in this thread.
        if self.decode_threads > 1:
            fill_batch(images, lambda k, slot: self.sample(indices[k], size, random.Random(seeds[k]), None, tally,
                                                           slot), sample_pool(), into=True)
        else:
            self._fill_here(images, indices, size, seeds, tally)
        labels = self.labels[list(indices)]
        if self.decode_counts is not None:
            worker = get_worker_info()
            self.decode_counts.flush(0 if worker is None else worker.id + 1, tally)
        return RingBatch((images, labels)) if get_worker_info() is not None else (images, labels)

    def warm_up(self) -> None:
        """Decode, crop and batch a small synthetic JPEG in this process, as a worker does a batch of this dataset.

        Reads nothing from the source and starts no thread (a training process runs it before its loader
        forks, datamodules/processes/forksafe.py). Both decoders; seeds 0-3 give crops with and without a flip; two
        sizes, down- and upsampling. An `augment` runs only the operations these seeds draw.
        """
        jpeg = _tiny_jpeg()
        slots = {size: new_batch(1, size)[0] for size in (8, 64)}  # the resize's out= path (crop.py) has its own
        for image in (decode(jpeg), pil_decode(jpeg)):             # first uses
            for seed in range(4):
                for size in (8, 64):
                    self.crop(image, size, random.Random(seed))
                    if isinstance(self.crop, (TrainCrop, ValCrop)):
                        self.crop(image, size, random.Random(seed), out=slots[size])
            image[:, 0:image.shape[1], 0:image.shape[2]]  # a crop of the whole image: an alias (THPVariable_getitem)
        if self.decode_counts is not None and self.region_decode:  # a TrainCrop: the region decoder's build or
            decode_box(jpeg, self.crop, 8, random.Random(0))  # import (a C++ library's static destructors), first use
        torch.randint(2**62, (1,)).tolist()
        pickle.dumps(RingBatch((slots[8][None], self.labels[[]])))  # a batch sent: its labels by value (numpy)
        warm_ring(self.crop(decode(jpeg), self.size(), random.Random(0)))

    def _fill_here(self, images: torch.Tensor, indices: Sequence[int], size: int, seeds: list[int],
                   tally: dict[int, bool]) -> None:
        """Decode the batch in this thread from the front, files read ahead; `idle_helper` works from the back.

        The helper takes no lock and never writes into the batch: it takes samples off the back of a
        deque (whose pops from either end are thread-safe, collections.deque) and hands each one over
        built, into a dict, for this thread to copy. So this thread never waits on the helper (on a busy
        machine it may not run for a long while, anywhere in its work), and once this returns the helper
        cannot write into the batch (a late hand-over goes into a dict no one reads). This thread builds
        again whatever the helper has taken and not handed over.
        """
        untaken = deque(range(len(indices)))
        built: dict[int, torch.Tensor] = {}

        def from_back() -> None:
            while True:
                try:
                    k = untaken.pop()
                except IndexError:
                    return
                _hand_over(built, k, self.sample(indices[k], size, random.Random(seeds[k]), None, tally))

        idle_helper().submit(from_back)  # its failures are this thread's to raise: it builds them again
        mine = 0  # this thread took samples 0..mine-1, the helper the rest
        try:
            for k, data in enumerate(read_ahead(self.source, indices, sample_pool())):
                try:
                    untaken.popleft()  # k: this thread takes from the front, one at a time
                except IndexError:
                    break
                mine = k + 1
                self.sample(indices[k], size, random.Random(seeds[k]), data, tally, images[k])
        finally:
            untaken.clear()  # from here on the helper takes nothing
        for k in range(mine, len(indices)):
            sample = built.pop(k, None)
            images[k].copy_(sample if sample is not None
                            else self.sample(indices[k], size, random.Random(seeds[k]), None, tally))


def _tiny_jpeg() -> bytearray:
    """A 48 x 40 baseline RGB JPEG (what `decode` sends to libjpeg-turbo), writable as a file read is."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (48, 40), (90, 120, 150)).save(out, "JPEG", quality=90)
    return bytearray(out.getvalue())
