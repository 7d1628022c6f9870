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

    python -m datamodules.builtin --dst data/builtin/small --preset small
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from datamodules.packing import progress_display

try:
    import fcntl
except ImportError:  # not POSIX: ensure_builtin then relies on the atomic rename only
    fcntl = None

__all__ = ["CLASSES", "DEFAULT_ROOT", "PRESETS", "VERSION", "Preset", "dataset_name", "ensure_builtin", "generate", "main", "render"]

# Bump when the drawing changes, so that old trees on disk are regenerated.
VERSION = 1
MARKER = ".complete"
# Where the training code keeps it: <repo>/data/builtin (ignored by git).
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "data" / "builtin"
SPLITS = ("train", "val")

# Sorted: the folder order is the label order.
CLASSES = (
    "bars", "circle", "crescent", "cross", "diamond",
    "plus", "ring", "square", "star", "triangle",
)


@dataclass(frozen=True)
class Preset:
    """A named dataset size.

    ``size`` is the side of square images, or ``(mean_width, mean_height)`` for images of
    varied size and aspect that average to that (like ImageNet)."""

    name: str
    train_per_class: int
    val_per_class: int
    size: int | tuple[int, int]
    jpeg_quality: int = 90
    noise: tuple[float, float] = (0.0, 14.0)  # range of the pixel noise's standard deviation
    description: str = ""

    @property
    def varied(self) -> bool:
        return not isinstance(self.size, int)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", 24, 8, 32, description="unit tests"),
        Preset("small", 600, 100, 32, description="the default: a small CNN passes 90% in minutes on a CPU"),
        Preset("medium", 600, 100, 96, description="larger inputs, same task"),
        # ImageNet's JPEGs are about 470x390 and 110 KB on average; noise and quality give ~90 KB.
        Preset("imagenet", 100, 20, (470, 390), jpeg_quality=94, noise=(6.0, 18.0),
               description="ImageNet-like sizes and files: loader benchmarks"),
    )
}


# ---------------------------------------------------------------------------- drawing

def _circle(n: int = 48, r: float = 1.0, cx: float = 0.0) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return np.stack([cx + r * np.cos(t), r * np.sin(t)], 1)


def _rect(x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float)


def _cross_arms(w: float) -> np.ndarray:
    a = 0.95
    return np.array([[-w, -a], [w, -a], [w, -w], [a, -w], [a, w], [w, w],
                     [w, a], [-w, a], [-w, w], [-a, w], [-a, -w], [-w, -w]], float)


def _rotate(p: np.ndarray, deg: float) -> np.ndarray:
    t = math.radians(deg)
    c, s = math.cos(t), math.sin(t)
    return np.stack([p[:, 0] * c - p[:, 1] * s, p[:, 0] * s + p[:, 1] * c], 1)


def _star() -> np.ndarray:
    t = np.pi / 2 + np.arange(10) * np.pi / 5  # y points down in images: this points up
    r = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
    return np.stack([r * np.cos(t), -r * np.sin(t)], 1)


# Each class: polygons in unit coordinates (radius <= 1), as (points, fill) pairs drawn in
# order on a mask; fill 0 cuts holes.
_SHAPES: dict[str, list[tuple[np.ndarray, int]]] = {
    "bars": [(_rect(-0.9, -0.8, 0.9, -0.2), 255), (_rect(-0.9, 0.2, 0.9, 0.8), 255)],
    "circle": [(_circle(r=0.9), 255)],
    "crescent": [(_circle(), 255), (_circle(r=0.85, cx=0.5), 0)],
    "cross": [(_rotate(_cross_arms(0.24), 45), 255)],
    "diamond": [(np.array([[0, -1], [0.68, 0], [0, 1], [-0.68, 0]], float), 255)],
    "plus": [(_cross_arms(0.26), 255)],
    "ring": [(_circle(), 255), (_circle(r=0.55), 0)],
    "square": [(_rect(-0.75, -0.75, 0.75, 0.75), 255)],
    "star": [(_star(), 255)],
    "triangle": [(np.array([[0, -0.95], [0.9, 0.7], [-0.9, 0.7]], float), 255)],
}
assert tuple(sorted(_SHAPES)) == CLASSES


def _image_size(preset: Preset, rng: np.random.Generator) -> tuple[int, int]:
    if not preset.varied:
        return preset.size, preset.size
    mean_w, mean_h = preset.size
    # One in ten is portrait; the base sides are set so the means still come out right.
    p_swap = 0.1
    gap = (mean_w - mean_h) / (1 - 2 * p_swap)
    base_w, base_h = (mean_w + mean_h + gap) / 2, (mean_w + mean_h - gap) / 2
    scale, aspect = rng.uniform(0.65, 1.35), math.exp(rng.uniform(-0.15, 0.15))
    w, h = round(base_w * scale * aspect), round(base_h * scale / aspect)
    if rng.random() < p_swap:
        w, h = h, w
    return w, h


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    kind = rng.choice(["solid", "gradient", "texture", "clutter"])
    base = rng.uniform(0, 255, 3).astype(np.float32)
    if kind == "texture":
        gx, gy = rng.integers(2, 9, 2)
        grid = np.clip(base + rng.normal(0, 45, (gy, gx, 3)), 0, 255).astype(np.uint8)
        return Image.fromarray(grid).resize((w, h), Image.BICUBIC)
    if kind == "solid":
        arr = np.broadcast_to(base, (h, w, 3))
    else:
        other = np.clip(base + rng.normal(0, 70, 3), 0, 255).astype(np.float32)
        t = math.radians(rng.uniform(0, 360))
        d = (np.arange(w, dtype=np.float32)[None, :] * math.cos(t)
             + np.arange(h, dtype=np.float32)[:, None] * math.sin(t))
        d -= d.min()
        d /= max(float(d.max()), 1.0)
        arr = base + d[..., None] * (other - base)
    img = Image.fromarray(np.asarray(arr, np.uint8))
    if kind == "clutter":
        draw, side = ImageDraw.Draw(img), min(w, h)
        for _ in range(rng.integers(4, 12)):
            x, y = rng.uniform(0, w), rng.uniform(0, h)
            rx, ry = rng.uniform(0.02, 0.07, 2) * side + 0.5
            draw.ellipse([x - rx, y - ry, x + rx, y + ry], fill=tuple(rng.integers(0, 256, 3).tolist()))
    return img


