"""The device decode's output batches: a preallocated ring, written again only after the consumer is done.

Each slot is a channels-last uint8 batch on the device, as large as the largest batch asked for (a smaller one,
the last of an evaluation epoch, is a view of its first images). A slot goes round:
1. `acquire` (the decode thread): a slot of the batch's size that the consumer has moved on from; the stream
   that will write it waits, on the device, for the event the consumer's stream recorded then; no slot free:
   a new one. In steady state there are RING_SLOTS: when the stage builds batch k+2, k+1 went into its queue,
   which holds one batch, so the consumer has taken k and moved on from k-1 (decode_stage.py);
2. the batch is written on that stream and handed to the consumer (device_decode.py);
3. `release` (the consumer's thread, when it asks for the next batch): an event recorded on the consumer's
   stream, after everything it queued on the batch so far. That holds only if nothing there still uses the
   batch: a consumer that fetches ahead (Lightning's fetcher without a loader length, loops/fetchers.py) asks for
   batch k+1 before it queues its step on k. So a batch still held when released gets its event later, at
   `acquire`, once nothing holds it any more: then all work on it is queued, and an event recorded on the
   consumer's stream from any thread comes after it (torch/cuda/streams.py, `Event.record`).

No allocation in steady state, and no host wait for the consumer: its stream's event is waited for on the device.
A consumer that keeps a batch past the next one (a list of batches, a test) holds a view of the slot, which
`acquire` sees (the storage's use count, torch/csrc: `_storage_Use_Count`) and skips: such a batch is never
overwritten, and the ring grows instead. Slots of another size (progressive resizing, a new val size) are
dropped once free; the allocator frees them after the consumer's stream is done (`hand_to`: record_stream).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from datamodules.sample.batches import batch_layout

RING_SLOTS = 3  # the batch the step trains on, the one waiting for it, the one being built


@dataclass(eq=False)  # a slot is itself: list.remove compared tensors field by field
class Slot:
    images: torch.Tensor  # (capacity, 3, size, size) channels-last uint8
    size: int
    key: tuple[str, int]  # its name for the streams' checks (device_streams.py)
    busy: bool = True  # being built, or handed to the consumer and not released
    released: Any = None  # the consumer's event when it moved on, if nothing held the batch then
    consumer: Any = None  # the consumer's stream, when no event could be recorded at release

    def held_elsewhere(self) -> bool:
        """Whether a tensor outside the ring still uses this slot's memory (a batch the consumer kept)."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        storage = self.images.untyped_storage()
        # 2 owners when only the ring holds it: `images` and `storage`, the StorageImpl's references
        return use_count is not None and use_count(storage._cdata) > 2


class BatchRing:
    """Output batches on `device` for the streams of `streams` (device_streams.py); see the module doc."""

    def __init__(self, device: torch.device, streams: Any) -> None:
        self.device, self.streams = device, streams
        self._ring: list[Slot] = []
        self._lock = threading.Lock()
        self.made = 0  # slots allocated so far (a test counts them)

    def acquire(self, n: int, size: int, stream: Any) -> tuple[Slot, torch.Tensor]:
        """A slot for a batch of n at `size` and its (n, 3, size, size) view, which `stream` may write from now on."""
        with self._lock:
            chosen = None
            for slot in list(self._ring):
                if slot.busy:
                    continue
                if slot.size != size or len(slot.images) < n:
                    self._ring.remove(slot)  # another size: the allocator frees it after its last use
                elif chosen is None and not slot.held_elsewhere():
                    chosen = slot
            if chosen is None:
                shape, stride, _ = batch_layout(n, size)
                with self.streams.using(stream):  # in the pool of the stream that writes it
                    images = torch.empty_strided(shape, stride, dtype=torch.uint8, device=self.device)
                chosen = Slot(images, size, ("slot", self.made))
                self.made += 1
                self._ring.append(chosen)
            chosen.busy = True
            if chosen.released is None and chosen.consumer is not None:  # nothing holds it now: all work is queued
                chosen.released = self.streams.record(chosen.consumer)
            if chosen.released is not None:
                self.streams.wait(stream, chosen.released)  # on the device: the consumer's use comes first
            chosen.released = chosen.consumer = None
            return chosen, chosen.images[:n]

    def release(self, slot: Slot, consumer: Any) -> None:
        """The consumer moved on from `slot`'s batch; `consumer`: its stream (None: the batch never reached it)."""
        with self._lock:
            if consumer is not None and not slot.held_elsewhere():
                slot.released = self.streams.record(consumer)  # after everything queued on the batch: see above
            else:
                slot.consumer = consumer
            slot.busy = False

    def held(self) -> int:
        """Slots not yet released (being built, waiting, or with the consumer)."""
        with self._lock:
            return sum(slot.busy for slot in self._ring)
