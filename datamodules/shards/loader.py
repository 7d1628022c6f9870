"""Streaming a pack through the shared sample path: LitData reads the items, the worker builds the batch.

`ShardDataset` is LitData's StreamingDataset over one split (it shards chunks across ranks and
workers and downloads them ahead into the cache). Its items, (encoded bytes, label, path, index),
never leave the DataLoader worker: a raw `bytes` field comes back from LitData as a memoryview into
the chunk (litdata/streaming/item_loader.py, _slice_item_bytes), which a worker cannot pickle.
`ShardBatches`, the loader's collate_fn, runs in the worker: it hands those bytes to the same
`SampleDataset` every backend uses (decode -> crop/flip -> one uint8 batch in a ring buffer), so
the pixels equal ImageFolder's. A batch is (images, labels, indices into the split's Index).

`ShardLoader` is LitData's StreamingDataLoader: it counts the samples it has yielded, and its
`state_dict` (litdata/streaming/dataloader.py) goes into Lightning's checkpoint (the fit loop saves
the state of every loader that has state_dict/load_state_dict: pytorch_lightning/loops/fit_loop.py,
on_save_checkpoint). On resume, `load_state_dict` makes every worker replay its share up to that
count and continue (litdata/streaming/dataset.py, _resume and _replay_sampling), so each sample of
the epoch comes exactly once across both runs.
"""
from __future__ import annotations

import copy
import math
import os
import re
import time
from collections.abc import Callable, Sequence

import torch
from litdata import StreamingDataLoader, StreamingDataset
from litdata.utilities.env import _DistributedEnv

from datamodules.errors import DataError
from datamodules.sample.batches import RingBatch, give_back
from datamodules.sample.dataset import SampleDataset
from datamodules.sample.encoded import EncodedDataset
from datamodules.sample.loader_plan import NO_LOADER, LoaderPlan
from datamodules.shards.downloader import register_downloader
from datamodules.shards.errors import as_data_error, corrupt_chunk, worker_died
from datamodules.shards.prefetch import quiet_explained_crashes
from datamodules.shards.topology import told


def _our_litdata_parts() -> None:
    """Our S3 downloader, and LitData's crash report left to our paragraph: in this process and, after
    unpickling, in every DataLoader worker (a spawned worker starts with litdata's own)."""
    register_downloader()
    quiet_explained_crashes()


class ShardDataset(StreamingDataset):
    """One split of a pack. `batch_aligned=False` (validation) deals samples to ranks and workers one by
    one, so under DDP every rank gets the same count and at most world_size - 1 samples are left out.

    ranks: (world size, global rank, nodes) as the trainer knows them. LitData guesses the node count as
    world size // torch.cuda.device_count(), and 1 without CUDA (litdata/utilities/env.py,
    _DistributedEnv.detect): wrong for a job using some of a node's GPUs, and for every CPU job on several
    nodes, and an error for some layouts (topology.py). It groups ranks into nodes by that count to keep later
    epochs on each node's chunks (streaming/shuffle.py, FullShuffle) and to count a chunk's readers on a node
    (streaming/dataset.py, __iter__), so its detection is told the trainer's numbers wherever it runs for this
    dataset and its loader: the constructor, the cache and reader, the worker iterator, load_state_dict.
    """

    def __init__(self, url: str, *, batch_aligned: bool = True, endpoint: str | None = None,
                 ranks: tuple[int, int, int] | None = None, **kwargs) -> None:
        _our_litdata_parts()
        self.url, self.endpoint, self.batch_aligned = url, endpoint, batch_aligned
        # distributed_env, read by __iter__, get_len and state_dict, in this process and (pickled) in workers
        with told(_DistributedEnv(*ranks) if ranks is not None else None):
            super().__init__(url, **kwargs)

    def _create_cache(self, worker_env):
        # The Cache and its reader detect their own (litdata/streaming/cache.py, reader.py BinaryReader); the
        # reader's node count decides whether chunks are deleted once read (PrepareChunksThread).
        with told(self.distributed_env):
            return super()._create_cache(worker_env)

    def __setstate__(self, state: dict) -> None:
        _our_litdata_parts()
        self.__dict__.update(state)

    def set_batch_size(self, batch_size: int) -> None:
        # LitData gives every worker a whole number of batches of this size (utilities/shuffle.py,
        # _associate_chunks_and_intervals_to_workers); 1 deals single samples.
        super().set_batch_size(batch_size if self.batch_aligned else 1)

    def __next__(self):
        try:
            return super().__next__()
        except StopIteration:
            raise
        except Exception as e:  # named here, in the worker: the user reads one paragraph
            raise self.explain(e) from e

    def explain(self, error: Exception) -> Exception:
        try:
            cache = self.cache._reader._config._cache_dir
        except AttributeError:  # no chunk read yet
            cache = None
        known = as_data_error(error, self.url, endpoint=self.endpoint, cache_dir=cache)
        if known is not error:
            return known
        pack, split = self.url.rsplit("/", 1)
        # a chunk downloaded ahead fails while the worker waits for another: name the one that failed
        named = re.search(r"ChunkSizeError: \S*/(chunk-[^/\s]+\.bin) (.*)", str(error))
        if named:
            return corrupt_chunk(pack, f"{split}/{named.group(1)}", named.group(2))
        chunk = self.current_chunk()
        return corrupt_chunk(pack, f"{split}/{chunk}", f"{type(error).__name__}: {error}") if chunk else error

    def current_chunk(self) -> str | None:
        try:
            k = self.worker_chunks[self.worker_next_chunk_index - 1]
            return self.cache._reader.config._chunks[k]["filename"]
        except Exception:  # noqa: BLE001 - no chunk opened yet
            return None


