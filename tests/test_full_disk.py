"""A full disk while a run writes: one paragraph (the file, the bytes it needed and those free, the last good
checkpoint, how to go on), exit status 2, no traceback and no temp file left (lightning_app/disk_full.py). Each test
mounts a real small tmpfs (tests/helpers/filesystems.py): skipped without root."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main, train_checkpoint
from tests.helpers.filesystems import fill, small_filesystem

pytestmark = [pytest.mark.slow]


def _args(data, root, *extra: str) -> list[str]:
    return ["fit", *quick_args(data, root, epochs=2), "--data.image_size", "32", *extra]


def _said(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert out.count("The disk is full: writing ") == 1 and "No space left on device" in out, out[-4000:]
    return out


def test_a_checkpoint_that_does_not_fit_names_its_size_and_the_last_good_checkpoint(tiny_data, tmp_path):
    # 1700 KiB: the first best checkpoint (about 1 MB) fits, the last.ckpt written after it does not
    with small_filesystem(tmp_path / "disk", size="1700k") as disk:
        root = disk / "logs"
        out = _said(run_main(_args(tiny_data, root, "--model.pictures", "[]"), check=False))
        ckpts = root / "version_0" / "checkpoints"
        (best,) = ckpts.glob("best-*.ckpt")
        assert f"writing {ckpts / 'last.ckpt'} (about " in out and " bytes are free on its filesystem" in out
        assert f"The last good checkpoint is {best}." in out and f"then go on with --ckpt_path {best}." in out
        assert not list(root.rglob("*.tmp")) and not (ckpts / "last.ckpt").exists()
        assert torch.load(best, map_location="cpu", weights_only=True)["global_step"] == 7


def test_tensorboards_events_on_a_full_disk(tiny_data, tmp_path):
    # the run root on 200 KiB, its checkpoints elsewhere: the events file (pictures in it) outgrows the disk
    with small_filesystem(tmp_path / "disk", size="200k") as disk:
        out = _said(run_main(_args(tiny_data, disk / "logs", "--trainer.log_every_n_steps", "1",
                                   "--checkpoint.dirpath", str(tmp_path / "ckpts")), check=False))
        assert "writing TensorBoard's events file " in out and "Exception in thread" not in out
        assert f"The last good checkpoint is {tmp_path / 'ckpts'}" in out


def test_predictions_csv_on_a_full_disk_leaves_no_part_file(tiny_data, tmp_path):
    *_, ckpt = train_checkpoint(tiny_data, tmp_path, epochs=1, batch=32)
    with small_filesystem(tmp_path / "disk", size="256k") as disk:
        root = disk / "logs"
        root.mkdir()
        fill(disk, leave=24 * 1024)  # config.yaml and the events file fit; the rows do not
        proc = run_main(["predict", *quick_args(tiny_data, root), "--data.image_size", "32", "--ckpt_path", str(ckpt),
                         "--data.predict_dir", str(tiny_data / "val")], check=False)
        out = _said(proc)
        assert "predictions.csv" in out.split("The disk is full: writing ")[1].split(" failed")[0], out[-3000:]
        assert not list(root.rglob(".predictions.csv*")) and not list(root.rglob("predictions.csv"))


def test_an_export_to_a_full_disk_is_one_paragraph(tiny_data, tmp_path):
    *_, ckpt = train_checkpoint(tiny_data, tmp_path, epochs=1, batch=32)
    with small_filesystem(tmp_path / "disk", size="300k") as disk:
        out = disk / "model.pt2"
        proc = subprocess.run([sys.executable, "-m", "lightning_app.export", "--ckpt_path", str(ckpt), "--format",
                               "pt2", "--output", str(out)], cwd=REPO, capture_output=True, text=True, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"The disk is full: writing {out} (about " in proc.stderr and "would not fit" in proc.stderr
        assert "bytes are free on its filesystem" in proc.stderr and "--output" in proc.stderr
        assert not [p for p in disk.iterdir() if p.name != "lost+found"]
