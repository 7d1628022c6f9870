"""A script fed on standard input (`python - <<EOF`, as CI steps and heredocs do) loads its data under the default
worker start: a forkserver worker would import the main script again from its path, '<stdin>', and fail."""
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