class ItemSource:
    """The encoded bytes of one batch's items (a `sample.Source`)."""

    def __init__(self, data: Sequence, paths: Sequence[str], url: str) -> None:
        self.data, self.paths, self.url = data, paths, url

    def read(self, i: int):
        return self.data[i]

    def describe(self, i: int, error: Exception) -> str:
        return (f"cannot decode {self.paths[i]} from the pack {self.url}: {error}. The chunk holding it is damaged: "
                "pack the data again (python -m datamodules.shards), or delete the chunk cache if only it is.")


class ShardBatches:
    """The collate_fn: [(bytes, label, path, index)] -> (uint8 images, labels, indices), built in the worker.

    with_paths (predict): (uint8 images, indices, paths) instead, as a plain tuple (RingBatch pins only tensors).
    `plan`: its loader's (sample/loader_plan.py); with an `overflow` in it (--data.decode gpu) each batch is an
    EncodedBatch whose ids are the pack's sample ids.
    """

    def __init__(self, crop: Callable, size: int | torch.Tensor, url: str, plan: LoaderPlan = NO_LOADER,
                 with_paths: bool = False) -> None:
        self.crop, self.size, self.url, self.plan = crop, size, url, plan
        self.with_paths = with_paths

    @property
    def encoded(self) -> bool:
        return self.plan.overflow is not None

    def describe(self, i: int, error: Exception) -> str:
        """A sample the device could not decode, by its id in the pack (the main process has no paths)."""
        return ItemSource((), [f"sample {i}"], self.url).describe(0, error)

    def __call__(self, items: list[tuple]) -> tuple:
        data, labels, paths, indices = zip(*items, strict=False)
        if self.encoded:
            packed = EncodedDataset(ItemSource(data, paths, self.url), labels, self.crop, self.size, self.plan)
            return packed.__getitems__(range(len(items)))._replace(ids=torch.tensor(indices, dtype=torch.int64))
        samples = SampleDataset(ItemSource(data, paths, self.url), labels, self.crop, self.size, self.plan)
        images, labels = samples.__getitems__(range(len(items)))
        indices = torch.tensor(indices, dtype=torch.int64)
        if self.with_paths:
            return images, indices, list(paths)
        batch = (images, labels, indices)
        return RingBatch(batch) if isinstance(images, torch.Tensor) and torch.utils.data.get_worker_info() else batch


