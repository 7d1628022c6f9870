"""Image trees on disk: small ImageFolder trees of random JPEGs, valid but unusual images, the clutter a naive
walk turns into samples or classes, and noise PNGs slow enough to pack that a run can be killed midway."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image


def jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def odd_images() -> dict[str, bytes]:
    """Valid but unusual images, as ImageNet has them: name -> encoded bytes."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    sixteen = Image.fromarray(np.full((20, 30), 32768, dtype=np.uint16))
    return {
        "gray.jpg": jpeg(rgb.convert("L")),
        "cmyk.jpg": jpeg(rgb.convert("CMYK")),
        "rgba.png": png(rgb.convert("RGBA")),
        "sixteen_bit.png": png(sixteen),
        "png_named.JPEG": png(rgb),
        "exif_rotated.jpg": jpeg(rgb, exif=exif.tobytes()),
        "one_pixel.jpg": jpeg(Image.new("RGB", (1, 1), (200, 10, 10))),
        "very_wide.jpg": jpeg(Image.new("RGB", (1200, 8), (10, 200, 10))),
        "palette.png": png(rgb.convert("P")),
    }


def make_tree(root: Path, per_class: dict[str, int], splits=("train", "val"), size=(48, 40)) -> Path:
    """A small ImageFolder tree of random JPEGs."""
    rng = np.random.default_rng(1)
    for split in splits:
        for name, n in per_class.items():
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
                (d / f"{i:03d}.jpg").write_bytes(jpeg(Image.fromarray(arr)))
    return root


def make_odd_tree(root: Path) -> Path:
    """Every unusual-but-valid case, plus the clutter a naive walk turns into samples or classes."""
    root = make_tree(root, {"ants": 4, "bees": 4, "empty": 0})
    for split in ("train", "val"):
        for name, data in odd_images().items():
            (root / split / "ants" / name).write_bytes(data)
        (root / split / "bees" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
        (root / split / "bees" / "notes.txt").write_text("not an image")
        (root / split / ".git" / "objects").mkdir(parents=True)
        (root / split / ".git" / "objects" / "x.jpg").write_bytes(b"hidden")
        (root / split / "bees" / ".hidden.jpg").write_bytes(b"hidden")
    return root


def make_slow_tree(root: Path) -> Path:
    """200 noise PNGs of 320x240 (2 classes): slow enough to pack or downscale that a run can be killed midway."""
    rng = np.random.default_rng(2)
    for split, n in (("train", 80), ("val", 20)):
        for name in ("a", "b"):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(n):
                arr = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)
                (d / f"{i:03d}.png").write_bytes(png(Image.fromarray(arr)))
    return root


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
    return dst


def make_photo_like_tree(root: Path, classes: int = 10, train: int = 32, val: int = 30, size: int = 48) -> Path:
    """A small tree that a CNN tells apart in a few steps, as real photos of different things: every image a smooth
    random field (power spectrum 1/f^slope, as natural images have), each class its own colour cast and texture
    scale, with a random cast of its own on top so that no class is one colour."""
    rng = np.random.default_rng(0)
    freq = np.fft.fftfreq(size)[:, None] ** 2 + np.fft.fftfreq(size)[None, :] ** 2

    def field(slope: float) -> np.ndarray:
        spectrum = np.maximum(freq, 1 / size ** 2) ** (-slope / 2) * np.exp(2j * np.pi * rng.random((size, size)))
        x = np.real(np.fft.ifft2(spectrum))
        return (x - x.mean()) / (x.std() + 1e-8)

    for split, n in (("train", train), ("val", val)):
        for c in range(classes):
            hue = 2 * np.pi * c / classes
            slope = 1.2 + 1.6 * ((c * 3) % classes) / classes  # fine to coarse texture
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                cast = 0.5 + 0.25 * np.cos([hue, hue - 2.1, hue + 2.1]) + rng.normal(0, 0.08, 3)
                pixels = cast + 0.18 * field(slope)[..., None] + 0.12 * np.stack([field(slope) for _ in range(3)], -1)
                image = Image.fromarray((np.clip(pixels, 0, 1) * 255).astype(np.uint8))
                (d / f"{i:03d}.jpg").write_bytes(jpeg(image, quality=90))
    return root
