"""GPU decode, the device's half: an `EncodedBatch` -> a uint8 channels-last batch on the training device.

`DeviceDecode` decodes a batch's JPEGs in one batched call (`torchvision.io.decode_jpeg(list, device=...)`:
nvJPEG's hardware engine for baseline JPEGs on A100/H100/H200), then crops the planned boxes, resizes them
(antialiased bilinear) to the planned windows and flips the flipped ones in a few batched calls
(device_resize.py), and writes the CPU-decoded samples into their places, in a batch of a preallocated ring
(ring.py). `on_after_batch_transfer` then only normalises (base.py).

Two batches in flight: batch k+2 is decoded while k+1 is resized and k trains. torchvision's decode blocks its
thread (`cudaStreamSynchronize` before and after, torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp) and
allocates its outputs on the caller's current stream but writes them on a private stream that waits for nothing
queued on the caller's (pytorch/vision PR 9606; meta-pytorch/torchcodec PR 1634: the hardware engine ignores the
stream's earlier work). Memory freed on that stream while kernels still read it can be handed to the decode and
overwritten. So (the operations: device_streams.py):
- the decode runs with a stream of its own current (`decode`), on which nothing is ever queued: only its
  outputs, the decoded images, are allocated there;
- the crop and resize run on another (`resize`, high priority: FIC_DECODE_STREAM_PRIORITY, default -1), which
  waits on the device for the decode's event, and writes a ring slot after waiting, on the device, for the
  event the consumer's stream recorded when it moved on from that slot's last batch;
- a batch's decoded images are kept until the host has seen its resize finish (an event observed before the
  decode two batches on, or found done earlier): only then do they go back to the decode stream's pool, where
  no queued kernel can read them any more. Two batches' images at most are alive;
- the consumer's stream waits for the batch on the device (`wait_event`), never on the host, and the allocator
  learns that it uses the batch and its labels (`record_stream`).

`DecodeStage` (decode_stage.py) runs this on a thread of its own, ahead of the consumer, and tells the decode
when the consumer moves on (`moved_on`); a caller of `DeviceDecode(...)(batch)` moves on at its next call.

Without CUDA (tests, a CPU run) the same code runs on the CPU: torchvision's batched CPU decode
(libjpeg-turbo), and streams and events that only check the order (device_streams.CpuStreams).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.errors import DataError
from datamodules.sample.balance import CANNOT, WorkerDecodeShare
from datamodules.sample.decode import decode
from datamodules.sample.decode_report import Waits
from datamodules.sample.device_resize import BYTES_PER_ELEMENT, GROUP_ELEMENTS, build_on_device, resize_plan
from datamodules.sample.device_streams import stream_priority, streams_for
from datamodules.sample.encoded import EncodedBatch
from datamodules.sample.ring import RING_SLOTS, BatchRing, Slot

Describe = Callable[[int, Exception], str]  # (sample id, error) -> the message naming the file
DECODED_BYTES = 3 * 500 * 400  # a decoded ImageNet-sized JPEG (about 500 x 400 px), uint8 RGB
JPEG_RANGE, RESIZE_RANGE = "fic.decode.jpeg", "fic.decode.resize"  # a batch's two parts, named in a profiler's trace
BATCHES_ON_DEVICE = RING_SLOTS  # output batches: the one the step trains on, the one waiting, the one being built
DECODED_IN_FLIGHT = 2  # batches whose decoded images are alive: the one resizing and the one decoding


def device_bytes_per_image(size: int, decoded: int = DECODED_BYTES) -> int:
    """GPU memory one image of a batch holds while the device decodes (for the memory probe): the ring's output
    batches; the decoded pixels of the batches in flight, and while one is resized their flat copy and its
    resized pixels (before they take their places). A group's resize holds DEVICE_GROUP_BYTES besides."""
    return BATCHES_ON_DEVICE * 3 * size * size + (DECODED_IN_FLIGHT + 1) * decoded + 3 * size * size


DEVICE_GROUP_BYTES = BYTES_PER_ELEMENT * GROUP_ELEMENTS  # device_resize.py: one group at a time


class Decoded(NamedTuple):
    """A batch built on the resize stream: `ready` is recorded after its last write; `slot` is its ring slot."""

    images: torch.Tensor
    labels: torch.Tensor
    ready: Any
    ids: torch.Tensor  # the batch's sample ids, on the host
    slot: Slot


