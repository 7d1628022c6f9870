"""Region decode through nvImageCodec's CPU backend: the `nvidia.nvimgcodec` module of the `nvidia-nvimgcodec-cu13`
or `-cu12` wheel (DALI installs it).

It runs libjpeg-turbo with the defaults of torchvision's and PIL's decoders (islow IDCT, fancy upsampling), so a
region's pixels are the full decode's pixels. How a region is made exact (nvImageCodec 0.9,
extensions/libjpeg_turbo/jpeg_mem.cpp, `UncompressLow`): it asks libjpeg-turbo for one column more on each inner
side than the region (`left_cor`, `right_cor`), so the chroma upsampling reads the same neighbours as in the full
image; `jpeg_crop_scanline` starts the decode at an MCU boundary, and `jpeg_skip_scanlines` keeps the context rows
of the vertical upsampling. It decodes each row into a buffer of its own and copies it twice (into its image, then
into the output), which region_libjpeg.py does not.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

PIP_LINE = "pip install nvidia-nvimgcodec-cu13"  # -cu12 beside a CUDA 12 torch (DALI's requirements bring it)
NAME = "nvImageCodec"


class NvImageCodecRegion:
    """Decodes a region of a JPEG with nvImageCodec's CPU-only decoder, one per thread."""

    name = NAME

    def __init__(self, module: Any) -> None:
        self.module = module
        self.params = module.DecodeParams(apply_exif_orientation=False, color_spec=module.SRGB,
                                          sample_format=module.I_RGB)
        self._local = threading.local()

    def _decoder(self) -> Any:
        """This thread's CPU-only decoder. It decodes on the calling thread (it starts none: a worker forked after
        the training process decoded keeps using it); one per thread, as nothing says one may serve two at once."""
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            nv = self.module
            decoder = self._local.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                                       backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
        return decoder

    def decode(self, data: bytes | bytearray | memoryview | torch.Tensor, region: tuple[int, int, int, int]
               ) -> torch.Tensor | None:
        """RGB uint8 CHW (a view of HWC memory, as decode.py's) of `region` (top, left, bottom, right), or None
        when nvImageCodec refuses the file (the full decode then decides: it decodes it or names the error)."""
        nv = self.module
        array = data.numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, np.uint8)
        stream = nv.CodeStream(array).get_sub_code_stream(region=nv.Region(*region))
        image = self._decoder().decode(stream, params=self.params)
        if image is None:
            return None
        # the host image's array interface (no copy; DLPack would ask the CUDA runtime, absent on a CPU-only machine)
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


def load() -> NvImageCodecRegion | None:
    """The decoder, or None where nvImageCodec is not installed (0.2 s of import: called once a train crop needs it)."""
    # A file it refuses (a truncated JPEG) takes the full decode, which decodes it or names the error, and is
    # counted: its own error and warning on stderr for each such file would only repeat that (read on import).
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None
    return NvImageCodecRegion(nvimgcodec)
