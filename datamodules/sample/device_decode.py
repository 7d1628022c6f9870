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
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.errors import DataError
from datamodules.sample.balance import CANNOT, WorkerDecodeShare
from datamodules.sample.batches import batch_layout
from datamodules.sample.decode import decode
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


class Waits:
    """Seconds the stage's thread spent waiting for the workers' next batch, building a batch on the device, and
    waiting for the step to take the batch it built; and the batches. The device's part split three ways: the
    batched JPEG decode (the call blocks until its private stream is done), the crops and resizes (launches), and
    the wait for the side stream's previous batch before each decode."""

    def __init__(self) -> None:
        self.workers = self.device = self.step = 0.0
        self.jpeg = self.crop = self.previous = 0.0
        self.batches = 0

    def device_shares(self) -> dict[str, float]:
        total = self.jpeg + self.crop + self.previous
        return {k: getattr(self, k) / total if total else 0.0 for k in ("jpeg", "crop", "previous")}

    def shares(self) -> dict[str, float]:
        total = self.workers + self.device + self.step
        return {k: getattr(self, k) / total if total else 0.0 for k in ("workers", "device", "step")}


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


def decode_line(decoders: dict[str, DeviceDecode]) -> str | None:
    """The end-of-run words on --data.decode gpu (the training loader's, else any): how much the workers decoded,
    what an image cost each half, where the decode thread waited. None without device decode."""
    decoder = decoders.get("train") or next(iter(decoders.values()), None)
    if decoder is None or not decoder.waits.batches:
        return None
    counts = decoder.counts
    total = counts["device"] + counts["cpu"]
    words = [f"--data.decode gpu: {total:,} images, {counts['cpu'] / max(1, total):.0%} decoded by the workers"]
    if counts["cannot"]:
        words.append(f"{counts['cannot']:,} of them because the device cannot take them (progressive, grayscale, "
                     "CMYK, EXIF-rotated or not JPEG: docs/data.md)")
    costs = decoder.share.costs() if decoder.share is not None else None
    if costs is not None:
        decode = f", {costs['decode'] * 1e3:.2f} ms to decode there" if costs["decode"] is not None else ""
        words.append(f"per image {costs['read'] * 1e3:.2f} ms to read in a worker{decode}, "
                     f"{costs['device'] * 1e3:.2f} ms on the device ({decoder.share.workers} workers)")
    waits = decoder.waits.shares()
    words.append(f"the decode thread waited {waits['workers']:.0%} of its time for the workers and "
                 f"{waits['step']:.0%} for the step")
    parts = decoder.waits.device_shares()
    if decoder.waits.jpeg:
        words.append(f"its device time {parts['jpeg']:.0%} in the JPEG decode, {parts['crop']:.0%} cropping, "
                     f"{parts['previous']:.0%} waiting for its previous batch")
    return ", ".join(words)
