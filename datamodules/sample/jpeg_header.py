"""A JPEG's frame header, read without decoding: size, components, MCU, precision, EXIF orientation, XMP.

A leaf module (no torch): the start-up scan's pixel limit (pixel_limit.py), the decode (decode.py) and the
region decode (region.py) all read it.
"""
from __future__ import annotations

import re
from typing import NamedTuple

_XMP = b"http://ns.adobe.com/xap/1.0/"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # Pillow's pattern (PIL/Image.py, Image.getexif)


class JpegFrame(NamedTuple):
    """What a JPEG's markers say before its scan: enough to judge a decoder and draw a crop box."""

    sof: int  # the frame marker's second byte (0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...)
    precision: int
    components: int
    height: int
    width: int
    exif: bool  # an EXIF APP1 segment
    orientation: int  # its orientation tag (1 when absent)
    xmp: bool  # an XMP packet before the frame header that names a turning orientation (PIL may take it from there)
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
            elif head == _XMP:  # Pillow's Image.getexif takes the orientation from there (without one in EXIF)
                named = _XMP_ORIENTATION.search(bytes(mv[i + 4:i + 2 + length]))
                xmp = xmp or (named is not None and named[2] not in b"01")  # 0 and 1 turn nothing
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