class DeviceDecode:
    """Decodes and crops `EncodedBatch`es on `device`; counts the samples each path took. `share` sets the
    workers' part of each batch (balance.py; None: the workers decode only what the device cannot)."""

    def __init__(self, device: torch.device | str, describe: Describe, share: WorkerDecodeShare | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.describe = describe
        self.share = share
        self.streams = streams_for(self.device)
        priority = stream_priority()
        self.decode_stream = self.streams.new_stream(priority)  # only allocations: see the module doc
        self.resize_stream = self.streams.new_stream(priority)
        self.ring = BatchRing(self.device, self.streams)
        self.in_flight: deque[tuple[Any, list[torch.Tensor], tuple]] = deque()  # (resize event, images, key)
        self.handed: tuple[Slot, Any] | None = None  # the slot the consumer has, and its stream
        self.batches = 0
        self.counts = {"device": 0, "cpu": 0, "cannot": 0}  # decoded on the device, by the workers; cannot: of theirs
        self.waits = Waits()
        self.pass_ids = False  # hand the sample ids on as a third element (a streamed batch's, shards/loader.py)

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, ...]:
        """Build and hand over on this thread (which moves on from the batch it was handed before)."""
        self.moved_on()
        return self.hand_over(self.build(batch))

    def build(self, batch: EncodedBatch) -> Decoded:
        """The batch on the device, written on the resize stream (any one thread)."""
        start = time.perf_counter()
        with torch.no_grad():
            self._release_decoded(keep=DECODED_IN_FLIGHT - 1)
            self.waits.previous += time.perf_counter() - start
            decoded = self._build(batch)
        seconds = time.perf_counter() - start
        self.waits.device += seconds
        self.waits.batches += 1
        costs = batch.costs.tolist()
        self.counts["cannot"] += int(costs[CANNOT])
        if self.share is not None:
            self.share.update(costs, seconds, len(batch.slots))
        return decoded

    def hand_over(self, decoded: Decoded) -> tuple[torch.Tensor, ...]:
        """On the consumer's thread: its current stream waits for the batch on the device, never on the host."""
        consumer = self.streams.current()
        self.streams.wait(consumer, decoded.ready)
        self.streams.reads(consumer, decoded.slot.key)
        self.streams.hand_to(decoded.images, consumer)
        self.streams.hand_to(decoded.labels, consumer)
        self.handed = (decoded.slot, consumer)
        return (decoded.images, decoded.labels, decoded.ids) if self.pass_ids else (decoded.images, decoded.labels)

    def moved_on(self) -> None:
        """The consumer asks for the next batch: the one it was handed may be written again once the consumer's
        stream has passed its last use (an event, waited for on the device by the next writer: ring.py)."""
        if self.handed is not None:
            slot, consumer = self.handed
            self.handed = None
            self.ring.release(slot, consumer)

    def _release_decoded(self, keep: int) -> None:
        """Decoded images back to the allocator once the host has seen their resize finish: those found done, then
        the oldest, waited for, until at most `keep` batches' are alive (see the module doc)."""
        while self.in_flight and (len(self.in_flight) > keep or self.streams.done(self.in_flight[0][0])):
            ready, images, key = self.in_flight.popleft()
            if len(self.in_flight) >= keep:
                self.streams.observe(ready)
            self.streams.releases(key)
            images.clear()  # the last references: the memory returns to the decode stream's pool

    def _build(self, batch: EncodedBatch) -> Decoded:
        n, size = len(batch.labels), int(batch.size)
        slots = batch.slots.tolist()
        key = ("images", self.batches)
        self.batches += 1
        start = time.perf_counter()
        with record_function(JPEG_RANGE), self.streams.using(self.decode_stream):  # a profiler's named ranges
            images = self._decode(batch, batch.offsets.tolist()) if slots else []
            self.streams.writes(self.decode_stream, key)
            decoded_at = self.streams.record(self.decode_stream)
        decoded = time.perf_counter()
        with record_function(RESIZE_RANGE), self.streams.using(self.resize_stream):
            table, spans = resize_plan(images, batch.plans, size) if slots else (batch.plans, [])
            slot, out = self.ring.acquire(n, size, self.resize_stream)
            self.streams.wait(self.resize_stream, decoded_at)
            self.streams.reads(self.resize_stream, key)
            self.streams.writes(self.resize_stream, slot.key)
            labels = build_on_device(self.device)(images, table, spans, size, out, batch.slots, batch.pixels,
                                                  batch.pixel_slots, batch.labels, self.device)
            ready = self.streams.record(self.resize_stream)
        self.in_flight.append((ready, images, key))
        if slots:
            self.waits.jpeg += decoded - start
            self.waits.crop += time.perf_counter() - decoded
        self.counts["device"] += len(slots)
        self.counts["cpu"] += len(batch.pixel_slots)
        return Decoded(out, labels, ready, batch.ids, slot)

    def _decode(self, batch: EncodedBatch, offsets: list[int]) -> list[torch.Tensor]:
        """The batch's JPEGs as (3, H, W) uint8 on the device, in one call; a file it refuses is named."""
        encoded = [batch.data[a:b] for a, b in itertools.pairwise(offsets)]
        try:
            if self.cuda:
                return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
            return [image.contiguous() for image in decode_jpeg(encoded, mode=ImageReadMode.RGB)]
        except RuntimeError as e:
            self._name_the_file(batch, encoded, e)
            raise

    def _name_the_file(self, batch: EncodedBatch, encoded: list[torch.Tensor], error: Exception) -> None:
        """After a batch decode failed: decode each file on the CPU and raise a DataError naming the first bad one."""
        ids = batch.ids.tolist()
        for slot, data in zip(batch.slots.tolist(), encoded, strict=True):
            try:
                decode(data.clone())
            except Exception as e:
                raise DataError(self.describe(ids[slot], e)) from e
        raise DataError(f"the device JPEG decode failed on a batch whose files all decode on the CPU ({error}). "
                        "Train with --data.decode cpu, and report it with the GPU and driver named.") from error
