"""Region decode: a train sample from only the rows and columns of its JPEG that the crop's box needs.

A RandomResizedCrop keeps a part of the image (a quarter to all of it at min_scale 0.25, on average about 60%),
yet a full decode computes every pixel. Here the box is drawn first, from the JPEG's frame header and the
sample's own `random.Random` (`TrainCrop.plan`, the same draws in the same order as on a decoded image, so
crops, flips and a resumed run are unchanged), then only the box's region is decoded, and the crop is cut
from that region (`TrainCrop.cut`, by the caller: dataset.py).

The decoder is the libjpeg-turbo Pillow ships, through a small C file the training process builds (region_libjpeg.py),
or where that cannot be built (no C compiler) nvImageCodec's CPU backend (region_nvimgcodec.py). Both run
libjpeg-turbo with the defaults of torchvision's and PIL's decoders (islow IDCT, fancy upsampling) and one column of
context on each inner side of a region, so a region's pixels are the full decode's pixels (any first and last row
is exact: tests/test_region_decode.py). What it leaves to the caller: libjpeg-turbo picks its plain upsampler
instead of the fancy one for a component only 1 or 2 samples wide (jdsample.c, `jinit_upsampler`, on
`downsampled_width`), so a 1-pixel-wide box at an image's left or right border in 4:2:0 would differ. This module
grows a box narrower than one MCU outward to the MCU grid (`region_of`), which makes every region at least one MCU
wide, or as wide as the image; a wider box is decoded as it is, so the region is the crop itself and the resize
reads it without a copy (crop.py, `resize`).

Only baseline and extended sequential 8-bit JPEGs with 1 or 3 components and no EXIF rotation (nor an XMP
packet naming one) take this path (`region_takes`). The rest, and every file when no decoder is available
or it refuses a file, take the full decode (decode.py); `RegionCounts` counts both for the end-of-run line. A
progressive JPEG gains nothing: every scan must be decoded before any pixel is known.
"""
from __future__ import annotations

import random
import threading
from typing import Any, NamedTuple

import torch
from torch.utils.data import get_worker_info

from datamodules.sample import region_libjpeg, region_nvimgcodec
from datamodules.sample.crop import CropPlan, TrainCrop
from datamodules.sample.decode import decode
from datamodules.sample.jpeg_header import JpegFrame, jpeg_frame
from datamodules.sample.pixel_limit import refused_by_pillow

_REGION_SOF = (0xC0, 0xC1)  # baseline and extended sequential Huffman
_TURNS = range(2, 9)  # the EXIF orientations that turn or mirror (0 and others: none, in PIL and torchvision alike)
decoder: Any = None  # the region decoder, once `available()` has looked for it
_looked = False


_lock = threading.Lock()


def available() -> bool:
    """Whether a region decoder is here (then the region path is on); looks for it on the first call, once per process
    whatever the threads. A loader worker does not build the libjpeg route (region_libjpeg.py): the training process
    did, when it planned the loader."""
    global decoder, _looked
    if not _looked:
        with _lock:
            if not _looked:
                build = get_worker_info() is None
                decoder, _looked = region_libjpeg.load(build) or region_nvimgcodec.load(), True
    return decoder is not None


def why_off() -> str:
    """Why no region decoder is available here, with what would bring one."""
    return (f"the libjpeg-turbo route could not be built ({region_libjpeg.why_not}) and nvImageCodec is not "
            f"installed ({region_nvimgcodec.PIP_LINE})")


def region_takes(frame: JpegFrame | None) -> bool:
    """Whether the region decode gives this file the full decode's pixels (decode.py's JPEGs, minus progressive
    ones, those whose pixels the decoder may turn (an EXIF rotation, an XMP packet naming an orientation) and those
    past the pixel limit, which the full decode refuses by name)."""
    return (frame is not None and frame.sof in _REGION_SOF and frame.precision == 8
            and frame.components in (1, 3) and frame.orientation not in _TURNS and not frame.xmp
            and frame.height > 0 and frame.width > 0
            and not refused_by_pillow(frame.width, frame.height))  # the full decode names it (--data.max_image_pixels)


