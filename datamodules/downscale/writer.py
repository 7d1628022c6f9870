"""Write a downscaled copy of an ImageFolder tree: every image's shorter side at most N px.

    python -m datamodules.downscale --src ROOT --dst DIR --max-size N [--quality Q] [--workers N] [--skip-invalid]

Aspect ratio kept, never upscaled, EXIF orientation applied, saved as RGB JPEG at --quality
(a plain RGB JPEG that is already small enough is copied byte for byte). Every output keeps
its source's relative path, so labels and paths match the source tree exactly; empty class
folders are created too.

Each output is written under a temporary name and renamed into place, with its source's
modification time, so a rerun (after an interruption, or after the source changed) redoes
only the files whose source is new or changed. DIR/.downscale.json records the settings
(other settings: everything is redone) and DIR/.complete, written last, says the copy is whole.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from PIL import Image, ImageOps

from datamodules.errors import DataError
from datamodules.index import SPLITS, find_classes, load_indexes
from datamodules.packing import list_bad, parallel_imap, require_source
from datamodules.processes.exits import tool
from datamodules.processes.locks import file_lock
from datamodules.sample.images import check_bytes, is_image_name, to_rgb

PARAMS_FILE = ".downscale.json"
MARKER = ".complete"
FORMAT = "fast-image-classifier-downscaled"

__all__ = ["downscale", "ensure_downscaled", "main", "read_marker", "target_size"]


def target_size(width: int, height: int, max_size: int) -> tuple[int, int]:
    """(width, height) with the shorter side at most max_size, aspect kept, never larger."""
    short = min(width, height)
    if short <= max_size:
        return width, height
    scale = max_size / short
    if width <= height:
        return max_size, max(1, round(height * scale))
    return max(1, round(width * scale)), max_size


def _write_atomic(path: str, data: bytes, mtime_ns: int) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.utime(tmp, ns=(mtime_ns, mtime_ns))  # marks the output as made from this version of the source
    os.replace(tmp, path)


def downscale_file(job: tuple[str, str, int, int]) -> tuple[str, str | None, int, int]:
    """(status: done | skipped | bad, why bad, source bytes, output bytes) for one file."""
    src, out, max_size, quality = job
    try:
        st = os.stat(src)
        try:
            if os.stat(out).st_mtime_ns == st.st_mtime_ns:
                return "skipped", None, st.st_size, 0
        except FileNotFoundError:
            pass
        with open(src, "rb") as f:
            data = f.read()
    except OSError as e:
        return "bad", f"unreadable ({e.strerror or e})", 0, 0
    why = check_bytes(data[:1024], data[-1024:], len(data))
    if why:
        return "bad", why, len(data), 0
    try:
        with Image.open(io.BytesIO(data)) as img:
            orientation = img.getexif().get(0x0112, 1)
            plain = img.format == "JPEG" and img.mode == "RGB" and orientation == 1
            raw_w, raw_h = img.size
            scale = min(1.0, max_size / min(raw_w, raw_h))
            if img.format == "JPEG" and scale < 1:
                # Let libjpeg decode at a reduced scale (DCT scaling), never below the target.
                img.draft(None, (math.ceil(raw_w * scale), math.ceil(raw_h * scale)))
            img = ImageOps.exif_transpose(img)
            img.load()
            img = to_rgb(img)
    except Exception as e:  # noqa: BLE001 - any decoder failure makes the file unusable
        return "bad", f"cannot decode ({type(e).__name__}: {e})", len(data), 0
    if scale == 1 and plain:
        encoded = data
    else:
        shown = (raw_h, raw_w) if orientation in (5, 6, 7, 8) else (raw_w, raw_h)  # these swap the axes
        size = target_size(*shown, max_size)
        if img.size != size:
            img = img.resize(size, Image.LANCZOS, reducing_gap=3.0)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        encoded = buf.getvalue()
    try:
        _write_atomic(out, encoded, st.st_mtime_ns)
    except OSError as e:
        raise OSError(f"cannot write {out}: {e}") from e
    return "done", None, len(data), len(encoded)


def _job(args: tuple[str, str, int, int]) -> tuple[str, str | None, int, int]:
    return downscale_file(args)


def read_marker(dst: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(dst) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _fingerprint(indexes) -> str:
    import hashlib

    # sorted: the copy does not depend on the order the Index lists files in (val is interleaved by class)
    plan = [indexes["train"].classes, {s: sorted(indexes[s].samples) for s in SPLITS}]
    return hashlib.sha1(json.dumps(plan).encode()).hexdigest()


def downscale(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_size: int,
    *,
    quality: int = 90,
    skip_invalid: bool = False,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Make (or bring up to date) the downscaled copy of `src` in `dst` and return `dst`."""
    if max_size < 1:
        raise DataError(f"--max-size must be >= 1, got {max_size}.")
    if not 1 <= quality <= 100:
        raise DataError(f"--quality must be in 1..100, got {quality}.")
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if src == dst or dst.is_relative_to(src):
        raise DataError(f"--dst {dst} must be outside --src {src}.")
    with file_lock(dst.parent / f".{dst.name}.lock"):
        indexes = load_indexes(src)
        fingerprint = _fingerprint(indexes)
        params = {"format": FORMAT, "max_size": max_size, "quality": quality}
        marker = read_marker(dst)
        if marker and marker.get("source_fingerprint") == fingerprint and all(
                marker.get(k) == v for k, v in params.items()) and _unchanged(indexes, dst):
            return dst
        _prepare(dst, params)
        (dst / MARKER).unlink(missing_ok=True)
        classes = indexes["train"].classes
        for split in SPLITS:
            for name in classes:
                (dst / split / name).mkdir(parents=True, exist_ok=True)
        jobs, rels = [], []
        for split in SPLITS:
            for rel, _ in indexes[split].samples:
                out = dst / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                jobs.append((str(src / rel), str(out), max_size, quality))
                rels.append(rel)
        counts = {"done": 0, "skipped": 0}
        good = {split: 0 for split in SPLITS}
        bad = [(rel, why) for s in SPLITS for rel, why in indexes[s].bad_files]
        results = parallel_imap(_job, jobs, workers=workers, desc=f"downscale {max_size}px", progress=progress,
                                nbytes=lambda r: r[2])
        for rel, (status, why, _, _) in zip(rels, results, strict=False):
            if status == "bad":
                bad.append((rel, why))
            else:
                counts[status] += 1
                good[rel.split("/", 1)[0]] += 1
        bad_set = {rel for rel, _ in bad}
        _remove_stale(dst, set(rels) - bad_set)
        if bad and not skip_invalid:
            raise DataError(
                f"{len(bad)} image file(s) of {src} cannot be decoded:\n{list_bad([(src / p, w) for p, w in bad])}\n"
                "Fix or delete them and rerun, or rerun with --skip-invalid to leave them out "
                "(the images done so far are kept and not redone)."
            )
        marker = {**params, "source_root": str(src), "source_fingerprint": fingerprint,
                  "counts": good,
                  "skipped_files": [list(b) for b in bad],
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tmp = dst / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1) + "\n")
        os.replace(tmp, dst / MARKER)
        if progress:
            print(f"{dst}: {counts['done']} written, {counts['skipped']} already up to date, {len(bad)} skipped as "
                  "unreadable", file=sys.stderr)
    return dst


