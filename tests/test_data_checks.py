"""A tree a fit cannot learn from (one class) or cannot make one step of (fewer images than one global batch) is
refused in one paragraph before the model is built or Lightning's banner printed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_app.cli import main
from lightning_app.data_checks import batch_for
from tests.helpers import REPO
from tests.helpers.trees import make_tree


def _refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--data.num_workers", "0", *args])
    out, err = capsys.readouterr()
    assert stop.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "GPU available" not in out and "Params" not in out, out  # no banner, no model table
    return err.strip()


def test_a_one_class_tree_is_refused(tmp_path, capsys):
    tree = make_tree(tmp_path / "one", {"cats": 3})
    err = _refused(["--data.data_dir", str(tree), "--trainer.default_root_dir", str(tmp_path / "logs")], capsys)
    assert f"{tree / 'train'} has one class folder (cats/)" in err and "at least 2 classes" in err
    assert not (tmp_path / "logs").exists()


def test_a_tree_smaller_than_one_global_batch_gets_a_batch_that_fits(tmp_path, capsys):
    tree = make_tree(tmp_path / "small", {"cats": 30, "dogs": 30})
    err = _refused(["--data.data_dir", str(tree), "--trainer.default_root_dir", str(tmp_path / "logs")], capsys)
    assert f"{tree / 'train'} has 60 images, fewer than one global batch (--data.batch_size 256)" in err
    assert "Pass --data.batch_size 4" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("images", "batch"), [(1, 1), (15, 1), (16, 2), (60, 4), (300, 32), (2047, 128)])
def test_the_batch_for_a_small_tree_gives_8_to_16_steps(images, batch):
    assert batch_for(images) == batch


def test_the_data_line_says_1_cpu_in_the_singular(tmp_path):
    tree = make_tree(tmp_path / "two", {"a": 4, "b": 4})
    code = ("import logging, os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from datamodules import ImageFolderDataModule\n"
            f"dm = ImageFolderDataModule(data_dir={str(tree)!r}, batch_size=4, image_size=32, num_workers=0)\n"
            "dm._show_plan(dm.memory_plan(fit=True))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert ", 1 CPU per rank: " in done.stdout, done.stdout + done.stderr
