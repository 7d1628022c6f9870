"""Files/s of the Index scan on a generated tree with a cold page cache, and what that means for ImageNet.

    python -m bench.scanbench --dst DIR --files 100000 [--threads 1,16]

DIR must be on the disk being measured: on a tmpfs (often /tmp) nothing is ever cold.

Makes the tree once (cheap: every file is the same small valid JPEG, so 100k files are 100k
small writes, seconds on a local disk), then for each thread count evicts the files' pages with
posix_fadvise(DONTNEED) (as `bench loaders` does; directory entries and inodes may stay cached,
so this is a lower bound of a truly cold start) and times one uncached scan.
"""
from __future__ import annotations

import argparse
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

IMAGENET_TRAIN_FILES = 1_281_167


def make_tree(dst: Path, files: int, classes: int = 100) -> Path:
    """dst/train/cNNN/NNNNNNN.jpg (and a one-file val/) of `files` identical small JPEGs; kept if already there."""
    marker = dst / f".complete-{files}-{classes}"
    if marker.exists():
        return dst
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 140, 200)).save(buf, format="JPEG")
    data = buf.getvalue()
    def write_class(job: tuple[str, int, int]) -> None:
        split, c, n = job
        folder = dst / split / f"c{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(c, n, classes):
            fd = os.open(folder / f"{i:07d}.jpg", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    # One class folder per task on 8 threads: file creation waits on the file system, not the GIL.
    jobs = [(split, c, n) for split, n in (("train", files), ("val", classes)) for c in range(classes)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write_class, jobs))
    marker.touch()
    return dst


def evict(root: Path, drop_caches: bool = False) -> str:
    """Make the scan cold. posix_fadvise evicts the files' data only; with drop_caches (root), the
    kernel also forgets directory entries and inodes, as after a reboot or on first contact with a share."""
    if drop_caches:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches (data, dentries and inodes)"
        except OSError as e:
            print(f"--drop-caches: not permitted here ({e.strerror}); falling back to posix_fadvise")
    if not hasattr(os, "posix_fadvise"):
        return "none (no posix_fadvise: the numbers are warm)"
    for d, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED)"


def measure(root: Path, threads: int) -> tuple[int, float]:
    from datamodules.index import find_classes, scan_split

    classes = find_classes(root)
    t0 = time.perf_counter()
    index = scan_split(str(root.absolute()), "train", classes, True, threads=threads, progress=False)
    return len(index.samples) + len(index.bad_files), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scanbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dst", type=Path, required=True, help="where the generated tree goes (reused if complete)")
    ap.add_argument("--files", type=int, default=100_000, help="train files to generate (default 100000)")
    ap.add_argument("--threads", default="1,4,16", help="comma-separated scan thread counts to time")
    ap.add_argument("--drop-caches", action="store_true",
                    help="evict everything with /proc/sys/vm/drop_caches (needs root) instead of posix_fadvise")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    root = make_tree(a.dst, a.files)
    print(f"tree: {root} ({a.files} files, ready in {time.perf_counter() - t0:.1f} s)")
    for threads in (int(t) for t in a.threads.split(",")):
        how = evict(root, a.drop_caches)
        n, seconds = measure(root, threads)
        rate = n / seconds
        print(f"{threads:3d} threads: {n} files in {seconds:.2f} s = {rate:,.0f} files/s, cold by {how}; "
              f"ImageNet train ({IMAGENET_TRAIN_FILES:,} files): about {IMAGENET_TRAIN_FILES / rate / 60:.1f} min")


if __name__ == "__main__":
    main()
