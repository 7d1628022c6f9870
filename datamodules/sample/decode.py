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
metadata (Image.getexif); torchvision does not, so a JPEG whose XMP packet names a turning orientation takes the PIL
path (jpeg_header.py).
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

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.sample.images import decode_rgb
from datamodules.sample.jpeg_header import jpeg_frame
from datamodules.sample.pixel_limit import refused_by_pillow

_SOF_FAST = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive (Huffman)


def fast_jpeg(data: bytes | bytearray | memoryview) -> tuple[bool, bool]:
    """(whether libjpeg-turbo may decode `data` with PIL's pixels, whether it carries EXIF)."""
    frame = jpeg_frame(data)
    if frame is None:
        return False, False
    if frame.xmp:
        return False, frame.exif  # PIL may take the orientation its XMP packet names
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
