"""The train loader of the map-style backends resumes mid-epoch exactly: same samples, same crops and flips.

Lightning's fit loop saves the `state_dict()` of every train loader that has state_dict/load_state_dict into
the checkpoint (pytorch_lightning/loops/fit_loop.py, `on_save_checkpoint` -> CombinedLoader `_state_dicts`), on
every rank, and on resume hands it back through `load_state_dict` in `setup_data` (`_load_combined_loader_states`),
only when the checkpoint was taken mid-epoch (`restarting`: the epoch had started and not ended) and before it
makes the epoch's iterator. CombinedLoader `_load_state_dicts` (utilities/combined_loader.py) only checks that
the number of stateful loaders matches: a checkpoint of a plain DataLoader holds no state and restarts the epoch.

`ResumableLoader` is torchdata's StatefulDataLoader, whose state holds (torchdata/stateful_dataloader/
stateful_dataloader.py, `_StatefulMultiProcessingDataLoaderIter`): the sampler's position, the workers' base
seed, which worker takes the next batch, and each worker's `dataset.state_dict()` as of the last batch it
delivered (the SampleDataset's: the worker's torch generator, from which every crop and flip is drawn,
datamodules/sample/dataset.py). Restored in that order after the worker's `worker_init_fn` (worker.py,
`_worker_loop`), the resumed batches are those of an uninterrupted run, pixel for pixel.

`EpochSampler` adds the epoch to the sampler's state: the fit loop makes the resumed iterator in `setup_data`
BEFORE it calls `set_epoch` (`on_advance_start`), so a DistributedSampler would shuffle the epoch with
epoch 0's order. Lightning injects no sampler of its own over a DistributedSampler
(trainer/connectors/data_connector.py, `_requires_distributed_sampler`).

With num_workers 0 the crops are drawn in the training process, from its own generator, which no checkpoint
holds: the samples resume exactly, their crops do not.

Under DDP only rank 0 writes the checkpoint, so `state_dict` gathers every rank's state (all ranks save
together: Trainer.save_checkpoint ends in a barrier) and each rank loads its own. A checkpoint from another
number of processes or loader workers cannot place this rank's workers. The loader must still go on from where
the epoch stopped: Lightning restores its batch progress whatever the loader does and ends the epoch when that
count reaches the epoch's batches (training_epoch_loop.py, `_num_ready_batches_reached`), so a loader started
afresh would run the epoch's first batches again and never its last ones (and in epoch 0's order: the sampler
makes the order before the fit loop's set_epoch). So the sampler alone resumes, at the saved epoch and at the
sample all ranks had reached, shared out among this run's ranks; the workers' crops and flips start afresh,
with a warning. (Resetting Lightning's batch progress instead, to run the epoch whole, has no hook between
`_TrainingEpochLoop.reset`, which counts a batch saved at its end as done, and the first batch; and it would add
that many steps to a fit whose LR schedule has a fixed length.)
"""
from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from datamodules.processes import dead_workers
from datamodules.sample.batches import given_back

# How often (in batches) the loader asks its workers for their state. Every batch: a worker's state is its
# torch generator (5 KiB pickled, about 50 us to take, diff and pickle on this repo's 2-core VM) and the main
# process's a few integers, next to a batch that takes a worker hundreds of ms to decode; a longer interval
# saves that little, and makes a resume fetch (decode, crop) and drop up to interval - 1 batches again to
# reach the saved position (stateful_dataloader.py, `_STEPS_SINCE_SNAPSHOT`). Exact either way.
SNAPSHOT_EVERY_N_STEPS = 1


class EpochSampler(StatefulDistributedSampler):
    """DistributedSampler whose state is (epoch, samples handed out this epoch): see the module doc.

    torchdata's own counts its position lazily, in a generator that runs at the first index, so a state
    taken before an epoch's first batch would carry the previous epoch's count; here `__iter__` starts it.
    A position loaded into the sampler holds until an iterator draws its first index: a DataLoader iterator
    calls iter() on its sampler twice, in `_BaseDataLoaderIter.__init__` and in `_reset`
    (torch/utils/data/dataloader.py), and draws from the second.
    """

    def __iter__(self) -> Iterator[int]:
        start = self.next_yielded or 0
        self.yielded = start
        return self._indices(start)

    def _indices(self, start: int) -> Iterator[int]:
        self.next_yielded = None
        for index in itertools.islice(DistributedSampler.__iter__(self), start, None):
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.set_epoch(int(state_dict.get("epoch", self.epoch)))


def _workers_in(state: dict[str, Any]) -> int:
    """The loader workers a StatefulDataLoader state was taken with (a single-process state has no snapshot)."""
    snapshot = state.get("_snapshot")
    return int(snapshot["_main_snapshot"]["_num_workers"]) if snapshot else 0


