"""`DecodeStage(loader, decoder)`: any loader of `EncodedBatch`es, its batches decoded on the training device.

In the shape of timm's `PrefetchLoader` (timm/data/loader.py): it wraps the loader, iterates it, and passes its
length, `sampler`, `batch_sampler` and `dataset` through, so no loader class knows about it. The decode runs on a
thread of its own, ahead of the consumer (device_decode.py's module doc says why and how far).

How Lightning 2.6.6 treats it, being no `DataLoader`:
- it adds no sampler of its own to it (trainer/connectors/data_connector.py, `_prepare_dataloader`: "don't do
  anything if it's not a dataloader"), so `ImageDataModule.on_device` hands the wrapped loader to that same
  function first: the sampler Lightning would add to an evaluation loader under DDP, or predict's index wrapper
  (`_IndexBatchSamplerWrapper`, found through the passed-through `batch_sampler`: loops/prediction_loop.py,
  `_get_batch_indices`);
- it calls `set_epoch` on `sampler` and `batch_sampler.sampler` (lightning_fabric/utilities/data.py,
  `_set_sampler_epoch`), and counts batches with `len()` (utilities/data.py, `has_len_all_ranks`);
- a loader with `state_dict` and `load_state_dict` is `_Stateful` (lightning_fabric/utilities/types.py, a
  runtime-checkable Protocol): the fit loop saves its `state_dict()` in a checkpoint (loops/fit_loop.py,
  `on_save_checkpoint` -> utilities/combined_loader.py `_state_dicts`) and hands it back through
  `load_state_dict` on a mid-epoch resume (`_load_combined_loader_states` -> `_load_state_dicts`), whatever the
  loader's class. The wrapper's state is the wrapped loader's as of the batches it handed out, never of the ones
  decoded ahead (`loader_state`, taken on the thread as each batch leaves the loader);
- at a loop's teardown it shuts the workers down through `_iterator` (utilities/combined_loader.py,
  `_shutdown_workers_and_reset_iterator`, which asks `hasattr`, not the class): passed through too.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from datamodules.sample.device_decode import Decoded, DeviceDecode

_DONE = object()


class _Done(Exception):
    """The wrapped loader's epoch ended."""


class DecodeStage:
    """`loader`'s batches decoded by `decoder` on its own thread (see the module doc).

    The wrapped loader may offer `loader_state()` (its state now, a copy, from any thread) and
    `state_dict_from(state)` (a checkpoint's state from one of those; datamodules/resume.py gathers the ranks'):
    the wrapper's `state_dict()` is then the state as of the batches handed out so far.
    """

    def __init__(self, loader: Any, decoder: DeviceDecode) -> None:
        self.loader = loader
        self.decoder = decoder
        self._state: Any = None  # the wrapped loader's, as of the batches handed out (None: not iterated yet)

    # -- what Lightning and our tools read from a loader (see the module doc) ------------------
    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def num_workers(self) -> int:
        return getattr(self.loader, "num_workers", 0)

    @property
    def _iterator(self) -> Any:
        return getattr(self.loader, "_iterator", None)

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        self.loader._iterator = value

    def state_dict(self) -> dict[str, Any]:
        if self._state is not None and hasattr(self.loader, "state_dict_from"):
            return self.loader.state_dict_from(self._state)
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = None
        if hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state_dict)

    def _loader_state(self) -> Any:
        return self.loader.loader_state() if hasattr(self.loader, "loader_state") else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        ready: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()
        self._state = self._loader_state()  # before any batch
        # The first batch is taken on this thread: a loader that starts its workers lazily (LitData's) forks them
        # here, and a worker's PR_SET_PDEATHSIG (processes/loader_workers.py) fires when the thread that forked
        # it ends, which the decode thread does at every epoch's end.
        batches = iter(self.loader)
        try:
            first = next(batches)
        except StopIteration:
            self._state = self._loader_state()
            return
        batches = itertools.chain([first], batches)
        thread = threading.Thread(target=self._run, args=(batches, ready, stop), name="device-decode", daemon=True)
        thread.start()
        try:
            while True:
                # no local keeps the batch while the consumer has it: a slot it let go of is free (ring.py)
                yield self.decoder.hand_over(self._next(ready))
                self.decoder.moved_on()  # the consumer asks for the next batch (ring.py: what that proves)
        except _Done:
            return
        finally:
            self.decoder.moved_on()
            stop.set()  # an abandoned iterator (a sanity check, limit_*_batches): the thread ends before the next
            while thread.is_alive():
                try:
                    self._discard(ready.get(timeout=0.05))
                except queue.Empty:
                    pass
            thread.join()
            while not ready.empty():
                self._discard(ready.get())

    def _next(self, ready: queue.Queue) -> Decoded:
        item = ready.get()
        if isinstance(item, tuple) and item[0] is _DONE:
            self._state = item[1]
            raise _Done
        if isinstance(item, BaseException):
            raise item
        self._state = item[1]
        return item[0]

    def _discard(self, item: Any) -> None:
        """A batch built and never handed out (the iterator was abandoned): its ring slot is free again."""
        if isinstance(item, tuple) and isinstance(item[0], Decoded):
            self.decoder.ring.release(item[0].slot, None)

    def _run(self, batches: Iterator, ready: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            if self.decoder.cuda:
                torch.cuda.set_device(self.decoder.device)
            waits = self.decoder.waits
            asked = time.perf_counter()
            for batch in batches:
                got = time.perf_counter()
                waits.workers += got - asked
                state = self._loader_state()
                decoded = self.decoder.build(batch)
                built = time.perf_counter()
                if not put((decoded, state)):
                    self._discard((decoded, state))
                    return
                del decoded
                if stop.is_set():
                    return
                asked = time.perf_counter()
                waits.step += asked - built
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer's thread
            put(e)
            return
        put((_DONE, self._loader_state()))
