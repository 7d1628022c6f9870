"""Export as a newcomer uses it: the batch is dynamic by default (ONNX and pt2), the JSON says the model
normalises its input and how to resize, and the documented snippet reproduces predict's probabilities."""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from lightning_app.cli import ClassifierCLI
from lightning_app.export import main as export_main
from tests.helpers import REPO
from tests.helpers.cli import train_checkpoint

SIZES = [(200, 160), (160, 280), (256, 256), (360, 132), (148, 192)]  # (width, height): downscaled 4-8x


def doc_snippet() -> str:
    text = (REPO / "docs" / "after-training.md").read_text()
    export = text[text.index("## Export"):]
    return re.search(r"```python\n(.*?)```", export, re.DOTALL).group(1)


@pytest.mark.slow
def test_the_documented_snippet_reproduces_predict_and_any_batch_runs(tiny_data, tmp_path):
    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "run", epochs=1, batch=40)
    photos = tmp_path / "photos"
    photos.mkdir()
    sources = sorted((tiny_data / "val").glob("*/*.jpg"))
    rng = np.random.default_rng(0)
    for i, size in enumerate(SIZES):
        image = np.asarray(Image.open(sources[7 * i]).convert("RGB").resize(size, Image.BICUBIC)).astype(np.int16)
        grain = rng.integers(-60, 61, image.shape[:2])[..., None]  # fine detail that only an antialiased resize averages
        Image.fromarray(np.clip(image + grain, 0, 255).astype(np.uint8)).save(photos / f"{i}.jpg", quality=95)
    ClassifierCLI(args=["predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(photos),
                        "--data.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "logs"),
                        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"])
    with open(next((tmp_path / "logs").rglob("predictions.csv")), newline="") as f:
        predicted = {row["path"].rsplit("/", 1)[-1]: row for row in csv.DictReader(f)}

    out = tmp_path / "export"
    out.mkdir()
    for fmt in ("onnx", "pt2"):  # no batch flag: dynamic
        export_main(["--ckpt_path", str(ckpt), "--format", fmt, "--output", str(out / f"model.{fmt}")])
    meta = json.loads((out / "model.onnx.json").read_text())
    assert meta["normalizes_input"] is True and meta["dynamic_batch"] is True and meta["batch_size"] is None
    assert meta["preprocess"] == {"resize_shorter_side": meta["resize"], "interpolation": "bilinear",
                                  "antialias": True, "center_crop": meta["image_size"]}

    names = [f"{i}.jpg" for i in range(len(SIZES))]
    snippet = doc_snippet().replace('paths = ["a.jpg", "b.jpg"]', f"paths = {[str(photos / n) for n in names]!r}")
    snippet += "\nimport sys; np_probs = probs; json.dump(np_probs.tolist(), sys.stdout)\n"
    run = subprocess.run([sys.executable, "-c", snippet], check=False, cwd=out, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    probs = np.array(json.loads(run.stdout))
    assert probs.shape == (len(SIZES), len(meta["class_names"]))  # a batch of 5 through the default export
    for name, row in zip(names, probs):
        for k in range(1, 6):
            cls, p = predicted[name][f"top{k}_class"], float(predicted[name][f"top{k}_prob"])
            assert abs(row[meta["class_names"].index(cls)] - p) < 0.003, (name, cls, p, row)

    program = torch.export.load(str(out / "model.pt2")).module()
    images = torch.randint(0, 256, (4, 3, meta["image_size"], meta["image_size"]), dtype=torch.uint8)
    for batch in (images, images[:1]):  # was: "Guard failed: images.size()[0] == 1"
        onnx_probs = ort.InferenceSession(str(out / "model.onnx")).run(None, {"images": batch.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(program(batch).numpy(), onnx_probs, atol=1e-4)
