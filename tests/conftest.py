"""Shared fixtures: small real datasets (JPEG files on disk) and a way to run the CLI."""
from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# the commands under test call `python`, `torchrun` and `tensorboard` by name, as a user with the venv active does
_VENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

from datamodules.builtin.tree import generate


@pytest.fixture(autouse=True, scope="session")
def _isolated_index_cache(tmp_path_factory):
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The built-in dataset, 'tiny' preset: 10 classes x (24 train, 8 val), 32 px JPEGs."""
    return generate(tmp_path_factory.mktemp("builtin") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="session")
def learnable_data(tmp_path_factory) -> Path:
    """Enough of the built-in dataset for a few-epoch fit to clearly beat chance."""
    return generate(
        tmp_path_factory.mktemp("builtin") / "learn", "small", train_per_class=120, val_per_class=30, progress=False
    )


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _png(img: Image.Image) -> bytes:
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
        "gray.jpg": _jpeg(rgb.convert("L")),
        "cmyk.jpg": _jpeg(rgb.convert("CMYK")),
        "rgba.png": _png(rgb.convert("RGBA")),
        "sixteen_bit.png": _png(sixteen),
        "png_named.JPEG": _png(rgb),
        "exif_rotated.jpg": _jpeg(rgb, exif=exif.tobytes()),
        "one_pixel.jpg": _jpeg(Image.new("RGB", (1, 1), (200, 10, 10))),
        "very_wide.jpg": _jpeg(Image.new("RGB", (1200, 8), (10, 200, 10))),
        "palette.png": _png(rgb.convert("P")),
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
                (d / f"{i:03d}.jpg").write_bytes(_jpeg(Image.fromarray(arr)))
    return root


@pytest.fixture
def odd_tree(tmp_path) -> Path:
    """Every unusual-but-valid case, plus the clutter a naive walk turns into samples or classes."""
    root = make_tree(tmp_path / "odd", {"ants": 4, "bees": 4, "empty": 0})
    for split in ("train", "val"):
        for name, data in odd_images().items():
            (root / split / "ants" / name).write_bytes(data)
        (root / split / "bees" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
        (root / split / "bees" / "notes.txt").write_text("not an image")
        (root / split / ".git" / "objects").mkdir(parents=True)
        (root / split / ".git" / "objects" / "x.jpg").write_bytes(b"hidden")
        (root / split / "bees" / ".hidden.jpg").write_bytes(b"hidden")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(args: list[str], env: dict | None = None, timeout: int = 300, check: bool = True):
    """`python main.py ARGS` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "main.py", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
        check=False,  # the caller decides what a failure means
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"main.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
    return dst


# Flags that keep a CLI run small and quiet; every test run writes only under its tmp dir.
def quick_args(data_dir: Path, root: Path, epochs: int = 1, batch: int = 32, width: int | None = 8) -> list[str]:
    return [
        "--data.data_dir", str(data_dir),
        "--data.batch_size", str(batch),
        "--data.num_workers", "0",
        "--trainer.max_epochs", str(epochs),
        "--trainer.default_root_dir", str(root),
        "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false",
        *(["--model.arch_kwargs", f"{{width: {width}}}"] if width else []),
    ]


@pytest.fixture(scope="session")
def slow_tree(tmp_path_factory) -> Path:
    """200 noise PNGs of 320x240 (2 classes): slow enough to pack or downscale that a run can be killed midway."""
    root = tmp_path_factory.mktemp("slow") / "tree"
    rng = np.random.default_rng(2)
    for split, n in (("train", 80), ("val", 20)):
        for name in ("a", "b"):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(n):
                arr = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)
                (d / f"{i:03d}.png").write_bytes(_png(Image.fromarray(arr)))
    return root


def train_checkpoint(data_dir: Path, root: Path, *, epochs: int, batch: int, **model_kwargs):
    """(trainer, model, datamodule, checkpoint path): conv11 width 8 fitted on `data_dir` at 32 px, in-process."""
    import pytorch_lightning as pl

    from datamodules import ImageFolderDataModule
    from lightning_app.module import ImageClassifier

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=batch, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=batch,
                            arch_kwargs={"width": 8}, pictures=[], **model_kwargs)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, dm)
    path = root / "model.ckpt"
    trainer.save_checkpoint(path)
    return trainer, model, dm, path
