"""Region decode through the libjpeg-turbo that Pillow already ships: region_libjpeg.c, built once per machine.

The C file (the region loop and libjpeg's error handling, which must `longjmp` and so cannot be written with ctypes
alone) is compiled with the machine's C compiler ($CC, else cc, gcc or clang) against libjpeg-turbo's public headers
(third_party/libjpeg-turbo: no development package needed) and Pillow's own libjpeg (the `pillow.libs` of its Linux
wheels, `PIL/.dylibs` of its macOS ones, else the libjpeg.so.62 a source build of Pillow loaded). The library lands
in the cache ($XDG_CACHE_HOME or ~/.cache, fast-image-classifier/region-jpeg), named by a hash of the sources, the
compile flags, the libjpeg and the machine's architecture (a new Pillow builds anew; a machine without a compiler
loads what one with a compiler built into a shared home), written under a unique temporary name and renamed, so a
process that finds it finds it whole. Where the cache cannot be written, it is built into a private temporary
folder for this process alone.

Only a process that is not a loader worker builds (`load(build=True)`): the training process finds the decoder when
it plans a train loader (datamodules/loaders.py), before any worker starts, and a worker loads what is cached, so a
missing or hanging compiler costs one attempt, not one per worker. Before the library is used, it decodes regions of
a few small JPEGs (4:2:0, 4:2:2, 4:4:4, grayscale; boxes at the borders, 1-pixel rows and columns) and must give the
full decode's pixels (decode.py, torchvision's libjpeg-turbo), else it is not used: an older libjpeg-turbo of a
source-built Pillow whose upsampling rounds differently never gives a sample other pixels.

ctypes releases the GIL during the call (Modules/_ctypes/callproc.c, `_call_function_pointer`: Py_BEGIN_ALLOW_THREADS
unless the library is a PyDLL), so sample threads decode side by side. Where there is no compiler (a slim container
image), no libjpeg of Pillow's or the build fails, `load` returns None and `why_not` says why: region.py then takes
nvImageCodec, or decodes every file whole.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import io
import os
import platform
import re
import shlex
import shutil
import signal
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
BUILD_SECONDS = 120
why_not = ""  # why `load` found no library, for the end-of-run line


def pillow_libjpeg() -> str | None:
    """The path of the libjpeg Pillow decodes with, where it is a library of its own (not on Windows: linked in)."""
    import PIL
    from PIL import Image  # noqa: F401 - loads PIL._imaging and with it the libjpeg it links

    here = Path(PIL.__file__).resolve().parent
    # auditwheel's folder is named after the distribution: pillow.libs, Pillow.libs before Pillow 10.2
    for pattern in (str(here.parent / "[pP]illow.libs" / "libjpeg*.so*"), str(here / ".dylibs" / "libjpeg*.dylib")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    try:  # a Pillow built from source: the ABI 62 libjpeg mapped into this process
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if re.fullmatch(r"libjpeg(-[0-9a-f]+)?\.so\.62(\.\d+)*", os.path.basename(path)):
                    return path
    except OSError:
        pass
    return None


def _compiler() -> list[str] | None:
    """The C compiler's command ($CC may hold arguments: "ccache gcc")."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fast-image-classifier" / "region-jpeg"


def _command(compiler: list[str], libjpeg: str, output: str) -> list[str]:
    return [*compiler, "-O2", "-shared", "-fPIC", "-I", str(HEADERS), str(SOURCE), libjpeg,
            f"-Wl,-rpath,{os.path.dirname(libjpeg)}", "-o", output]


def _cached_name(libjpeg: str) -> str:
    digest = hashlib.sha256()
    for part in (SOURCE, *sorted(HEADERS.glob("*.h"))):
        digest.update(part.read_bytes())
    stat = os.stat(libjpeg)
    flags = _command(["cc"], libjpeg, "")[1:]  # the flags, not the compiler: any C compiler builds the same library
    digest.update(f"{flags}:{os.path.realpath(libjpeg)}:{stat.st_size}:{stat.st_mtime_ns}:{platform.machine()}"
                  .encode())
    return f"region_libjpeg-{digest.hexdigest()[:20]}{'.dylib' if sys.platform == 'darwin' else '.so'}"


