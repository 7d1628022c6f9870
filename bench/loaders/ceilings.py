"""The machine's ceilings for a set of files: raw read rate (IO, cold cache) and decode-only rate (CPU, all cores).

A loader cannot read faster than the disk hands out the bytes, nor decode faster than every
core decoding and nothing else; a backend's row is compared with these two numbers.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from bench.loaders.cpu_time import CpuClock
from datamodules.budget.cpus import usable_cpus
from datamodules.sample.images import decode_rgb

READ_BLOCK = 1 << 20


@dataclass
class Ceiling:
    images_s: float
    mb_s: float
    images: int
    seconds: float
    how: str
    cpu_s: float | None = None  # CPU seconds of the decoding processes (cpu_time.py), where known

    def as_dict(self) -> dict:
        return asdict(self)


def evict_pages(paths: Iterable[str], drop_caches: bool = False) -> str:
    """Drop the page cache of ``paths`` so the next read comes from the disk; return how.

    Default: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file, which needs no privilege
    and leaves the rest of the machine's cache alone. ``drop_caches=True`` first tries
    ``echo 1 > /proc/sys/vm/drop_caches`` (root, whole machine) and falls back to fadvise.
    """
    paths = list(paths)
    if drop_caches:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    if not hasattr(os, "posix_fadvise"):
        return "none (no posix_fadvise on this OS: the cold numbers are warm)"
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)" + (" (drop_caches not permitted)" if drop_caches else "")


def files_under(path: str) -> list[str]:
    """Every regular file under ``path`` (or ``path`` itself): what to evict for an LMDB or a tree."""
    if os.path.isfile(path):
        return [path]
    out = []
    for d, _, names in os.walk(path):
        out.extend(os.path.join(d, n) for n in names)
    return out


def _read_file(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(READ_BLOCK)
            if not chunk:
                return n
            n += len(chunk)


def read_rate(paths: Sequence[str], threads: int = 8, drop_caches: bool = False) -> Ceiling:
    """Cold raw read rate: evict, then read every file whole with ``threads`` readers (no decoding)."""
    how = evict_pages(paths, drop_caches)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(_read_file, paths, chunksize=16))
    dt = max(time.perf_counter() - t0, 1e-9)
    return Ceiling(len(paths) / dt, total / dt / 1e6, len(paths), dt, f"cold ({how}), {threads} reader threads")


def _decode_chunk(paths: Sequence[str], decoder: str = "pil") -> tuple[int, int]:
    n = 0
    if decoder == "torchvision":
        import torch

        from datamodules.sample.decode import decode

        torch.set_num_threads(1)  # as in a DataLoader worker
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        if decoder == "torchvision":
            decode(bytearray(data))
        else:
            decode_rgb(data).load()
        n += len(data)
    return len(paths), n


def decode_rate(paths: Sequence[str], workers: int | None = None, decoder: str = "pil", cold: bool = False,
                drop_caches: bool = False) -> Ceiling:
    """Decode-only rate on all usable cores: read and decode to RGB in a pool of one process per CPU.

    ``decoder``: "pil" (`images.decode_rgb`) or "torchvision" (`decode.decode`: libjpeg-turbo to a
    tensor for plain JPEGs, PIL for the rest: the shared sample path's decoder). Warm: the files
    are read once first, so the timing is decoding. Cold: they are evicted first, and each
    process reads its files one at a time before decoding them.
    """
    workers = workers or usable_cpus()
    for p in paths:
        _read_file(p)
    chunk = max(1, min(64, len(paths) // (workers * 4) or 1))
    chunks = [list(paths[i:i + chunk]) for i in range(0, len(paths), chunk)]
    how = "warm cache"
    # forked, as --data.worker_start fork's workers: the cheapest start, and never the interpreter's default (3.14's
    # is forkserver)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        decode = functools.partial(_decode_chunk, decoder=decoder)
        list(pool.map(decode, chunks[:workers]))  # start the workers before the clock
        if cold:
            how = f"cold cache ({evict_pages(paths, drop_caches)})"
        cpu = CpuClock(list(getattr(pool, "_processes", None) or {}) or None)  # {pid: process} (concurrent/futures)
        t0 = time.perf_counter()
        done = list(pool.map(decode, chunks))
        dt = max(time.perf_counter() - t0, 1e-9)
        cpu_s = cpu.seconds()
    images = sum(d[0] for d in done)
    total = sum(d[1] for d in done)
    name = "PIL" if decoder == "pil" else "torchvision (libjpeg-turbo; PIL for non-plain JPEGs)"
    return Ceiling(images / dt, total / dt / 1e6, images, dt, f"{name} decode + RGB, {workers} processes, {how}",
                   cpu_s)


def stage_times(paths: Sequence[str], image_size: int = 224, min_scale: float = 0.25,
                repeats: int = 3) -> dict[str, float]:
    """Microseconds per image of each stage of the shared sample path, on one thread, warm cache.

    Ratios between stages hold on a busy machine too; they say where a backend's time goes.
    Best of `repeats` passes over `paths`. The region decode stages (each region decoder installed here, on the
    boxes `min_scale` draws) are per image of the files that take it.
    """
    import random

    import torch

    from datamodules.sample.batches import new_batch
    from datamodules.sample.crop import TrainCrop
    from datamodules.sample.dataset import FileSource
    from datamodules.sample.decode import decode
    from datamodules.sample.transforms import train_transform

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        source = FileSource(paths, "")
        data = [source.read(i) for i in range(len(paths))]
        images = [decode(d) for d in data]
        crop, rng = TrainCrop(min_scale), random.Random(0)
        crops = [crop(im, image_size, rng) for im in images]
        batch = new_batch(len(paths), image_size)
        pils = [decode_rgb(bytes(d)) for d in data]
        old = train_transform(image_size, min_scale)
        stages = {
            "read (file, warm)": lambda i: source.read(i),
            "decode: sample path (libjpeg-turbo / PIL)": lambda i: decode(data[i]),
            "decode: PIL (decode_rgb)": lambda i: decode_rgb(bytes(data[i])),
            "crop + flip + resize (TrainCrop)": lambda i: crop(images[i], image_size, rng),
            "batch write (one copy into the batch)": lambda i: batch[i].copy_(crops[i]),
            "before: PIL crop + flip + resize + PILToTensor": lambda i: old(pils[i]),
        }
        every = range(len(paths))
        timed = {name: (fn, every) for name, fn in stages.items()} | _region_stages(data, crop, image_size)
        out = {}
        for name, (fn, indices) in timed.items():
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for i in indices:
                    fn(i)
                best = min(best, (time.perf_counter() - t0) / max(1, len(indices)))
            out[name] = best * 1e6
        return out
    finally:
        torch.set_num_threads(threads)


def _region_stages(data: list, crop, image_size: int) -> dict:
    """A region decode stage per decoder found here (datamodules/sample/region.py), each (its call, the files that
    take it): file i's region is the box of the crop seed i draws."""
    import random

    from datamodules.sample import region, region_libjpeg, region_nvimgcodec
    from datamodules.sample.jpeg_header import jpeg_frame

    boxes = {}
    for i, d in enumerate(data):
        frame = jpeg_frame(d)
        if region.region_takes(frame):
            plan = crop.plan(frame.height, frame.width, image_size, random.Random(i))
            boxes[i] = region.region_of(frame, plan.top, plan.left, plan.height, plan.width)
    stages = {}
    for decoder in (region_libjpeg.load(), region_nvimgcodec.load()):
        if decoder is not None and boxes:
            stages[f"decode: region ({decoder.name}; {len(boxes)} of the files)"] = (
                lambda i, d=decoder: d.decode(data[i], boxes[i]), list(boxes))
    return stages
