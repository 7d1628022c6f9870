"""GPU decode, the device's half: an `EncodedBatch` -> a uint8 channels-last batch on the training device.

`DeviceDecode` decodes a batch's JPEGs in one batched call (`torchvision.io.decode_jpeg(list, device=...)`:
nvJPEG's hardware engine for baseline JPEGs on A100/H100/H200), then crops the planned boxes, resizes them
(antialiased bilinear) to the planned windows and flips the flipped ones in a few batched calls
(device_resize.py), and writes the CPU-decoded samples into their places.
`on_after_batch_transfer` then only normalises (base.py).

Streams (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp): the decode allocates its outputs on the
caller's current stream, writes them on a private stream of its own and blocks the calling thread until it is
done (`cudaStreamSynchronize`). Nothing orders that private stream after work queued earlier on the caller's
stream, so memory freed there with kernels still reading it can be overwritten (pytorch/vision PR 9606: memory
corrupted in 199 of 200 runs on an H100 from the training stream, none from a side stream). So the batch is
decoded and cropped on a side stream of this stage's own, and:
- before each decode the host waits for the side stream's previous batch (its resizes read the last decoded
  images, whose memory the next decode may reuse), never for the training stream;
- the training stream waits on an event recorded after the batch is written (`wait_event`: no host sync),
  and `record_stream` tells the allocator that the training stream uses the batch.

`DecodeStage` runs this on one thread, one batch ahead of the consumer (the decode blocks its thread; the
training thread keeps launching the step meanwhile). It keeps the loader state as of the batches it has
handed out, so a mid-epoch checkpoint resumes exactly (datamodules/resume.py), and times where its thread
waits: for the workers, on the device, for the step (`Waits`, said at the end of a run: decode_line).
After each batch it tells the workers how much of the next to decode themselves (balance.py).

Without CUDA (tests, a CPU run) the same code runs on the CPU: torchvision's batched CPU decode
(libjpeg-turbo), streams and events skipped.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.profiler import record_function
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.errors import DataError
from datamodules.sample.balance import CANNOT, WorkerDecodeShare
from datamodules.sample.batches import batch_layout
from datamodules.sample.decode import decode
from datamodules.sample.decode_report import Waits
from datamodules.sample.device_resize import BYTES_PER_ELEMENT, GROUP_ELEMENTS, build_on_device, resize_plan
from datamodules.sample.encoded import EncodedBatch

Describe = Callable[[int, Exception], str]  # (sample id, error) -> the message naming the file
DECODED_BYTES = 3 * 500 * 400  # a decoded ImageNet-sized JPEG (about 500 x 400 px), uint8 RGB
JPEG_RANGE, RESIZE_RANGE = "fic.decode.jpeg", "fic.decode.resize"  # a batch's two parts, named in a profiler's trace
BATCHES_ON_DEVICE = 2  # the batch the step trains on, and the one decoded ahead


def device_bytes_per_image(size: int, decoded: int = DECODED_BYTES) -> int:
    """GPU memory one image of a batch holds while the device decodes (for the memory probe): the output, for
    each batch on the device; while one is built, its decoded pixels twice (the images and their flat copy) and
    the resized pixels (before they take their places). A group's resize holds DEVICE_GROUP_BYTES besides."""
    return BATCHES_ON_DEVICE * 3 * size * size + 2 * decoded + 3 * size * size


DEVICE_GROUP_BYTES = BYTES_PER_ELEMENT * GROUP_ELEMENTS  # device_resize.py: one group at a time


class Decoded(NamedTuple):
    """A batch built on the side stream: `ready` is recorded after its last write (None on a CPU)."""

    images: torch.Tensor
    labels: torch.Tensor
    ready: torch.cuda.Event | None
    ids: torch.Tensor  # the batch's sample ids, on the host


class DeviceDecode:
    """Decodes and crops `EncodedBatch`es on `device`; counts the samples each path took. `share` sets the
    workers' part of each batch (balance.py; None: the workers decode only what the device cannot)."""

    def __init__(self, device: torch.device | str, describe: Describe, share: WorkerDecodeShare | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.describe = describe
        self.share = share
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.last: torch.cuda.Event | None = None
        self.counts = {"device": 0, "cpu": 0, "cannot": 0}  # decoded on the device, by the workers; cannot: of theirs
        self.waits = Waits()
        self.pass_ids = False  # hand the sample ids on as a third element (a streamed batch's, shards/loader.py)

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, ...]:
        """Build and hand over on this thread."""
        return self.hand_over(self.build(batch))

    def build(self, batch: EncodedBatch) -> Decoded:
        """The batch on the device, written on the side stream (any thread)."""
        start = time.perf_counter()
        if not self.cuda:
            decoded = Decoded(*self._build(batch), None, batch.ids)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
                if self.last is not None:
                    self.last.synchronize()  # the side stream's previous batch: see the module doc
                self.waits.previous += time.perf_counter() - start
                images, labels = self._build(batch)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self.last = ready
            decoded = Decoded(images, labels, ready, batch.ids)
        seconds = time.perf_counter() - start
        self.waits.device += seconds
        self.waits.batches += 1
        costs = batch.costs.tolist()
        self.counts["cannot"] += int(costs[CANNOT])
        if self.share is not None:
            self.share.update(costs, seconds, len(batch.slots))
        return decoded

    def hand_over(self, decoded: Decoded) -> tuple[torch.Tensor, ...]:
        """On the consumer's thread: its current stream waits for the batch (on the device, not the host)."""
        if decoded.ready is not None:
            training = torch.cuda.current_stream(self.device)
            training.wait_event(decoded.ready)
            decoded.images.record_stream(training)
            decoded.labels.record_stream(training)
        return (decoded.images, decoded.labels, decoded.ids) if self.pass_ids else (decoded.images, decoded.labels)

    def _build(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n, size = len(batch.labels), int(batch.size)
        shape, stride, _ = batch_layout(n, size)
        slots = batch.slots.tolist()
        start = time.perf_counter()
        with record_function(JPEG_RANGE):  # named ranges for a profiler's trace (bench/gpu/trace.py)
            images = self._decode(batch, batch.offsets.tolist()) if slots else []
        decoded = time.perf_counter()
        with record_function(RESIZE_RANGE):
            table, spans = resize_plan(images, batch.plans, size) if slots else (batch.plans, [])
            out = torch.empty_strided(shape, stride, dtype=torch.uint8, device=self.device)
            labels = build_on_device()(images, table, spans, size, out, batch.slots, batch.pixels, batch.pixel_slots,
                                       batch.labels, self.device)
        if slots:
            self.waits.jpeg += decoded - start
            self.waits.crop += time.perf_counter() - decoded
        self.counts["device"] += len(slots)
        self.counts["cpu"] += len(batch.pixel_slots)
        return out, labels

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