def _ranks() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableLoader(StatefulDataLoader):
    """The train loader: StatefulDataLoader with every rank's state in the checkpoint (see the module doc).

    A `SampleDataset`'s batches are given back to their workers' rings as they arrive, as SampleLoader does
    (datamodules/sample/batches.py).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("snapshot_every_n_steps", SNAPSHOT_EVERY_N_STEPS)
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch: not ours to fix
            warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
            super().__init__(*args, **kwargs)

    def __iter__(self):
        try:
            batches = super().__iter__()
        except (RuntimeError, OSError) as error:
            batches = self._started_afresh(error)
            return given_back(self._through_dead_workers(batches, restarts=1))
        return given_back(self._through_dead_workers(batches))

    def _started_afresh(self, error: BaseException) -> Iterator:
        """The epoch's iterator from new workers, where a persistent worker was found dead as the epoch started: it
        died between epochs (in the validation, or after the last batch was fetched), and torchdata's `_reset`, which
        waits for every worker to acknowledge the new epoch (stateful_dataloader.py), raised torch's dead-worker
        error from `iter()`, outside any batch. Recorded as a death inside the epoch is, so that the ranks stop at
        their next agreement and save, the fault campaign of issue 52 found it otherwise ended every rank unsaved.
        Nothing of the new epoch was yielded: a new iterator starts it from its first sample (the sampler is at
        its epoch already; the workers draw their crops from a new seed)."""
        iterator = self._iterator
        if iterator is None or not dead_workers.record(error, list(getattr(iterator, "_workers", []))):
            raise error
        dead_workers.end_workers(iterator)
        self._iterator = None
        return StatefulDataLoader.__iter__(self)

    def _through_dead_workers(self, batches: Iterator, restarts: int = 0) -> Iterator:
        """`batches`; where a worker has died (datamodules/processes/dead_workers.py), recorded, and the rest from
        workers started again from the loader's state as of the last batch it yielded (torchdata updates that state
        only as it yields a batch: stateful_dataloader.py, `_process_data`), exactly as a resume would go on."""
        def restart(error: BaseException) -> Iterator:
            iterator = self._iterator
            if iterator is None or not dead_workers.record(error, list(getattr(iterator, "_workers", []))):
                raise error
            return self._started_again(iterator)

        return dead_workers.through_restarts(batches, restart, restarts)

    def _started_again(self, iterator) -> Iterator:
        state = copy.deepcopy(iterator.state_dict())
        dead_workers.end_workers(iterator)
        StatefulDataLoader.load_state_dict(self, state)
        return StatefulDataLoader.__iter__(self)

    def loader_state(self) -> dict[str, Any]:
        """This rank's state as of the batches the loader itself has yielded (a copy: torchdata updates its own)."""
        return copy.deepcopy(super().state_dict())

    def state_dict(self) -> dict[str, Any]:
        return self.state_dict_from(super().state_dict())

    def state_dict_from(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's state from this rank's (`loader_state`: a reader ahead of the consumer, such as the
        device decode's stage, keeps the one as of the batches it handed on): every rank's."""
        world = _ranks()[1]
        states = [mine]
        if world > 1:  # every rank is in Trainer.save_checkpoint (fit_loop.on_save_checkpoint runs on each)
            states = [None] * world
            dist.all_gather_object(states, mine)
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rank, world = _ranks()
        states = state_dict.get("ranks")
        if states and len(states) == world and _workers_in(states[rank]) == self.num_workers:
            super().load_state_dict(states[rank])
            return
        where = _sampler_position(states or [])
        if where is None or not isinstance(self.sampler, EpochSampler):
            # Lightning still counts the checkpoint's batches as done (its batch progress is restored whatever the
            # loader does; the epoch ends when that count reaches the epoch's batches: training_epoch_loop.py,
            # `_num_ready_batches_reached`), so a loader started afresh runs only the epoch's first batches
            warnings.warn("The checkpoint's train loader state is not one this loader can read: the interrupted "
                          "epoch's loader starts again from its first batch (in the order of the epoch its sampler "
                          "is at, epoch 0 in a new process) and, as Lightning counts the checkpoint's batches of the "
                          "epoch as done, runs only as many batches as the epoch had left: its first ones again, "
                          "never its last.", stacklevel=2)
            return
        epoch, samples = where
        # the position in the epoch's order (the same on every layout: DistributedSampler shuffles with seed + epoch,
        # then gives rank r every world-th index) that all ranks together had reached, shared out among this run's
        # ranks; exactly the saved ranks' samples when the global batch divides among both layouts' ranks
        self.sampler.load_state_dict({"epoch": epoch, "yielded": samples // world})
        saved = f"{len(states)} process(es) with {_workers_in(states[0])} loader worker(s) each"
        warnings.warn(f"The checkpoint's train loader state was saved by {saved}, this run has {world} with "
                      f"{self.num_workers}: the interrupted epoch goes on from the sample it had reached (the samples "
                      f"an uninterrupted run would see, none repeated, none skipped), but its crops and flips are "
                      f"drawn afresh. Resume with the saved numbers of processes and --data.num_workers to continue it "
                      f"pixel for pixel.", stacklevel=2)


def _sampler_position(states: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(epoch, samples all ranks had taken in it) from the ranks' saved states; None where a state holds no
    EpochSampler state.

    torchdata keeps the sampler's state inside its batch sampler iterator's (torchdata/stateful_dataloader/
    sampler.py, `_BatchSamplerIterator.state_dict`: "sampler_state"), at the top of the state without workers and
    in the main snapshot with them (stateful_dataloader.py, `_SAMPLER_ITER_STATE`, `_MAIN_SNAPSHOT`); that snapshot
    is as of the last batch yielded, as SNAPSHOT_EVERY_N_STEPS is 1.
    """
    found = []
    for state in states:
        main = state["_snapshot"]["_main_snapshot"] if state.get("_snapshot") else state
        sampler = (main.get("_sampler_iter_state") or {}).get("sampler_state") or {}
        if "epoch" not in sampler or "yielded" not in sampler:
            return None
        found.append((int(sampler["epoch"]), int(sampler["yielded"])))
    if not found or len({epoch for epoch, _ in found}) != 1:
        return None
    return found[0][0], sum(yielded for _, yielded in found)
