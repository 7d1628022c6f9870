"""The built-in dataset's images: 10 shape classes drawn procedurally, and the named dataset sizes.

`render` is a pure function of (preset, class, seed, split, index); tree.py writes its images
as JPEG trees.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["CLASSES", "PRESETS", "SPLITS", "VERSION", "Preset", "render"]

# Bump when the drawing changes, so that old trees on disk are regenerated.
VERSION = 1
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
