"""GPU decode, the worker's half: read the bytes, draw each sample's crop, pack the batch still encoded.

With `--data.decode gpu` a loader worker does not decode. Per batch it
1. reads the samples' bytes (the same read-ahead threads as the CPU path, dataset.py);
2. walks each JPEG's markers to its frame header (decode.jpeg_frame): the image size, and whether the
   GPU's decoder gives the CPU path's pixels;
3. draws the crop box and the flip from the sample's own `random.Random`, seeded exactly as the CPU path
   seeds it (`crop.TrainCrop.plan`, the same draws in the same order), so a seeded or resumed run crops the
   same boxes whichever decode runs;
4. packs bytes, boxes, labels and sample ids into one `EncodedBatch`, with the seconds it spent.
Files the GPU path cannot take are decoded and cropped here, on the CPU path with the same seed, and join
the batch as pixels (`gpu_takes` says which); so does a share of the others when the workers have time to
spare (`overflow`, balance.py). The device half is device_decode.py.
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from datamodules.sample.batches import batch_layout
from datamodules.sample.crop import CropPlan, TrainCrop, ValCrop
from datamodules.sample.dataset import Encoded, SampleDataset, read_ahead, sample_pool
from datamodules.sample.jpeg_header import JpegFrame, jpeg_frame
from datamodules.sample.pixel_limit import refused_by_pillow

_GPU_SOF = (0xC0, 0xC1)  # baseline and extended sequential Huffman: what nvJPEG's hardware engine decodes


class EncodedBatch(NamedTuple):
    """One batch as a worker packs it for device decoding (every field a CPU tensor).

    data: the encoded bytes of the samples the device decodes, back to back; offsets: (m + 1) int64 bounds
    of each in `data`; slots: their (m) places in the batch; plans: (m, 9) int64 `CropPlan`s; pixels: the
    (k, 3, size, size) uint8 samples decoded here, channels-last; pixel_slots: their (k) places;
    labels, ids: (n) int64 labels and sample ids (ids name a file in an error); size: the batch's size;
    costs: what the worker spent on it (float64, balance.py: images, seconds reading and planning, images
    decoded here, seconds decoding them, images the device cannot take).
    """

    data: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor
    plans: torch.Tensor
    pixels: torch.Tensor
    pixel_slots: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    size: torch.Tensor
    costs: torch.Tensor


def gpu_takes(frame: JpegFrame | None, data: Encoded) -> bool:
    """Whether the device decode gives this file the CPU path's pixels.

    Only baseline 8-bit YCbCr JPEGs, whole (they end with the EOI marker), without an EXIF rotation or an XMP
    packet. The rest take the CPU path: progressive JPEGs (the hardware engine refuses them; torchvision
    decodes them one at a time on the GPU, torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp), grayscale and
    CMYK (nvJPEG's RGB output is not libjpeg-turbo's conversion), EXIF-rotated files (no orientation on CUDA),
    PNG and anything else the header walk refuses.
    """
    if frame is None or frame.sof not in _GPU_SOF or frame.precision != 8 or frame.components != 3:
        return False
    if frame.xmp or frame.orientation != 1 or frame.height < 1 or frame.width < 1:
        return False
    if refused_by_pillow(frame.width, frame.height):  # the workers' PIL raises its DecompressionBombError
        return False
    tail = memoryview(data)[-2:] if not isinstance(data, torch.Tensor) else data[-2:].tolist()
    return len(tail) == 2 and tail[0] == 0xFF and tail[1] == 0xD9


def _shared_bytes(n: int) -> torch.Tensor:
    """n uint8 in shared memory when in a loader worker (so the batch crosses to the trainer without a copy)."""
    if get_worker_info() is None:
        return torch.empty(n, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(n, 1)), 0, (n,), (1,))


class EncodedDataset(SampleDataset):
    """A SampleDataset whose batches are `EncodedBatch`es: see the module doc. `crop` is TrainCrop or ValCrop."""

    @property
    def overflow(self) -> torch.Tensor | None:
        """The plan's shared overflow (written by the device stage; balance.py): the chance that a file the device
        could decode is decoded here instead. None: never."""
        return self.plan.overflow

    def device_crop(self, data: Encoded, size: int, rng: random.Random) -> CropPlan | None:
        """The device's crop of this sample, or None for the CPU path."""
        frame = jpeg_frame(data if not isinstance(data, torch.Tensor) else memoryview(data.numpy()))
        if not gpu_takes(frame, data):
            return None
        if isinstance(self.crop, TrainCrop):
            if self.crop.augment is not None:
                return None
            return self.crop.plan(frame.height, frame.width, size, rng)
        if isinstance(self.crop, ValCrop):
            return self.crop.plan(frame.height, frame.width, size)
        return None

    def __getitems__(self, indices: Sequence[int]) -> EncodedBatch:
        began = time.perf_counter()
        size = self.size()
        overflow = float(self.overflow[0]) if self.overflow is not None else 0.0
        seeds = torch.randint(2**62, (len(indices),)).tolist()  # as SampleDataset draws them: the same crops
        device: list[tuple[int, Encoded, CropPlan]] = []
        here: list[tuple[int, Encoded | Exception]] = []
        cannot = 0
        for k, data in enumerate(read_ahead(self.source, indices, sample_pool())):
            plan = None if isinstance(data, Exception) else self.device_crop(data, size, random.Random(seeds[k]))
            cannot += plan is None
            if plan is None or seeds[k] < overflow * 2**62:  # the seed is uniform: a fair draw of the overflow
                here.append((k, data))
            else:
                device.append((k, data, plan))
        lengths = [len(data) if not isinstance(data, torch.Tensor) else data.numel() for _, data, _ in device]
        offsets = np.zeros(len(device) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        packed = _shared_bytes(int(offsets[-1]))
        flat = packed.numpy()
        for (_, data, _), start, end in zip(device, offsets[:-1], offsets[1:], strict=True):
            flat[start:end] = np.frombuffer(data, np.uint8) if not isinstance(data, torch.Tensor) else data.numpy()
        shape, stride, _ = batch_layout(len(here), size)
        pixels = torch.empty_strided(shape, stride, dtype=torch.uint8)
        decoding = time.perf_counter()
        for j, (k, data) in enumerate(here):  # a failure raises a DataError naming the file, as on the CPU path
            pixels[j].copy_(self.sample(indices[k], size, random.Random(seeds[k]), data))
        done = time.perf_counter()
        if self.decode_counts is not None:
            worker = get_worker_info()
            self.decode_counts.flush(0 if worker is None else worker.id + 1)
        costs = torch.tensor([len(indices), decoding - began, len(here), done - decoding, cannot],  # balance.COSTS
                             dtype=torch.float64)
        return EncodedBatch(
            data=packed, offsets=torch.from_numpy(offsets),
            slots=torch.tensor([k for k, _, _ in device], dtype=torch.int64),
            plans=torch.tensor([tuple(plan) for _, _, plan in device], dtype=torch.int64).reshape(-1, 9),
            pixels=pixels, pixel_slots=torch.tensor([k for k, _ in here], dtype=torch.int64),
            labels=self.labels[list(indices)], ids=torch.as_tensor(list(indices), dtype=torch.int64),
            size=torch.tensor(size, dtype=torch.int64), costs=costs)