def _paint(img: np.ndarray, shape: str, cx: float, cy: float, r: float, deg: float,
           colour: np.ndarray, ss: int) -> None:
    """Paint one shape into ``img`` (float32 HxWx3, in place), anti-aliased: the shape is
    drawn ss-times larger on a mask of its bounding box, then box-filtered down."""
    h, w = img.shape[:2]
    x0, y0 = max(0, int(cx - r) - 1), max(0, int(cy - r) - 1)
    x1, y1 = min(w, int(cx + r) + 2), min(h, int(cy + r) + 2)
    if x1 <= x0 or y1 <= y0:
        return
    m = Image.new("L", ((x1 - x0) * ss, (y1 - y0) * ss), 0)
    draw = ImageDraw.Draw(m)
    for pts, fill in _SHAPES[shape]:
        p = (_rotate(pts, deg) * r + (cx - x0, cy - y0)) * ss
        draw.polygon([tuple(q) for q in p.tolist()], fill=fill)
    if ss > 1:
        m = m.resize((x1 - x0, y1 - y0), Image.BOX)
    a = np.asarray(m, np.float32)[..., None] * np.float32(1 / 255)
    region = img[y0:y1, x0:x1]
    region += a * (colour - region)


def _contrasting_colour(rng: np.random.Generator, against: np.ndarray) -> np.ndarray:
    for _ in range(50):
        c = rng.uniform(0, 255, 3)
        if np.linalg.norm(c - against) > 110:
            return c.astype(np.float32)
    return (255.0 - against).astype(np.float32)


def render(preset: Preset, label: int, seed: int, split: str, index: int) -> Image.Image:
    """The image ``index`` of class ``label`` in ``split``: a pure function of its arguments."""
    rng = np.random.default_rng([VERSION, seed, SPLITS.index(split), label, index])
    w, h = _image_size(preset, rng)
    side = min(w, h)
    ss = max(2, min(4, math.ceil(128 / side)))
    img = np.array(_background(rng, w, h), np.float32)
    bg_mean = img[::4, ::4].reshape(-1, 3).mean(0)

    r = rng.uniform(0.22, 0.42) * side
    cx, cy = rng.uniform(0.85 * r, w - 0.85 * r), rng.uniform(0.85 * r, h - 0.85 * r)
    layers = []
    if rng.random() < 0.3:  # a smaller shape of another class, away from the main one
        other = CLASSES[(label + rng.integers(1, len(CLASSES))) % len(CLASSES)]
        r2 = r * rng.uniform(0.3, 0.5)
        for _ in range(10):
            x2, y2 = rng.uniform(r2, w - r2), rng.uniform(r2, h - r2)
            if math.hypot(x2 - cx, y2 - cy) > r + r2:
                layers.append((other, x2, y2, r2, rng.uniform(-180, 180)))
                break
    layers.append((CLASSES[label], cx, cy, r, rng.uniform(-12, 12)))
    for shape, x, y, rad, deg in layers:
        _paint(img, shape, x, y, rad, deg, _contrasting_colour(rng, bg_mean), ss)

    noise = rng.standard_normal((h, w, 3), np.float32)
    noise *= np.float32(rng.uniform(*preset.noise))
    img += noise
    img += 0.5
    np.clip(img, 0, 255, out=img)
    return Image.fromarray(img.astype(np.uint8))


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
    # parent that runs threads or CUDA (as DataLoader workers do) is fine.
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
        jobs = [(s, label, i) for s, n in zip(SPLITS, (n_train, n_val))
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
                with ProcessPoolExecutor(workers, mp_context=_mp_context()) as pool:
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
    if fcntl is None:
        return generate(dst, preset, **kw)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Holding the lock, any temp folder of this name is a leftover of a killed run.
            for stale in root.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            for stale in root.glob(f".{name}.old-*"):
                shutil.rmtree(stale, ignore_errors=True)
            return generate(dst, preset, **kw)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------- CLI

def _preset_table() -> str:
    rows = []
    for p in PRESETS.values():
        size = f"{p.size}x{p.size}" if not p.varied else f"~{p.size[0]}x{p.size[1]} varied"
        rows.append(f"  {p.name:<9} {p.train_per_class:>4} train + {p.val_per_class:>3} val per class, "
                    f"{size:<15} {p.description}")
    return "presets (10 classes each):\n" + "\n".join(rows)


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
