"""A script fed on standard input (`python - <<EOF`, as CI steps and heredocs do), or one that makes its loaders at
import without a main guard, loads its data under the default worker start: a forkserver worker would import the
main script again, from '<stdin>' (no such file) or running the script's loaders again."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO
from tests.helpers.trees import make_tree


def test_a_script_from_standard_input_loads_a_batch_and_says_how_its_workers_start(tmp_path):
    tree = make_tree(tmp_path / "tree", {"a": 8, "b": 8})
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from datamodules import ImageFolderDataModule\n"
              f"dm = ImageFolderDataModule(data_dir={str(tree)!r}, batch_size=4, num_workers=2, image_size=32, "
              "persistent_workers=False)\n"
              "dm.setup('fit')\n"
              "images, labels = next(iter(dm.train_dataloader()))\n"
              "print('batch', tuple(images.shape))\n")
    done = subprocess.run([sys.executable, "-"], input=script, check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "batch (4, 3, 32, 32)" in done.stdout, done.stderr[-3000:]
    assert "The main script is <stdin>, not a file" in done.stderr and "start by fork instead" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_script_without_a_main_guard_loads_a_batch_with_one_warning_and_no_traceback(tmp_path):
    tree = make_tree(tmp_path / "tree", {"a": 8, "b": 8})
    script = tmp_path / "no_guard.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                      "from datamodules import ImageFolderDataModule\n"
                      f"dm = ImageFolderDataModule(data_dir={str(tree)!r}, batch_size=4, num_workers=2, image_size=32, "
                      "persistent_workers=False)\n"
                      "dm.setup('fit')\n"
                      "for loader in (dm.train_dataloader(), dm.val_dataloader()):\n"
                      "    images, labels = next(iter(loader))\n"
                      "print('batch', tuple(images.shape))\n")
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "batch (4, 3, 32, 32)" in done.stdout, done.stderr[-3000:]
    assert done.stderr.count("outside `if __name__ == \"__main__\":`") == 1, done.stderr
    assert "Traceback" not in done.stderr and "A loader worker ran" not in done.stderr, done.stderr
