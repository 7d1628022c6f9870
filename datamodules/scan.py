"""The walk of one split of an ImageFolder tree: every class folder listed, every file checked (head and tail), on
SCAN_THREADS threads; the samples, the bad files and the empty classes it found (datamodules/index.py makes the
Index of them). At ImageNet scale it is I/O: one stat, two small reads per file, mostly waiting on the disk (or the
network); the calls release the GIL. `python -m bench.scanbench` measures files/s on a generated tree."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from datamodules.sample.images import check_image, is_image_name
from datamodules.sample.pixel_limit import PILLOW_MAX_IMAGE_PIXELS, above_warning

# Reads in flight: a local disk gains little past 4 and more threads contend for the GIL; 8 keeps a
# deeper queue for network storage, whose latency threads hide (python -m bench.scanbench measures yours).
SCAN_THREADS = 8
SCAN_CHUNK = 256  # files per thread task: per-file futures would cost more than a cached stat


def scan_files(root: str, split: str, classes: list[str], check: bool, threads: int = SCAN_THREADS,
               progress: bool | None = None, folders: dict[str, int] | None = None,
               max_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS,
               ) -> tuple[list[tuple[str, int]], list[tuple[str, str]], list[str], list[tuple[str, int]]]:
    """(samples, bad files with their reasons, empty classes, files above the pixel limit's warning with their pixels)
    of ROOT/split: every class folder listed, then every file checked (its pixels read from its header against
    `max_pixels`: datamodules/sample/pixel_limit.py), both on `threads` threads; train/ class by class, val/
    interleaved by class.
    `folders` gets {folder: mtime_ns} of every folder entered (the cache's key)."""
    t0 = time.perf_counter()
    folders = {} if folders is None else folders
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="scan") as pool:
        listings = list(pool.map(lambda name: sorted(_walk_images(os.path.join(root, split, name), folders)),
                                 classes))
        paths = [p for files in listings for p in files]
        reasons: list[str | None] = [None] * len(paths)
        pixels: list[int | None] = [None] * len(paths)
        if check:
            with _progress(len(paths), f"index {split}/", progress) as bar:
                def check_chunk(start: int) -> None:
                    for k in range(start, min(start + SCAN_CHUNK, len(paths))):
                        reasons[k], pixels[k] = check_image(paths[k], max_pixels=max_pixels)
                    bar.update(min(SCAN_CHUNK, len(paths) - start))

                list(pool.map(check_chunk, range(0, len(paths), SCAN_CHUNK)))
    per_class: list[list[tuple[str, int]]] = []
    bad, empty, large, k = [], [], [], 0
    for label, (name, files) in enumerate(zip(classes, listings, strict=False)):
        if not files:
            empty.append(name)
        kept = []
        for path in files:
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if above_warning(pixels[k], max_pixels):
                large.append((rel, pixels[k]))
            if reasons[k]:
                bad.append((rel, reasons[k]))
            else:
                kept.append((rel, label))
            k += 1
        per_class.append(kept)
    samples = [s for kept in per_class for s in kept] if split == "train" else interleave(per_class)
    seconds = time.perf_counter() - t0
    if check and seconds > 5 and not _tty(progress):  # one line in a log instead of a bar
        print(f"indexed {len(paths)} files of {os.path.join(root, split)} in {seconds:.0f} s "
              f"({len(paths) / seconds:,.0f} files/s, {threads} threads)", file=sys.stderr)
    return samples, bad, empty, large


def interleave(per_class: list[list[tuple[str, int]]]) -> list[tuple[str, int]]:
    """Round-robin over the classes: the first sample of each class, then the second of each, and so on."""
    longest = max((len(kept) for kept in per_class), default=0)
    return [kept[i] for i in range(longest) for kept in per_class if i < len(kept)]


def _tty(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _progress(total: int, desc: str, progress: bool | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="file", disable=not _tty(progress) or total < 10_000,
                mininterval=0.5, dynamic_ncols=True, leave=False)


def _walk_images(folder: str, folders: dict[str, int]):
    folders[folder] = os.stat(folder).st_mtime_ns  # before listing: a change made during the walk shows later
    for entry in os.scandir(folder):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from _walk_images(entry.path, folders)
        elif entry.is_file() and is_image_name(entry.name):
            yield entry.path
