"""Reading one image file: cheap validity checks and a decode that always gives RGB.

Every PIL-based backend decodes through `decode_rgb`, so the same file gives the same
pixels whichever backend reads it.
"""
from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageOps

from datamodules.sample.pixel_limit import PILLOW_MAX_IMAGE_PIXELS, header_pixels, over_limit

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"P6", "ppm"),
    (b"P5", "ppm"),
)


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def sniff_format(head: bytes) -> str | None:
    """The image format from a file's first bytes, whatever its name says."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, fmt in _MAGIC:
        if head.startswith(magic):
            return fmt
    return None


def check_bytes(head: bytes, tail: bytes, size: int) -> str | None:
    """Why an encoded image is unusable (cheap checks only), or None if it looks fine.

    `head` and `tail` are the first and last few hundred bytes. Catches what kills a DALI
    pipeline or a worker: empty files, non-images named .jpg, truncated JPEG and PNG.
    """
    if size == 0:
        return "empty file (0 bytes)"
    fmt = sniff_format(head)
    if fmt is None:
        return f"not an image file (starts with {head[:8]!r})"
    # A complete JPEG ends with the end-of-image marker FF D9; some cameras append padding,
    # so look for it near the end rather than exactly at it.
    if fmt == "jpeg" and b"\xff\xd9" not in tail:
        return "truncated JPEG (no end-of-image marker FF D9)"
    if fmt == "png" and b"IEND" not in tail:
        return "truncated PNG (no IEND chunk)"
    return None


def check_file(path: str | os.PathLike, probe: int = 1024,
               max_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS) -> str | None:
    """`check_bytes` on a file, reading only its first and last `probe` bytes, then its pixel count from the header
    against twice `max_pixels` (datamodules/sample/pixel_limit.py)."""
    return check_image(path, probe, max_pixels)[0]


def check_image(path: str | os.PathLike, probe: int = 1024,
                max_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS) -> tuple[str | None, int | None]:
    """(`check_file`'s reason or None, the pixel count its header gives or None)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(probe)
            if size > probe:
                f.seek(size - probe)
                tail = f.read(probe)
            else:
                tail = head
    except OSError as e:
        return f"unreadable ({e.strerror or e})", None
    reason = check_bytes(head, tail, size)
    if reason is not None:
        return reason, None
    pixels = header_pixels(path, head, sniff_format(head)) if max_pixels is not None else None
    return over_limit(pixels, max_pixels), pixels


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: grayscale, palette, CMYK, alpha (dropped), 16-bit."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit grayscale: PIL's convert("L") would clip everything above 255 to white.
        arr = np.asarray(img, dtype=np.uint32) >> 8
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), mode="L")
    elif img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        scale = 255.0 if arr.max(initial=0) <= 1.0 else 1.0
        img = Image.fromarray(np.clip(arr * scale, 0, 255).astype(np.uint8), mode="L")
    return img.convert("RGB")


def decode_rgb(source: str | os.PathLike | bytes | memoryview) -> Image.Image:
    """Decode a file path or encoded bytes to an RGB image, EXIF orientation applied."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    with Image.open(source) as img:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of the decoded image
        return to_rgb(img)
