"""Region decode through the libjpeg-turbo that Pillow already ships: region_libjpeg.c, built once per machine.

The C file (60 lines: the region loop and libjpeg's error handling, which must `longjmp` and so cannot be written
with ctypes alone) is compiled on first use with the machine's C compiler ($CC, else cc, gcc or clang) against
libjpeg-turbo's public headers (third_party/libjpeg-turbo: no development package needed) and Pillow's own libjpeg
(the `pillow.libs` of its Linux wheels, `PIL/.dylibs` of its macOS wheels, else the libjpeg.so.62 a source build
of Pillow loaded). The library lands in the cache ($XDG_CACHE_HOME or ~/.cache, fast-image-classifier/region-jpeg,
named by a hash of the sources, the libjpeg and the machine's architecture: a new Pillow builds anew; a machine
without a compiler loads what one with a compiler built into a shared home), written under a temporary
name and renamed, so a process that finds it finds it whole. ctypes releases the GIL during the call
(Modules/_ctypes/callproc.c, `_call_function_pointer`: Py_BEGIN_ALLOW_THREADS unless the library is a PyDLL), so
sample threads decode side by side.

Where there is no compiler (a slim container image), no libjpeg of Pillow's or the build fails, `load` returns None
and `why_not` says why: region.py then takes nvImageCodec, or decodes every file whole.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("region_libjpeg.c")
HEADERS = Path(__file__).resolve().parents[2] / "third_party" / "libjpeg-turbo"
NAME = "Pillow's libjpeg-turbo"

MARGIN = 128  # bytes the decoder may write before and after a region (the columns back to the iMCU boundary: at most
# 32 pixels, and one more on each side; region_libjpeg.c checks)
why_not = ""  # why `load` found no library, for the end-of-run line


def pillow_libjpeg() -> str | None:
    """The path of the libjpeg Pillow decodes with, where it is a library of its own (not on Windows: linked in)."""
    import PIL
    from PIL import Image  # noqa: F401 - loads PIL._imaging and with it the libjpeg it links

    here = Path(PIL.__file__).resolve().parent
    for pattern in (str(here.parent / "pillow.libs" / "libjpeg*.so*"), str(here / ".dylibs" / "libjpeg*.dylib")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    try:  # a Pillow built from source: the ABI 62 libjpeg mapped into this process
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if re.fullmatch(r"libjpeg\.so\.62(\.\d+)*", os.path.basename(path)):
                    return path
    except OSError:
        pass
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fast-image-classifier" / "region-jpeg"


def _build(libjpeg: str, compiler: str) -> Path | None:
    """The compiled library for `libjpeg` (built now unless cached), or None with `why_not` set."""
    global why_not
    digest = hashlib.sha256()
    for part in (SOURCE, *sorted(HEADERS.glob("*.h"))):
        digest.update(part.read_bytes())
    stat = os.stat(libjpeg)
    digest.update(f"{os.path.realpath(libjpeg)}:{stat.st_size}:{stat.st_mtime_ns}:{platform.machine()}".encode())
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"fast-image-classifier-{os.getuid()}"):
        target = folder / f"region_libjpeg-{digest.hexdigest()[:20]}{suffix}"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # a read-only home: the temporary folder
        temporary = folder / f".{target.name}.{os.getpid()}.tmp"
        command = [compiler, "-O2", "-shared", "-fPIC", "-I", str(HEADERS), str(SOURCE), libjpeg,
                   f"-Wl,-rpath,{os.path.dirname(libjpeg)}", "-o", str(temporary)]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            why_not = f"{compiler} did not run ({error})"
            return None
        if done.returncode != 0:
            temporary.unlink(missing_ok=True)
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            why_not = f"{compiler} could not build {SOURCE.name}: {last}"
            return None
        os.replace(temporary, target)
        return target
    why_not = f"no writable folder for the compiled library ({_cache_dir()})"
    return None


class LibjpegRegion:
    """Decodes a region of a JPEG through the compiled library (`load`)."""

    name = NAME

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._decode = library.region_decode
        self._decode.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        self._decode.restype = ctypes.c_int

    def decode(self, data: bytes | bytearray | memoryview | torch.Tensor, region: tuple[int, int, int, int]
               ) -> torch.Tensor | None:
        """RGB uint8 CHW (a view of HWC memory) of `region` (top, left, bottom, right), or None when libjpeg-turbo
        refuses or warns (the full decode then decodes the file or names its error)."""
        array = data.numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, np.uint8)
        if len(array) < 2 or array[-2] != 0xFF or array[-1] != 0xD9:
            return None  # no end-of-image marker: truncated, or bytes after it (what the full decode says of them)
        top, left, bottom, right = region
        size = (bottom - top) * (right - left) * 3
        buffer = torch.empty(MARGIN + size + MARGIN, dtype=torch.uint8)
        if self._decode(array.ctypes.data, len(array), top, left, bottom, right, buffer.data_ptr() + MARGIN,
                        MARGIN) != 0:
            return None
        return buffer[MARGIN:MARGIN + size].view(bottom - top, right - left, 3).permute(2, 0, 1)


def load() -> LibjpegRegion | None:
    """The region decoder over Pillow's libjpeg-turbo, built here if need be; None (and `why_not`) where it cannot."""
    global why_not
    libjpeg = pillow_libjpeg()
    if libjpeg is None:
        why_not = "Pillow's libjpeg was not found as a library of its own"
        return None
    compiler = _compiler()
    if compiler is None:
        why_not = "no C compiler (cc, gcc or clang; or $CC) to build it"
        return None
    built = _build(libjpeg, compiler)
    if built is None:
        return None
    try:
        library = ctypes.CDLL(str(built))
    except OSError as error:
        why_not = f"{built} did not load ({error})"
        return None
    if library.region_probe() != 1:
        why_not = f"{libjpeg} is not the libjpeg ABI 62 of third_party/libjpeg-turbo's headers"
        return None
    return LibjpegRegion(library)
