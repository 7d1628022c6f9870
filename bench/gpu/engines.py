"""`bench gpu --groups engines`: the hardware JPEG decoder, and how fast the decode goes with nothing else running.

Rows: the number of hardware JPEG engines (nvJPEG's `nvjpegGetHardwareDecoderInfo`, through ctypes on the
libnvjpeg this process has loaded: torchvision's own copy, else the one of the nvidia wheels under site-packages);
the batched JPEG call alone (torchvision's `decode_jpeg(list, device=...)`, what `--data.decode gpu` calls) and the
whole device half alone (`DeviceDecode`: the JPEG call, then the crop, resize and flip), each in images/s on
batches of real JPEGs read once, on an idle GPU. On a CPU (--allow-cpu) the same calls run on the CPU path and the
engine count says why there is none.
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import time
from pathlib import Path

import torch

from bench.gpu.checks import Check, Workload, sync

GROUP = "engines"
NAMES = ["hardware JPEG engines", "JPEG call alone", "decode + resize alone"]
# nvjpeg.h (nvidia/cu13/include): nvjpegBackend_t and nvjpegStatus_t
NVJPEG_BACKEND_HARDWARE = 3
STATUS = {1: "NVJPEG_STATUS_NOT_INITIALIZED", 2: "NVJPEG_STATUS_INVALID_PARAMETER",
          4: "NVJPEG_STATUS_JPEG_NOT_SUPPORTED", 5: "NVJPEG_STATUS_ALLOCATOR_FAILURE",
          6: "NVJPEG_STATUS_EXECUTION_FAILED", 7: "NVJPEG_STATUS_ARCH_MISMATCH", 8: "NVJPEG_STATUS_INTERNAL_ERROR",
          9: "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED"}
BATCHES = 4  # distinct batches of files, cycled


def mapped_libraries(piece: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose file name holds `piece`, in map order."""
    found: list[str] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if piece in Path(path).name and path not in found:
                found.append(path)
    return found


def nvjpeg_library() -> str | None:
    """The libnvjpeg torchvision's decode uses (loaded with torchvision.io's image extension), else one under
    site-packages: the nvidia wheels' (nvidia/*/lib), torchvision's bundled copy."""
    import torchvision.io  # noqa: F401 - loads torchvision's image extension and its libnvjpeg

    loaded = mapped_libraries("libnvjpeg")
    if loaded:
        return loaded[0]
    site = Path(torch.__file__).resolve().parents[1]
    found = sorted(glob.glob(str(site / "nvidia" / "**" / "libnvjpeg.so*"), recursive=True)
                   + glob.glob(str(site / "torchvision.libs" / "libnvjpeg*.so*")))
    return found[0] if found else None