class ShardLoader(StreamingDataLoader):
    """LitData's stateful loader: ring buffers given back as batches arrive, failures as one paragraph."""

    def __iter__(self):
        yield from self._batches()

    def _get_iterator(self):
        with told(self.dataset.distributed_env):  # a worker iterator detects (litdata/streaming/dataloader.py)
            return super()._get_iterator()

    def load_state_dict(self, obj: dict) -> None:
        with told(self.dataset.distributed_env):
            super().load_state_dict(obj)

    def loader_state(self) -> dict:
        """LitData's state as of the batches this loader has yielded (a copy: LitData updates its own)."""
        return copy.deepcopy(super().state_dict())

    def state_dict_from(self, state: dict) -> dict:
        """The checkpoint's state from a `loader_state` (a reader ahead of the consumer keeps the one as of the
        batches it handed on): itself."""
        return state

    def _batches(self):
        try:
            for batch in super().__iter__():
                yield give_back(batch) if isinstance(batch, RingBatch) else batch
        except DataError:
            raise
        except Exception as e:  # a worker that died, an error in this process
            try:
                dead = self._dead_workers()
            except RuntimeError as died:  # torch's SIGCHLD handler, fired before _dead_workers' own guard
                dead = str(died).strip().rstrip(".")
            if dead:  # its pipe may break before torch has noticed the death: say what happened, not how it showed
                raise DataError(worker_died(self.dataset.url, dead)) from e
            known = self.dataset.explain(e)
            if known is e:
                raise
            raise known from e

    def _dead_workers(self) -> str:
        """Which of this loader's persistent workers died ("" if none, or none known)."""
        workers = getattr(getattr(self, "_iterator", None), "_workers", None) or []
        deadline = time.monotonic() + 1.0  # a worker killed a moment ago may still look alive
        try:
            while True:
                dead = [str(w.pid) for w in workers if not w.is_alive()]
                if dead or not workers or time.monotonic() > deadline:
                    return f"DataLoader worker (pid {', '.join(dead)}) is gone" if dead else ""
                time.sleep(0.05)
        except RuntimeError as e:  # torch's SIGCHLD handler names it (torch/utils/data/_utils/signal_handling.py)
            return str(e).strip().rstrip(".")

    def __len__(self) -> int:
        dataset: ShardDataset = self.dataset
        if dataset.batch_aligned:
            return super().__len__()
        # Samples dealt one by one: each worker ends with its own partial batch.
        dataset.get_len(self.num_workers, self.batch_size)  # makes the shuffler (litdata's __len__ does too)
        workers = max(1, self.num_workers)
        env = dataset.distributed_env
        _, intervals = dataset.shuffler.get_chunks_and_intervals_per_workers(env, workers, 1, dataset.current_epoch)
        mine = intervals[env.global_rank * workers:(env.global_rank + 1) * workers]
        return sum(math.ceil(sum(i[2] - i[1] for i in worker) / self.batch_size) for worker in mine)


class PredictShardDataset(ShardDataset):
    """A split to predict: every sample once over all ranks (drop_last off), in the pack's order. Rows of
    predictions.csv (lightning_app/callbacks/predictions.py) take the index from the batch and the path from
    `display_path`."""

    items_carry_index = True

    def __init__(self, url: str, *, source_root: str, total_items: int, **kwargs) -> None:
        super().__init__(url, shuffle=False, drop_last=False, batch_aligned=False, **kwargs)
        self.source_root = source_root
        self.total_items = total_items  # on all ranks (len() is this rank's share)
        self.paths: dict[int, str] = {}  # index -> path in the packed tree, filled as batches arrive

    def display_path(self, i: int) -> str:
        """The image's path in the tree the pack was made from (the path ImageFolder's Index gives)."""
        return os.path.join(self.source_root, self.paths[i])


class PredictShardLoader(ShardLoader):
    """(images, indices) batches of a PredictShardDataset, whose paths it records as they pass."""

    def __iter__(self):
        for images, indices, paths in super().__iter__():
            self.dataset.paths.update(zip(indices.tolist(), paths, strict=False))
            yield give_back((images, indices))  # a worker's ring buffer (unless pinned): reused once freed