def _unchanged(indexes, dst: Path) -> bool:
    """The fingerprint covers the file list; a source edited in place shows in its mtime (sampled cheaply)."""
    samples = [rel for s in SPLITS for rel, _ in indexes[s].samples]
    step = max(1, len(samples) // 64)
    for rel in samples[::step]:
        try:
            if os.stat(dst / rel).st_mtime_ns != os.stat(Path(indexes["train"].root) / rel).st_mtime_ns:
                return False
        except OSError:
            return False
    return True


def _prepare(dst: Path, params: dict) -> None:
    """Create dst, or clear it when it holds a copy made with other settings (never foreign data)."""
    pfile = dst / PARAMS_FILE
    if dst.exists():
        try:
            old = json.loads(pfile.read_text())
        except (OSError, ValueError):
            old = None
        if old is None:
            if any(dst.iterdir()):
                raise DataError(f"--dst {dst} exists and is not a downscaled copy; choose an empty or new folder.")
        elif old != params:
            for split in SPLITS:
                shutil.rmtree(dst / split, ignore_errors=True)
            (dst / MARKER).unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f"{PARAMS_FILE}.tmp"
    tmp.write_text(json.dumps(params) + "\n")
    os.replace(tmp, pfile)


def _remove_stale(dst: Path, keep: set[str]) -> None:
    """Delete outputs whose source is gone and temp files of killed runs."""
    for split in SPLITS:
        for folder, _, files in os.walk(dst / split):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, dst).replace(os.sep, "/")
                if (name.startswith(".") and ".tmp-" in name) or (is_image_name(name) and rel not in keep):
                    os.unlink(path)


def ensure_downscaled(src: str | os.PathLike, dst: str | os.PathLike, max_size: int, **kw) -> Path:
    """`dst` made from `src` on first use (or brought up to date). Safe for DDP ranks starting at once."""
    find_classes(src)  # a clear error for a bad layout first
    return downscale(src, dst, max_size, **kw)


@tool("python -m datamodules.downscale", on_stop="rerun the same command: it redoes only what is missing")
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.downscale",
        description="Write a copy of an ImageFolder tree whose images have their shorter side at most --max-size px "
                    "(aspect kept, never upscaled, EXIF orientation applied, RGB JPEG). Same relative paths as the "
                    "source. A rerun redoes only new or changed sources; each file appears atomically.",
    )
    ap.add_argument("--src", required=True, type=Path, help="ImageFolder root holding train/ and val/")
    ap.add_argument("--dst", required=True, type=Path, help="output root (created; same layout as --src)")
    ap.add_argument("--max-size", required=True, type=int, help="largest allowed shorter side, px (e.g. 160)")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (default: 90)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: all CPU cores)")
    ap.add_argument("--skip-invalid", action="store_true", help="leave undecodable files out instead of failing")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    require_source(a.src)
    out = downscale(a.src, a.dst, a.max_size, quality=a.quality, skip_invalid=a.skip_invalid,
                    workers=a.workers, progress=not a.quiet)
    m = read_marker(out) or {}
    print(f"{out}: {m.get('counts')} images at most {a.max_size} px, {len(m.get('skipped_files', []))} skipped; "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
