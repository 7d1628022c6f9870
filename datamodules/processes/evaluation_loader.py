"""A validation loader whose worker dies during a fit goes on with new workers, from its first batch not yet
delivered, so that the validation ends whole and its score is exact; the ranks then stop and save at their next
agreement, as for a dead train worker (datamodules/processes/dead_workers.py).

Why not stop the validation part-way and save: a resumed run would have to run that validation again, which
Lightning does not do (loops/training_epoch_loop.py goes back into a validation only from inside a batch), and the
rank whose loader raised has no batch to step with while the others wait in the validation's collectives.

The batches not yet delivered are produced again, not skipped: a validation loader's order is its sampler's
(sequential, or Lightning's DistributedSampler without shuffle under DDP: the same on every pass) and its
transforms are deterministic, so a new iterator whose batch sampler skips the batches already delivered gives the
rest of the pass as the dead one would have. The batch sampler is read once per iterator, in
`_BaseDataLoaderIter.__init__` (`self._index_sampler = loader._index_sampler`), and drawn from at each `_reset`
(torch/utils/data/dataloader.py): the skip holds for the new iterator's first pass only.

Only in a fit (`dead_workers.restart_evaluation`, set by lightning_app/callbacks/stop_signals.py): a `validate` or
`test` command has nothing to save, and ends on the death with its paragraph (lightning_app/ending.py).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch.utils.data import DataLoader

from datamodules.processes import dead_workers


class EvaluationLoader(DataLoader):
    """The DataLoader of the validation, test and predict splits: see the module doc."""

    _skip = 0  # batches the next iterator's first pass leaves out (a restart's, delivered already)

    @property
    def _index_sampler(self):
        batches = super()._index_sampler
        return _Skipping(batches, self._skip) if self._skip else batches

    def __iter__(self) -> Iterator:
        if self.num_workers == 0 or not dead_workers.restart_evaluation:
            return super().__iter__()
        return self._through_dead_workers()

    def _through_dead_workers(self) -> Iterator:
        delivered, restarts = 0, 0
        try:
            batches = super().__iter__()
        except (RuntimeError, OSError) as error:  # a persistent worker died since the last pass: found at `_reset`
            self._shut_down(self._iterator, error)
            batches, restarts = self._from(0), 1

        def restart(error: BaseException) -> Iterator:
            nonlocal batches
            self._shut_down(batches, error)
            batches = self._from(delivered)
            return batches

        for batch in dead_workers.through_restarts(batches, restart, restarts):
            delivered += 1
            yield batch

    def _shut_down(self, iterator, error: BaseException) -> None:
        """Records the dead workers `error` shows, and ends `iterator`'s workers; raises `error` when it shows none."""
        if iterator is None or not dead_workers.record(error, list(getattr(iterator, "_workers", [])),
                                                       loader="validation"):
            raise error
        dead_workers.end_workers(iterator)
        if self._iterator is iterator:  # persistent workers: the next iter() makes new ones
            self._iterator = None

    def _from(self, delivered: int) -> Iterator:
        """A new iterator, with new workers, from batch `delivered` of the pass (from 0)."""
        self._skip = delivered
        try:
            iterator = DataLoader.__iter__(self)
        finally:
            self._skip = 0
        iterator._index_sampler = self._index_sampler  # persistent workers: the next pass runs whole
        return iterator


class _Skipping:
    """A batch sampler less its first `skip` batches (their indices are drawn and dropped: nothing is loaded)."""

    def __init__(self, batches, skip: int) -> None:
        self.batches, self.skip = batches, skip

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)
