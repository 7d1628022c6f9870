"""Export: the ONNX and pt2 files give the checkpoint's probabilities on real images; the batch is dynamic by
default (ONNX and pt2), the JSON says the model normalises its input and how to resize, and the documented
snippet reproduces predict's probabilities."""
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

from datamodules.sample.images import decode_rgb
from datamodules.sample.transforms import normalize, val_transform
from lightning_app.cli import ClassifierCLI
from lightning_app.export import export, main
from lightning_app.module import ImageClassifier
from tests.helpers import REPO
from tests.helpers.cli import train_checkpoint

# Stated tolerance: probabilities agree to 1e-4 (absolute) with the checkpoint's own model in float32.
ATOL = 1e-4


@pytest.fixture(scope="module")
def trained_ckpt(tiny_data, tmp_path_factory):
    """A real Lightning checkpoint of a channels_last conv11 after one epoch on the tiny built-in data."""
    return train_checkpoint(tiny_data, tmp_path_factory.mktemp("export_run"), epochs=1, batch=40,
                            channels_last=True)[3]


def real_batch(data_dir, n: int) -> torch.Tensor:
    files = sorted((data_dir / "val").rglob("*.jpg"))[:: max(1, 80 // n)][:n]
    transform = val_transform(32, 1.0)
    return torch.stack([transform(decode_rgb(f)) for f in files])


def reference_probs(ckpt, images: torch.Tensor) -> torch.Tensor:
    model = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True).eval()
    with torch.no_grad():
        return model(normalize(images)).softmax(-1)


@pytest.mark.slow
def test_onnx_matches_checkpoint(trained_ckpt, tiny_data, tmp_path):
    import onnxruntime as ort

    out, side = export(trained_ckpt, "onnx", tmp_path / "m.onnx", dynamic_batch=True)
    meta = json.loads(side.read_text())
    assert meta["class_names"][:2] == ["bars", "circle"] and meta["input"]["height"] == 32
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["std"] == [0.229, 0.224, 0.225]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for n in (3, 7):  # dynamic batch
        images = real_batch(tiny_data, n)
        got = session.run(None, {"images": images.numpy()})[0]
        want = reference_probs(trained_ckpt, images).numpy()
        assert got.shape == (n, 10)
        np.testing.assert_allclose(got, want, atol=ATOL)
        assert (got.argmax(1) == want.argmax(1)).all()
    assert not list(tmp_path.glob(".*tmp*"))  # no temp file left behind


@pytest.mark.slow
def test_pt2_matches_checkpoint_fixed_batch(trained_ckpt, tiny_data, tmp_path):
    main(["--ckpt_path", str(trained_ckpt), "--format", "pt2", "--output", str(tmp_path / "m.pt2"),
          "--batch-size", "4"])
    program = torch.export.load(tmp_path / "m.pt2")
    images = real_batch(tiny_data, 4)
    got = program.module()(images)
    torch.testing.assert_close(got, reference_probs(trained_ckpt, images), atol=ATOL, rtol=0)
    assert json.loads((tmp_path / "m.pt2.json").read_text())["batch_size"] == 4


@pytest.mark.slow
def test_export_of_a_compiled_channels_last_model(tiny_data, tmp_path):
    model = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 8}, channels_last=True,
                            compile=True, pictures=[])
    model.configure_model()  # compiles the backbone in place: the state-dict keys stay the same
    ckpt = tmp_path / "compiled.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "class_names": ["a", "b", "c"]}, ckpt)
    out, _ = export(ckpt, "pt2", tmp_path / "c.pt2", dynamic_batch=True)
    images = real_batch(tiny_data, 3)
    eager = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 8})
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = eager.eval()(normalize(images)).softmax(-1)
    torch.testing.assert_close(torch.export.load(out).module()(images), want, atol=ATOL, rtol=0)


def test_export_refuses_pickled_code(tmp_path, capsys):
    from tests.helpers.checkpoints import evil_file

    path, marker = evil_file(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["--ckpt_path", str(path), "--format", "onnx", "--output", str(tmp_path / "x.onnx")])
    assert info.value.code == 2 and "needs full pickle" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "x.onnx").exists()


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
        # fine detail that only an antialiased resize averages
        grain = rng.integers(-60, 61, image.shape[:2])[..., None]
        Image.fromarray(np.clip(image + grain, 0, 255).astype(np.uint8)).save(photos / f"{i}.jpg", quality=95)
    ClassifierCLI(args=["predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(photos),
                        "--data.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "logs"),
                        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"])
    with open(next((tmp_path / "logs").rglob("predictions.csv")), newline="") as f:
        predicted = {row["path"].rsplit("/", 1)[-1]: row for row in csv.DictReader(f)}

    out = tmp_path / "export"
    out.mkdir()
    for fmt in ("onnx", "pt2"):  # no batch flag: dynamic
        main(["--ckpt_path", str(ckpt), "--format", fmt, "--output", str(out / f"model.{fmt}")])
    meta = json.loads((out / "model.onnx.json").read_text())
    assert meta["normalizes_input"] is True and meta["dynamic_batch"] is True and meta["batch_size"] is None
    assert meta["preprocess"] == {"resize_shorter_side": meta["resize"], "interpolation": "bilinear",
                                  "antialias": True, "center_crop": meta["image_size"]}

    names = [f"{i}.jpg" for i in range(len(SIZES))]
    snippet = doc_snippet().replace('paths = ["a.jpg", "b.jpg"]', f"paths = {[str(photos / n) for n in names]!r}")
    snippet += "\nimport sys; np_probs = probs; json.dump(np_probs.tolist(), sys.stdout)\n"
    run = subprocess.run([sys.executable, "-c", snippet], check=False, cwd=out, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    probs = np.array(json.loads(run.stdout))
    assert probs.shape == (len(SIZES), len(meta["class_names"]))  # a batch of 5 through the default export
    for name, row in zip(names, probs, strict=False):
        for k in range(1, 6):
            cls, p = predicted[name][f"top{k}_class"], float(predicted[name][f"top{k}_prob"])
            assert abs(row[meta["class_names"].index(cls)] - p) < 0.003, (name, cls, p, row)

    program = torch.export.load(str(out / "model.pt2")).module()
    images = torch.randint(0, 256, (4, 3, meta["image_size"], meta["image_size"]), dtype=torch.uint8)
    for batch in (images, images[:1]):  # was: "Guard failed: images.size()[0] == 1"
        onnx_probs = ort.InferenceSession(str(out / "model.onnx")).run(None, {"images": batch.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(program(batch).numpy(), onnx_probs, atol=1e-4)
