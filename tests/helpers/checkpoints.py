"""Checkpoints crafted for tests."""
from __future__ import annotations

import pathlib

import torch


class _RunsCode:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def evil_file(tmp_path, name="evil.ckpt") -> tuple[pathlib.Path, pathlib.Path]:
    marker = tmp_path / "code_ran"
    path = tmp_path / name
    torch.save({"state_dict": {"backbone.fc.weight": torch.zeros(2, 2)}, "payload": _RunsCode(str(marker))}, path)
    return path, marker


def assert_onnx_export_matches(ckpt: pathlib.Path, onnx_path: pathlib.Path, size: int = 32) -> None:
    """`python -m lightning_app.export`'s ONNX file gives the checkpoint's own probabilities (onnxruntime, CPU)."""
    import numpy as np
    import onnxruntime as ort

    from datamodules.sample.transforms import normalize
    from lightning_app.export import export
    from lightning_app.module import ImageClassifier

    out, _ = export(ckpt, "onnx", onnx_path)
    images = torch.randint(0, 256, (3, 3, size, size), dtype=torch.uint8)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"images": images.numpy()})[0]
    reloaded = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True).eval()
    with torch.no_grad():
        want = reloaded(normalize(images)).softmax(-1).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
