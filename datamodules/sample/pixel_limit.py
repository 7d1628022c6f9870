"""One pixel limit for every decoder, read from each file's header when the Index is built.

Pillow guards its own decoder against decompression bombs (PIL/Image.py, `_decompression_bomb_check`, called by
`Image.open`): above `Image.MAX_IMAGE_PIXELS` (89,478,485 pixels: 0.25 GiB of 24-bit pixels) it warns, above twice
that it raises `DecompressionBombError`. libjpeg-turbo's fast path (datamodules/sample/decode.py) and DALI have no
such limit, so a 20000x20000 JPEG (1.2 GB decoded) trained without a word while a PNG of the same size was refused.

Here the same two limits apply to every format, judged from the header alone at the start-up scan
(datamodules/index.py): a JPEG's frame header (`decode.jpeg_frame`), anything else through the constructor of
Pillow's plugin for its format, which parses the header without Pillow's check (`Image.open` runs the check after
the constructor, `_open_core`). A file above the limit is named in a warning; above twice the limit it is refused
as an unreadable file is (or left out with --data.skip_invalid). `--data.max_image_pixels` moves both (null: no
limit), and the process's and its loader workers' Pillow take the same value (`use_in_pillow`).
"""
from __future__ import annotations

import os
import warnings

from PIL import Image

from datamodules.sample.jpeg_header import jpeg_frame

PILLOW_MAX_IMAGE_PIXELS: int | None = Image.MAX_IMAGE_PIXELS  # Pillow's default, read before any change
_PILLOW_FORMATS = {"jpeg": "JPEG", "png": "PNG", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF", "ppm": "PPM",
                   "webp": "WEBP"}
_JPEG_HEADER_READ = 256 * 1024  # an EXIF block (thumbnail included) and an ICC profile before the frame header


def header_pixels(path: str | os.PathLike, head: bytes, fmt: str) -> int | None:
    """Width x height from the header of the image file at `path` (`head`: its first bytes, `fmt`: its sniffed
    format), or None when the header does not say (the decode will tell)."""
    if fmt == "jpeg":
        frame = jpeg_frame(head)
        if frame is None:  # the frame header lies past the first bytes read
            with open(path, "rb") as f:
                frame = jpeg_frame(f.read(_JPEG_HEADER_READ))
        if frame is not None:
            return max(1, frame.width) * max(1, frame.height)
    name = _PILLOW_FORMATS.get(fmt)
    if name is None:
        return None
    try:
        Image.init()
        factory = Image.OPEN[name][0]
        with open(path, "rb") as f:
            width, height = factory(f, str(path)).size
    except Exception:  # noqa: BLE001 - an unreadable header: the decode names the file with its own error
        return None
    return max(1, width) * max(1, height)


def over_limit(pixels: int | None, limit: int | None) -> str | None:
    """Why an image of `pixels` pixels is refused under `limit` (Pillow's error limit: twice the limit), or None."""
    if pixels is None or limit is None or pixels <= 2 * limit:
        return None
    return (f"{pixels:,} pixels, over twice --data.max_image_pixels ({limit:,}; Pillow's decompression-bomb limit): "
            "downscale it, or raise --data.max_image_pixels (null: no limit)")


def refused_by_pillow(width: int, height: int) -> bool:
    """Whether Pillow's check, at this process's limit, refuses a `width` x `height` image: the fast JPEG decoders
    leave such a file to PIL, which raises its DecompressionBombError (decode.py, encoded.py)."""
    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and max(1, width) * max(1, height) > 2 * limit


def above_warning(pixels: int | None, limit: int | None) -> bool:
    return pixels is not None and limit is not None and limit < pixels <= 2 * limit


def warn_large_files(root: str, split: str, large: list[tuple[str, int]], limit: int | None, shown: int = 5) -> None:
    """One warning naming the files of `split` above the pixel limit (and under the refusal)."""
    if not large:
        return
    named = ", ".join(f"{os.path.join(root, rel)} ({pixels:,} pixels)" for rel, pixels in large[:shown])
    more = f" and {len(large) - shown} more" if len(large) > shown else ""
    warnings.warn(f"{len(large)} image(s) of {split}/ above --data.max_image_pixels ({limit:,}): {named}{more}. "
                  "Each decode of such a file takes that many pixels of memory in a loader worker; twice the limit "
                  "is refused. Downscale them, or raise --data.max_image_pixels to silence this.", stacklevel=3)


def use_in_pillow(limit: int | None) -> None:
    """Make Pillow's own check (every PIL decode of this process) use `limit`; loader workers take it from
    `WorkerInit` (datamodules/processes/loader_workers.py), since a fork server's or a spawned worker imports a fresh
    Pillow."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        from datamodules.errors import DataError

        raise DataError(f"data.max_image_pixels must be a whole number of pixels >= 1, or null for no limit; got "
                        f"{limit!r} (Pillow's default: {PILLOW_MAX_IMAGE_PIXELS:,}).")
    Image.MAX_IMAGE_PIXELS = limit
