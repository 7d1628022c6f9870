"""The built-in dataset: 10 procedurally drawn shape classes, written as real JPEG files.

Nothing is downloaded. The images are a pure function of (seed, split, class, index), so
the same arguments give byte-identical files on any machine with the same Pillow/libjpeg,
however many worker processes draw them.

Layout (ImageFolder): ``DST/train/<class>/00000.jpg``, ``DST/val/<class>/00000.jpg`` and
a JSON marker ``DST/.complete`` that is written last; the whole tree appears at once
(written beside ``DST`` and renamed into place).

Every image has one main shape that decides its class. Colour, position, scale, a small
rotation, the background (solid, gradient, texture, clutter of blobs), pixel noise and an
optional smaller distractor shape of another class are all drawn independently of the
class, so neither colour statistics nor a linear model on pixels solve it; a small CNN does.

The drawing is in draw.py; this module writes the trees.

    python -m datamodules.builtin --dst data/builtin/small --preset small
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from datamodules.builtin.draw import CLASSES, PRESETS, SPLITS, VERSION, Preset, render
from datamodules.packing import progress_display
from datamodules.processes.exits import ignore_stop_signals, tool
from datamodules.processes.locks import file_lock

__all__ = ["CLASSES", "DEFAULT_ROOT", "PRESETS", "VERSION", "Preset", "dataset_name", "ensure_builtin", "generate",
           "main", "render"]

# Where the training code keeps it: <repo>/data/builtin (ignored by git).
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "data" / "builtin"
MARKER = ".complete"


# ------------------------------------------------------------------------- generation

def _write_chunk(args: tuple[str, Preset, int, list[tuple[str, int, int]]]) -> int:
    root, preset, seed, jobs = args
    for split, label, index in jobs:
        img = render(preset, label, seed, split, index)
        img.save(Path(root, split, CLASSES[label], f"{index:05d}.jpg"), "JPEG", quality=preset.jpeg_quality)
    return len(jobs)


def _mp_context() -> mp.context.BaseContext:
    # fork where it exists: spawn would re-import the caller's __main__, which hangs or fails
    # in scripts without a main guard. The workers touch only numpy and PIL, so forking a
    # parent that runs threads or CUDA (as DataLoader workers do) is fine; the collector is frozen across the
    # fork all the same (datamodules/processes/forksafe.py; imported here: it imports torch, which the tool needs not).
    from datamodules.processes import forksafe

    forksafe.install()
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _marker(preset: Preset, n_train: int, n_val: int, seed: int) -> dict:
    return {"version": VERSION, "preset": preset.name, "train_per_class": n_train,
            "val_per_class": n_val, "seed": seed, "size": preset.size,
            "jpeg_quality": preset.jpeg_quality, "classes": list(CLASSES)}


def _read_marker(dst: Path) -> dict | None:
    try:
        return json.loads((dst / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _same(a: dict | None, b: dict) -> bool:
    keys = ("version", "preset", "train_per_class", "val_per_class", "seed", "classes")
    return a is not None and all(a.get(k) == b[k] for k in keys)


def _looks_generated(dst: Path) -> bool:
    """Whether ``dst`` holds only what this module writes (split/class/NNNNN.jpg, the marker):
    only such a folder may be deleted and regenerated, never a user's own dataset."""
    for p in dst.rglob("*"):
        parts = p.relative_to(dst).parts
        ok = (parts == (MARKER,) or (parts[0] in SPLITS and (len(parts) == 1 or parts[1] in CLASSES)
              and (len(parts) <= 2 or (len(parts) == 3 and re.fullmatch(r"\d{5,}\.jpg", parts[2])))))
        if not ok:
            return False
    return True


def _get_preset(preset: str) -> Preset:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[preset]


