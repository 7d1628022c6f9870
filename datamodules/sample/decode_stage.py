"""The device decode on its own thread, one batch ahead of the consumer (see device_decode.py's module doc)."""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from datamodules.sample.device_decode import DeviceDecode

_DONE = object()


class DecodeStage:
    """The device decode on its own thread, one batch ahead: wraps a loader's batch iterator (see the module doc).

    `state()` is the wrapped loader's state as of the batches handed out so far (`loader_state` taken on the
    thread right after each batch left the loader), so a prefetched batch is never counted as used.
    """

    def __init__(self, decoder: DeviceDecode, loader_state: Callable[[], Any] | None = None) -> None:
        self.decoder = decoder
        self.loader_state = loader_state
        self._state: Any = None

    def state(self) -> Any:
        return self._state

    def __call__(self, batches: Iterator) -> Iterator[tuple[torch.Tensor, ...]]:
        ready: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()
        self._state = self.loader_state() if self.loader_state is not None else None  # before any batch
        # The first batch is taken on this thread: a loader that starts its workers lazily (LitData's) forks them
        # here, and a worker's PR_SET_PDEATHSIG (processes/loader_workers.py) fires when the thread that forked
        # it ends, which the decode thread does at every epoch's end.
        batches = iter(batches)
        try:
            first = next(batches)
        except StopIteration:
            self._state = self.loader_state() if self.loader_state is not None else None
            return
        batches = itertools.chain([first], batches)
        thread = threading.Thread(target=self._run, args=(batches, ready, stop), name="device-decode", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if isinstance(item, tuple) and item[0] is _DONE:
                    self._state = item[1]
                    return
                if isinstance(item, BaseException):
                    raise item
                decoded, self._state = item
                yield self.decoder.hand_over(decoded)
        finally:
            stop.set()  # an abandoned iterator (a sanity check, limit_*_batches): the thread ends before the next
            while thread.is_alive():
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

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
                state = self.loader_state() if self.loader_state is not None else None
                decoded = self.decoder.build(batch)
                built = time.perf_counter()
                if not put((decoded, state)) or stop.is_set():
                    return
                asked = time.perf_counter()
                waits.step += asked - built
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer's thread
            put(e)
            return
        put((_DONE, self.loader_state() if self.loader_state is not None else None))