def engine_count() -> tuple[int | None, int | None, str]:
    """(engines, cores per engine, how it was read), or (None, None, why not). The query needs a handle made with
    the hardware backend (nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, ...)), which fails where the GPU has no engine."""
    path = nvjpeg_library()
    if path is None:
        return None, None, "no libnvjpeg here (neither torchvision's nor an nvidia wheel's under site-packages)"
    lib = ctypes.CDLL(path)
    try:
        create, info, destroy = lib.nvjpegCreateEx, lib.nvjpegGetHardwareDecoderInfo, lib.nvjpegDestroy
    except AttributeError as e:
        return None, None, f"{path} has no {e.args[0].split(':')[-1].strip()} (nvJPEG older than CUDA 11.4?)"
    create.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
    info.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)]
    destroy.argtypes = [ctypes.c_void_p]
    create.restype = info.restype = destroy.restype = ctypes.c_int
    handle = ctypes.c_void_p()
    status = create(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
    if status:
        return None, None, (f"nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE) returned {status} ({STATUS.get(status, '?')}) "
                            f"in {path}: no hardware JPEG decoder usable here")
    try:
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        status = info(handle, ctypes.byref(engines), ctypes.byref(cores))
    finally:
        destroy(handle)
    if status:
        return None, None, f"nvjpegGetHardwareDecoderInfo returned {status} ({STATUS.get(status, '?')}) in {path}"
    return engines.value, cores.value, f"nvjpegGetHardwareDecoderInfo on a hardware-backend handle, {path}"


def _files(root: Path, w: Workload, dataset) -> list[list[int]]:
    """BATCHES lists of batch_size sample indices, spread over the train files."""
    n = len(dataset)
    return [[(b * w.batch_size + i) * 7919 % n for i in range(w.batch_size)] for b in range(BATCHES)]


def _timed(call, batches: list, w: Workload, seconds: float) -> tuple[float, float]:
    """(images/s, ms a batch) of `call` over the batches in turn, synchronized, after one untimed round."""
    for batch in batches:
        call(batch)
    sync(w.device)
    t0, images, calls = time.perf_counter(), 0, 0
    for batch in itertools.cycle(batches):
        images += call(batch)
        calls += 1
        if calls >= len(batches) and time.perf_counter() - t0 >= seconds:
            break
    sync(w.device)
    elapsed = time.perf_counter() - t0
    return images / elapsed, elapsed / calls * 1e3


def decode_alone(root: Path, w: Workload) -> tuple[Check, Check]:
    """The batched JPEG call alone, and the whole device half (DeviceDecode) alone, on the train files."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.gpu.input import make_dm
    from datamodules.sample.device_decode import DeviceDecode

    dataset = make_dm(root, w, 0, False, {"decode": "gpu", "cpu_decode_share": 0.0}).datasets["train"]
    indices = _files(root, w, dataset)
    cuda = w.device == "cuda"
    encoded = [[torch.frombuffer(bytearray(dataset.source.read(i)), dtype=torch.uint8) for i in batch]
               for batch in indices]

    def jpeg(batch: list[torch.Tensor]) -> int:
        if cuda:
            return len(decode_jpeg(batch, mode=ImageReadMode.RGB, device=w.device))
        return len(decode_jpeg(batch, mode=ImageReadMode.RGB))

    seconds = 3.0 if cuda else 0.5
    rate, ms = _timed(jpeg, encoded, w, seconds)
    where = "on the GPU (nvJPEG)" if cuda else "on the CPU (libjpeg-turbo: no GPU here)"
    call = Check(GROUP, NAMES[1], "ok", f"torchvision.io.decode_jpeg(a list of {w.batch_size}, device) {where}, "
                 f"{BATCHES} batches of train files in turn, synchronized, nothing else running", rate,
                 f"{rate:,.0f} img/s, {ms:.1f} ms a batch", {"ms_per_batch": ms, "batch_size": w.batch_size})
    packed = [dataset.__getitems__(batch) for batch in indices]
    decoder = DeviceDecode(w.device, dataset.source.describe)
    rate, ms = _timed(lambda batch: int(decoder(batch)[0].shape[0]), packed, w, seconds)
    whole = Check(GROUP, NAMES[2], "ok", f"DeviceDecode on the workers' packed batches (the JPEG call, then the crop, "
                  f"resize and flip to {w.image_size} px) {where}, nothing else running", rate,
                  f"{rate:,.0f} img/s, {ms:.1f} ms a batch", {"ms_per_batch": ms, "batch_size": w.batch_size})
    return call, whole


def engine_rows(root: Path, w: Workload) -> list[Check]:
    engines, cores, how = engine_count()
    count = (Check(GROUP, NAMES[0], "ok", how, None, f"{engines} engines, {cores} cores each",
                   {"engines": engines, "cores_per_engine": cores}) if engines is not None else
             Check(GROUP, NAMES[0], "skipped", how, extra={"engines": None}))  # a GPU without one: said, not failed
    rows = [count, *decode_alone(root, w)]
    for row in rows:
        print(f"engines: {row.name}: {row.figure or row.status}; {row.verdict}", flush=True)
    return rows