def _compile(compiler: list[str], libjpeg: str, folder: Path, name: str) -> Path | None:
    """Compiles into `folder` under a unique temporary name, then renames it to `name`; None with `why_not` set."""
    global why_not
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(handle)
    try:
        # its own session: on a timeout the whole group goes (cc's cc1, as and ld too, not only the driver)
        process = subprocess.Popen(_command(compiler, libjpeg, temporary), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as error:
        os.unlink(temporary)
        why_not = f"{shlex.join(compiler)} did not run ({error})"
        return None
    try:
        _, errors = process.communicate(timeout=BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        os.unlink(temporary)
        why_not = f"{shlex.join(compiler)} did not finish building {SOURCE.name} in {BUILD_SECONDS} s"
        return None
    if process.returncode != 0:
        os.unlink(temporary)
        last = (errors.strip().splitlines() or ["no message"])[-1]
        why_not = f"{shlex.join(compiler)} could not build {SOURCE.name}: {last}"
        return None
    target = folder / name
    os.replace(temporary, target)  # another process may have put the same library there first: either is whole
    return target


def _library(libjpeg: str, build: bool) -> ctypes.CDLL | None:
    """The library from the cache, built first if need be (and `build`); a cached one that does not load or pass is
    built again, once."""
    global why_not
    compiler = _compiler()
    name = _cached_name(libjpeg)
    cached = _cache_dir() / name
    if cached.exists():
        library = _open(cached, libjpeg)
        if library is not None or not build:
            return library
    if not build:
        why_not = f"no library built in {_cache_dir()} (a loader worker only loads what the training process built)"
        return None
    if compiler is None:
        why_not = "no C compiler (cc, gcc or clang; or $CC) to build it"
        return None
    try:
        _cache_dir().mkdir(parents=True, exist_ok=True)
        built = _compile(compiler, libjpeg, _cache_dir(), name)
    except OSError:  # a cache folder that cannot be written: a private one, for this process alone
        built = _compile(compiler, libjpeg, Path(tempfile.mkdtemp(prefix="fast-image-classifier-")), name)
    return None if built is None else _open(built, libjpeg)


def _open(path: Path, libjpeg: str) -> ctypes.CDLL | None:
    global why_not
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        why_not = f"{path} did not load ({error})"
        return None
    if library.region_probe() != 1:
        why_not = f"{libjpeg} is not the libjpeg ABI 62 of third_party/libjpeg-turbo's headers"
        return None
    return library


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


def _same_pixels(decoder: LibjpegRegion) -> str | None:
    """None when the decoder gives the full decode's pixels on a few small JPEGs, else the first box that differs."""
    from PIL import Image

    from datamodules.sample.decode import decode

    rng = np.random.default_rng(0)
    pixels = np.clip(np.kron(rng.integers(0, 255, (6, 8, 3)), np.ones((6, 6, 1))) + rng.integers(-20, 20, (36, 48, 3)),
                     0, 255).astype(np.uint8)
    for name, mode, subsampling in (("4:2:0", "RGB", 2), ("4:2:2", "RGB", 1), ("4:4:4", "RGB", 0), ("gray", "L", 0)):
        out = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(out, "JPEG", quality=90, subsampling=subsampling)
        data = bytearray(out.getvalue())
        full = decode(data)
        for box in ((0, 0, 36, 48), (0, 16, 1, 48), (35, 0, 36, 32), (5, 17, 29, 47), (13, 31, 14, 48), (1, 0, 35, 16)):
            top, left, bottom, right = box
            got = decoder.decode(data, box)
            if got is None or not torch.equal(got, full[:, top:bottom, left:right]):
                return f"{name} box {box}"
    return None


def load(build: bool = True) -> LibjpegRegion | None:
    """The region decoder over Pillow's libjpeg-turbo, built here if need be and `build`; None (and `why_not`) where
    it cannot be had. Never raises: any failure is a reason in `why_not`."""
    global why_not
    try:
        libjpeg = pillow_libjpeg()
        if libjpeg is None:
            why_not = "Pillow's libjpeg was not found as a library of its own"
            return None
        library = _library(libjpeg, build)
        if library is None:
            return None
        decoder = LibjpegRegion(library)
        differs = _same_pixels(decoder)
        if differs is not None:
            why_not = f"{libjpeg} does not give the full decode's pixels ({differs})"
            return None
        return decoder
    except Exception as error:  # noqa: BLE001 - an optional speed-up: it says why, and the rest decode whole
        why_not = f"{type(error).__name__}: {error}"
        return None
