"""The built-in dataset: deterministic real JPEGs in ImageFolder layout, generated atomically."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from datamodules.builtin.tree import CLASSES, MARKER, PRESETS, ensure_builtin, generate, main
from tests.helpers import REPO
from tests.helpers.processes import in_processes


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_tiny_is_deterministic_and_valid(tmp_path):
    a = generate(tmp_path / "a", "tiny", workers=1, progress=False)
    b = generate(tmp_path / "b", "tiny", workers=2, progress=False)
    fa, fb = _files(a), _files(b)
    assert list(fa) == list(fb) and fa == fb  # same names, same bytes, whatever the worker count

    assert sorted(p.name for p in a.iterdir()) == [MARKER, "train", "val"]
    for split, n in (("train", 24), ("val", 8)):
        classes = sorted(p.name for p in (a / split).iterdir())
        assert classes == list(CLASSES) == sorted(CLASSES) and len(classes) == 10
        for c in classes:
            files = sorted((a / split / c).iterdir())
            assert [f.name for f in files] == [f"{i:05d}.jpg" for i in range(n)]
    for f in list((a / "train").rglob("*.jpg"))[::7]:
        with Image.open(f) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (32, 32))

    marker = json.loads((a / MARKER).read_text())
    assert (marker["preset"], marker["train_per_class"], marker["val_per_class"], marker["seed"]) == ("tiny", 24, 8, 0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_seed_and_split_change_the_images(tmp_path):
    a = _files(generate(tmp_path / "a", "tiny", train_per_class=2, val_per_class=2, progress=False))
    b = _files(generate(tmp_path / "b", "tiny", train_per_class=2, val_per_class=2, seed=1, progress=False))
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)
    assert a["train/circle/00000.jpg"] != a["val/circle/00000.jpg"]


def test_marker_reuse_and_regeneration(tmp_path):
    dst = generate(tmp_path / "d", "tiny", progress=False)
    probe = dst / "train" / "star" / "00003.jpg"
    before = (probe.stat().st_mtime_ns, (dst / MARKER).stat().st_mtime_ns)

    assert generate(dst, "tiny", progress=False) == dst  # complete, same parameters: reused
    assert (probe.stat().st_mtime_ns, (dst / MARKER).stat().st_mtime_ns) == before

    (dst / MARKER).unlink()  # as if interrupted: regenerated
    (dst / "train" / "star" / "99999.jpg").write_bytes(b"stale")
    probe.write_bytes(b"truncated")
    generate(dst, "tiny", progress=False)
    assert (dst / MARKER).exists() and not (dst / "train" / "star" / "99999.jpg").exists()
    with Image.open(probe) as im:
        im.load()

    generate(dst, "tiny", seed=3, progress=False)  # other parameters: replaced
    assert json.loads((dst / MARKER).read_text())["seed"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("foreign", ["train/notes.txt", "train/cats/img_001.jpg", "val/star/photo.jpg", "README"])
def test_refuses_to_delete_foreign_data(tmp_path, foreign):
    dst = tmp_path / "mine"
    (dst / foreign).parent.mkdir(parents=True, exist_ok=True)
    (dst / foreign).write_text("precious")
    with pytest.raises(FileExistsError):
        generate(dst, "tiny", progress=False)
    assert (dst / foreign).read_text() == "precious"


def _ensure(rank: int, preset: str, root: Path, kw: dict) -> Path:  # in a spawned process
    return ensure_builtin(preset, root, **kw)


def test_ensure_builtin_from_two_processes(tmp_path):
    kw = {"train_per_class": 6, "val_per_class": 2, "progress": False}
    paths = in_processes(_ensure, 2, "tiny", tmp_path, kw)  # like two DDP ranks starting at once
    assert paths[0] == paths[1] == tmp_path / "tiny-6-2-s0"
    assert json.loads((paths[0] / MARKER).read_text())["train_per_class"] == 6
    assert len(list(paths[0].rglob("*.jpg"))) == 10 * (6 + 2)
    assert ensure_builtin("tiny", tmp_path, progress=False) == tmp_path / "tiny"  # defaults: plain name


def test_imagenet_preset_has_varied_imagenet_like_sizes(tmp_path):
    dst = generate(tmp_path / "in", "imagenet", train_per_class=2, val_per_class=1, progress=False)
    files = sorted(dst.rglob("*.jpg"))
    assert len(files) == 30
    sizes = []
    for f in files:
        with Image.open(f) as im:
            assert (im.format, im.mode) == ("JPEG", "RGB")
            sizes.append(im.size)
    ws, hs = zip(*sizes, strict=False)
    assert len(set(sizes)) > 20
    assert 380 < sum(ws) / len(ws) < 560 and 310 < sum(hs) / len(hs) < 470
    assert min(ws + hs) >= 150 and max(ws + hs) <= 1000
    kb = sum(f.stat().st_size for f in files) / len(files) / 1024
    assert 40 < kb < 200
    assert PRESETS["imagenet"].varied and not PRESETS["small"].varied


def test_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "datamodules.builtin", "--dst", str(tmp_path / "cli"), "--preset", "tiny", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "cli") in out.stdout and "240 train + 80 val" in out.stdout
    assert len(list((tmp_path / "cli").rglob("*.jpg"))) == 320


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--dst" in text and "--train-per-class" in text and all(p in text for p in PRESETS)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "huge"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
