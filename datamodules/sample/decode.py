"""Decode: encoded bytes -> RGB uint8 CHW tensor, with the same pixels whichever decoder runs.

Plain 8-bit JPEGs (baseline or progressive, 1 or 3 components: grayscale or YCbCr) go to
libjpeg-turbo through `torchvision.io.decode_jpeg`, straight to a uint8 tensor (a CHW view of
HWC memory: the layout the channels-last resize kernel wants). Everything else takes the PIL
path of `images.decode_rgb`: CMYK and YCCK (4 components), 12-bit and lossless JPEGs, PNG
(16-bit too), palette images, a PNG named .JPEG, and any JPEG the fast decoder refuses.

Why the pixels agree: Pillow and torchvision both decode with libjpeg-turbo's defaults (islow
IDCT, fancy upsampling), and libjpeg's grayscale -> RGB replicates the gray value as PIL's
convert("RGB") does. EXIF orientation is applied by torchvision (`apply_exif_orientation`,
the same 8 cases as PIL's ImageOps.exif_transpose). Pillow also reads an orientation from XMP
metadata (Image.getexif); torchvision does not, so a JPEG with an XMP packet takes the PIL path.
tests/test_sample_path.py asserts identical pixels on the odd-image set, all 8 orientations and
built-in ImageNet-size images.

torchvision 0.29 deprecates its image decoders (a DeprecationWarning on every call, hidden by
Python's default filters) in favour of TorchCodec >= 0.16, which wraps the same libjpeg-turbo:
this module's one `decode_jpeg` call is the line to move when torchvision drops them.

`torchvision.io.decode_jpeg` calls `torch.ops.image.decode_jpeg`, and torch releases the GIL
while a `torch.ops` operator runs (torch/csrc/jit/python/pybind_utils.h, invokeOperatorFromPython:
`pybind11::gil_scoped_release`), so several threads decode at once.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.sample.images import decode_rgb
from datamodules.sample.pixel_limit import refused_by_pillow

_SOF_FAST = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive (Huffman)
_XMP = b"http://ns.adobe.com/xap/1.0/"


class JpegFrame(NamedTuple):
    """What a JPEG's markers say before its scan: enough to judge a decoder and draw a crop box."""

    sof: int  # the frame marker's second byte (0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...)
    precision: int
    components: int
    height: int
    width: int
    exif: bool  # an EXIF APP1 segment
    orientation: int  # its orientation tag (1 when absent)
    xmp: bool  # an XMP packet before the frame header (PIL may take an orientation from it)
    mcu_height: int = 8  # the MCU: 8 x 8 for one component, 8 x the largest sampling factors for several
    mcu_width: int = 8


def jpeg_frame(data: bytes | bytearray | memoryview) -> JpegFrame | None:
    """The frame header of a JPEG and what comes before it, or None when `data` is no JPEG this walk can read.

    Walks the JPEG markers up to the frame header (a few hundred bytes for most files).
    """
    mv = memoryview(data)
    n = len(mv)
    if n < 4 or mv[0] != 0xFF or mv[1] != 0xD8:
        return None
    exif, orientation, xmp = False, 1, False
    i = 2
    while i + 4 <= n:
        if mv[i] != 0xFF:
            return None
        marker = mv[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = (mv[i + 2] << 8) | mv[i + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header (SOFn)
            components = mv[i + 9] if i + 10 <= n else 0
            if i + 10 + 3 * components > n:
                return None
            factors = [mv[i + 11 + 3 * c] for c in range(components)]  # (horizontal << 4) | vertical
            many = components > 1  # a single component's MCU is one block, whatever its factors (ITU T.81, A.2.2)
            return JpegFrame(marker, mv[i + 4], components, (mv[i + 5] << 8) | mv[i + 6],
                             (mv[i + 7] << 8) | mv[i + 8], exif, orientation, xmp,
                             8 * max(f & 15 for f in factors) if many else 8,
                             8 * max(f >> 4 for f in factors) if many else 8)
        if marker == 0xE1:
            head = bytes(mv[i + 4:i + 4 + len(_XMP)])
            if head.startswith(b"Exif\x00"):
                exif = True
                orientation = _exif_orientation(mv[i + 10:i + 2 + length])
            elif head == _XMP:
                xmp = True
        if marker == 0xDA:  # scan data before a frame header
            return None
        i += 2 + length
    return None


def _exif_orientation(tiff: memoryview) -> int:
    """The orientation tag (0x0112) of IFD0 in an EXIF TIFF block, 1 when absent or unreadable."""
    if len(tiff) < 8 or bytes(tiff[:2]) not in (b"II", b"MM"):
        return 1
    order = "little" if bytes(tiff[:2]) == b"II" else "big"

    def u(at: int, size: int) -> int:
        return int.from_bytes(tiff[at:at + size], order)

    ifd = u(4, 4)
    if ifd + 2 > len(tiff):
        return 1
    for k in range(u(ifd, 2)):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            return 1
        if u(entry, 2) == 0x0112:
            return u(entry + 8, 2) if u(entry + 2, 2) == 3 else 1  # type SHORT
    return 1


def fast_jpeg(data: bytes | bytearray | memoryview) -> tuple[bool, bool]:
    """(whether libjpeg-turbo may decode `data` with PIL's pixels, whether it carries EXIF)."""
    frame = jpeg_frame(data)
    if frame is None:
        return False, False
    if frame.xmp:
        return False, frame.exif  # PIL may take an orientation from XMP
    ok = (frame.sof in _SOF_FAST and frame.precision == 8 and frame.components in (1, 3)
          and not refused_by_pillow(frame.width, frame.height))  # PIL raises its DecompressionBombError
    return ok, frame.exif


def pil_decode(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The reference path: `decode_rgb` (EXIF applied, any mode to RGB) as a uint8 CHW tensor."""
    return torch.from_numpy(np.array(decode_rgb(bytes(data)))).permute(2, 0, 1)


def decode(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """Encoded image -> RGB uint8 CHW tensor (EXIF orientation applied), libjpeg-turbo where it is exact."""
    if isinstance(data, torch.Tensor):
        tensor = data
        data = memoryview(data.numpy())
    else:
        tensor = None
    ok, exif = fast_jpeg(data)
    if ok:
        if tensor is None:
            # torch.frombuffer warns on a read-only buffer (bytes, an LMDB value's memory map:
            # torch/csrc/utils/tensor_new.cpp, tensor_frombuffer); a copy costs little beside the decode
            read_only = not isinstance(data, bytearray) and (not isinstance(data, memoryview) or data.readonly)
            tensor = torch.frombuffer(bytearray(data) if read_only else data, dtype=torch.uint8)
        try:
            return decode_jpeg(tensor, mode=ImageReadMode.RGB, apply_exif_orientation=exif)
        except RuntimeError:
            pass  # refused (corrupt, unsupported): PIL decodes it or raises a clear error
    return pil_decode(data)