def region_of(frame: JpegFrame, top: int, left: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the region decoded for a box: the box itself, or for a box narrower than one
    MCU its columns grown outward to the MCU grid (clipped to the image); its rows as they are (the vertical
    upsampling is exact at any row: module doc)."""
    mw = frame.mcu_width
    if width >= mw:
        return top, left, top + height, left + width
    return top, (left // mw) * mw, top + height, min(frame.width, -(-(left + width) // mw) * mw)


def decode_region(data: bytes | bytearray | memoryview | torch.Tensor, region: tuple[int, int, int, int]
                  ) -> torch.Tensor | None:
    """RGB uint8 CHW (a view of HWC memory, as decode.py's) of `region` (top, left, bottom, right), or None
    when the decoder refuses the file (the full decode then decides: it decodes it or names the error)."""
    return decoder.decode(data, region)


class RegionCounts:
    """Train images decoded by region and whole, per process that decoded them, in shared memory: a loader worker
    adds its own row after each batch, and the training process reads the sum at the end of the run (`line`).

    A batch counts into its own tally (`tally`, then `flush`), per sample index: a sample built twice (the idle
    helper's, built again by the worker that did not wait for it: dataset.py) counts once, and one the helper
    finishes after its batch has left goes into that batch's tally, which was already added, so it does not count
    in the next batch. Every image delivered counts once; images decoded and dropped do not count here, but a
    loader iterator made twice decodes its first one's prefetched batches for nothing (lightning_app/callbacks/
    reseed.py makes a second one only where it changes the epoch's samples)."""

    ROWS = 512  # the training process and its loader workers (worker k writes row k + 1, modulo)

    def __init__(self) -> None:
        self.table = torch.zeros((self.ROWS, 2), dtype=torch.int64).share_memory_()
        self._pending: dict[int, bool] = {}

    @staticmethod
    def tally() -> dict[int, bool]:
        """A batch's own tally, for `count` and `flush`."""
        return {}

    def count(self, i: int, region: bool, tally: dict[int, bool] | None = None) -> None:
        """Sample i, by region or whole, into its batch's `tally` (from any sample thread: one dict store), or
        without one into this process's (a sample built on its own); `flush` adds it to a row."""
        (self._pending if tally is None else tally)[i] = region

    def flush(self, row: int, tally: dict[int, bool] | None = None) -> None:
        """Adds `tally`, or without one what was counted without one since the last flush, to row `row`."""
        if tally is None:
            tally, self._pending = self._pending, {}
        pending = tally
        if pending:
            by_region = sum(pending.values())
            self.table[row % self.ROWS] += torch.tensor([by_region, len(pending) - by_region])

    def __getstate__(self) -> dict:
        return {"table": self.table}  # the shared table; what a process has not flushed yet stays its own

    def __setstate__(self, state: dict) -> None:
        self.table = state["table"]
        self._pending = {}

    def line(self) -> str | None:
        """The end-of-run words, or None when no image was counted."""
        region, whole = (int(v) for v in self.table.sum(0))
        if region + whole == 0:
            return None
        if not available():
            return (f"region decode off: {why_off()}, so all {whole:,} train images were decoded whole "
                    "(docs/data.md, \"Region decode\")")
        return (f"region decode: {region:,} train images, {whole:,} decoded whole (progressive, CMYK, "
                f"EXIF-rotated, not JPEG or refused); decoder: {decoder.name}")


class Box(NamedTuple):
    """A train sample's pixels with the crop plan drawn for it: the plan's region (`by_region`) or, for a file
    the decoder refuses, the whole image; `origin` is their top-left pixel in the image (what `TrainCrop.cut`
    takes)."""

    pixels: torch.Tensor
    plan: CropPlan
    origin: tuple[int, int]
    by_region: bool


def decode_box(data: bytes | bytearray | memoryview | torch.Tensor, crop: TrainCrop, size: int,
               rng: random.Random) -> Box | None:
    """The crop plan `crop.plan` draws from `rng` for `data`, and the pixels it needs; None, with `rng` untouched,
    when this file takes the full decode and its crop (`region_takes`, or no region decoder)."""
    if not available():
        return None
    frame = jpeg_frame(data if not isinstance(data, torch.Tensor) else memoryview(data.numpy()))
    if not region_takes(frame):
        return None
    plan = crop.plan(frame.height, frame.width, size, rng)
    region = region_of(frame, plan.top, plan.left, plan.height, plan.width)
    pixels = decode_region(data, region)
    if pixels is None:  # refused (a truncated file): the full decode decodes it or names the error
        return Box(decode(data), plan, (0, 0), False)
    return Box(pixels, plan, region[:2], True)