def generate(
    dst: str | Path,
    preset: str = "small",
    *,
    train_per_class: int | None = None,
    val_per_class: int | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Write the dataset to ``dst`` (atomically) and return ``dst``.

    A complete ``dst`` with the same parameters is returned as it is. A ``dst`` from other
    parameters, or without the ``.complete`` marker, is replaced, but only if it holds
    nothing except folders and .jpg files (otherwise FileExistsError: never delete data
    that this module did not write)."""
    p = _get_preset(preset)
    n_train = p.train_per_class if train_per_class is None else int(train_per_class)
    n_val = p.val_per_class if val_per_class is None else int(val_per_class)
    if n_train < 1 or n_val < 1:
        raise ValueError("train_per_class and val_per_class must be >= 1")
    dst = Path(dst).absolute()
    marker = _marker(p, n_train, n_val, seed)
    if _same(_read_marker(dst), marker):
        return dst
    if dst.exists() and not (dst.is_dir() and _looks_generated(dst)):
        raise FileExistsError(f"{dst} exists and holds files this generator did not write; choose another --dst")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        for split in SPLITS:
            for c in CLASSES:
                (tmp / split / c).mkdir(parents=True)
        jobs = [(s, label, i) for s, n in zip(SPLITS, (n_train, n_val), strict=False)
                for label in range(len(CLASSES)) for i in range(n)]
        chunk = 32 if p.varied else 256
        chunks = [(str(tmp), p, seed, jobs[i:i + chunk]) for i in range(0, len(jobs), chunk)]
        workers = max(1, min(workers or os.cpu_count() or 1, len(chunks)))
        t0 = time.perf_counter()
        with progress_display(total=len(jobs), unit="img", desc=f"builtin/{p.name}", disable=not progress) as bar:
            if workers == 1:
                for c in chunks:
                    bar.update(_write_chunk(c))
            else:
                with ProcessPoolExecutor(workers, mp_context=_mp_context(), initializer=ignore_stop_signals) as pool:
                    for n in pool.map(_write_chunk, chunks):
                        bar.update(n)
        marker["seconds"] = round(time.perf_counter() - t0, 2)
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if dst.exists():
            # Our own tree from other parameters or an interrupted older run: swap it out.
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / "tree")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not _same(_read_marker(dst), marker):  # somebody else finished the same tree first: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def dataset_name(preset: str = "small", *, train_per_class: int | None = None,
                 val_per_class: int | None = None, seed: int = 0) -> str:
    """The folder name ensure_builtin uses: the preset name, with counts and seed if overridden."""
    p = _get_preset(preset)
    n = p.train_per_class if train_per_class is None else int(train_per_class)
    m = p.val_per_class if val_per_class is None else int(val_per_class)
    if (n, m, seed) == (p.train_per_class, p.val_per_class, 0):
        return p.name
    return f"{p.name}-{n}-{m}-s{seed}"


def ensure_builtin(preset: str = "small", root: str | Path = "data/builtin", **kw) -> Path:
    """Return ``root/<name>``, generating it on first use (see :func:`generate` for ``kw``).

    Safe to call from several processes at once (DDP ranks): a file lock lets one generate
    while the others wait, then all return the same path."""
    name = dataset_name(preset, train_per_class=kw.get("train_per_class"),
                        val_per_class=kw.get("val_per_class"), seed=kw.get("seed", 0))
    root = Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    dst = root / name
    with file_lock(root / f".{name}.lock"):
        # Holding the lock, any temp folder of this name is a leftover of a killed run.
        for stale in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.glob(f".{name}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return generate(dst, preset, **kw)


# ------------------------------------------------------------------------------- CLI

def _preset_table() -> str:
    rows = []
    for p in PRESETS.values():
        size = f"{p.size}x{p.size}" if not p.varied else f"~{p.size[0]}x{p.size[1]} varied"
        rows.append(f"  {p.name:<9} {p.train_per_class:>4} train + {p.val_per_class:>3} val per class, "
                    f"{size:<15} {p.description}")
    return "presets (10 classes each):\n" + "\n".join(rows)


@tool("python -m datamodules.builtin", on_stop="the dataset is marked complete only at its end: rerun the same command")
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.builtin",
        description="Generate the built-in dataset: 10 procedurally drawn shape classes as JPEG "
                    "files in ImageFolder layout (DST/train/<class>/*.jpg, DST/val/<class>/*.jpg). "
                    "Deterministic; nothing is downloaded. An existing complete dataset with the "
                    "same parameters is reused.",
        epilog=_preset_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--dst", type=Path, default=None,
                    help="output folder (default: <repo>/data/builtin/<preset>, where the training code looks)")
    ap.add_argument("--preset", default="small", choices=list(PRESETS), help="dataset size (default: small)")
    ap.add_argument("--train-per-class", type=int, default=None, help="override the preset's train images per class")
    ap.add_argument("--val-per-class", type=int, default=None, help="override the preset's val images per class")
    ap.add_argument("--seed", type=int, default=0, help="another seed gives another dataset (default: 0)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: all CPU cores)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    kw = {"train_per_class": a.train_per_class, "val_per_class": a.val_per_class, "seed": a.seed,
          "workers": a.workers, "progress": not a.quiet}
    t0 = time.perf_counter()
    out = generate(a.dst, a.preset, **kw) if a.dst else ensure_builtin(a.preset, DEFAULT_ROOT, **kw)
    m = _read_marker(out) or {}
    n_train, n_val = m.get("train_per_class", 0) * len(CLASSES), m.get("val_per_class", 0) * len(CLASSES)
    print(f"{out}: {n_train} train + {n_val} val images, {len(CLASSES)} classes "
          f"(preset {a.preset}, seed {a.seed}; {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
