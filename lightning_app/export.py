"""Ship a trained model: `python -m lightning_app.export --ckpt_path CKPT --format onnx|pt2 --output PATH`.

The exported model takes uint8 RGB images (N, 3, H, W) at the validation size, any N unless
--batch-size fixes it, normalises them itself, and returns class probabilities (N, num_classes).
Beside it, PATH.json holds what a caller needs: the class names, the input size, how validation
resized (shorter side to `resize`, antialiased bilinear, then a centre crop), and the mean/std built in.

The backbone is rebuilt from the checkpoint's hyperparameters and weights, so a checkpoint of a
`compile`d or `channels_last` model exports the same way (compile works in place and keeps the
state-dict keys; the memory format is not stored). The checkpoint is read with weights_only=True.
Both files are written to a temporary name and renamed into place.

Check an ONNX file with onnxruntime:
    sess = onnxruntime.InferenceSession(PATH); sess.run(None, {"images": uint8_nchw})[0]
and a pt2 file with torch.export.load(PATH).module()(uint8_nchw).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_app.disk_full import DiskFull, checkpoint_bytes, no_space
from lightning_app.runs.folders import free_bytes
from lightning_app.weights import WeightsError, safe_load, strip_prefixes
from models import create_model, own_kwargs

FORMATS = ("onnx", "pt2")
MAX_BATCH = 4096
SLACK_BYTES = 1 << 20  # what an export writes beside the weights (its graph, the .json), about: a floor, not a bound


class ExportedClassifier(nn.Module):
    """uint8 RGB NCHW -> probabilities, normalisation inside."""

    def __init__(self, backbone: nn.Module, mean, std) -> None:
        super().__init__()
        self.backbone = backbone
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255)
        self.register_buffer("inv_std", 1 / (torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.to(torch.float32) - self.mean) * self.inv_std
        return self.backbone(x).softmax(dim=-1)


def load_for_export(ckpt_path: str | os.PathLike) -> tuple[ExportedClassifier, dict]:
    """(the exportable model in eval mode, the metadata for PATH.json) from a checkpoint of ours."""
    ckpt = safe_load(ckpt_path, "checkpoint")
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise WeightsError(f"{ckpt_path} is not a checkpoint of this template (no state_dict / hyper_parameters).")
    h = ckpt["hyper_parameters"]
    state = {strip_prefixes(k[len("backbone."):]): v for k, v in ckpt["state_dict"].items()
             if k.startswith("backbone.")}
    backbone = create_model(h["arch"], num_classes=int(h["num_classes"]), image_size=int(h.get("image_size", 224)),
                            **own_kwargs(h["arch"], h.get("arch_kwargs")))
    backbone.load_state_dict(state, strict=True)
    inference = dict(ckpt.get("inference") or {})
    data = ckpt.get("datamodule_hyper_parameters") or {}
    size = int(inference.get("image_size") or data.get("val_image_size") or data.get("image_size") or h["image_size"])
    ratio = float(data.get("val_crop_ratio") or 1.0)
    mean, std = inference.get("mean", list(IMAGENET_MEAN)), inference.get("std", list(IMAGENET_STD))
    names = list(ckpt.get("class_names") or [str(i) for i in range(int(h["num_classes"]))])
    resize = int(inference.get("resize") or round(size / ratio))
    meta = {
        "class_names": names,
        "input": {"dtype": "uint8", "layout": "NCHW", "channels": "RGB", "height": size, "width": size,
                  "range": "0..255, not normalised: the model normalises its input itself"},
        "normalizes_input": True,  # (x - 255 * mean) / (255 * std) inside the model: feed raw uint8 pixels
        "image_size": size,
        "resize": resize,
        # how predict and validation prepared each image (datamodules/sample/crop.py, ValCrop)
        "preprocess": {"resize_shorter_side": resize, "interpolation": "bilinear", "antialias": True,
                       "center_crop": size},
        "resize_interpolation": "bilinear, antialiased (torchvision resize(..., antialias=True))",
        "mean": list(mean),
        "std": list(std),
        "output": "probabilities (N, num_classes), softmax over class_names",
        "arch": h["arch"],
    }
    return ExportedClassifier(backbone, mean, std).eval(), meta



def export(ckpt_path: str | os.PathLike, fmt: str, output: str | os.PathLike, dynamic_batch: bool | None = None,
           batch_size: int | None = None) -> tuple[Path, Path]:
    """Write the model and PATH.json; return both paths.

    The batch dimension is dynamic (1 to MAX_BATCH) unless `batch_size` fixes it (or dynamic_batch=False: 1).
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}.")
    if batch_size is not None and batch_size < 1:
        raise WeightsError(f"--batch-size must be >= 1, got {batch_size}.")
    dynamic_batch = batch_size is None and dynamic_batch is not False
    batch_size = batch_size or 1
    model, meta = load_for_export(ckpt_path)
    size = meta["image_size"]
    output = Path(output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    # Trace with a batch of 2 when the batch is dynamic: torch.export specialises sizes 0 and 1.
    example = torch.randint(0, 256, (2 if dynamic_batch else batch_size, 3, size, size), dtype=torch.uint8)
    shapes = {"images": {0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}} if dynamic_batch else None
    # A full disk is found before the write: torch.export's archive writer (a C++ zip stream) reports it as "unexpected
    # pos N vs M" and then aborts the process from its destructor ("terminate called after throwing ...")
    needed = checkpoint_bytes(model.state_dict()) + SLACK_BYTES
    free = free_bytes(output.parent)
    if free is not None and free < needed:
        full = DiskFull(str(output), needed, folder=str(output.parent))
        full.refused = True
        full.elsewhere, full.then = "write it to another disk with --output", "run the export again"
        raise full
    tmp = output.with_name(f".{output.stem}.tmp{os.getpid()}{output.suffix}")  # torch.export.save wants .pt2
    try:
        with torch.no_grad():
            if fmt == "pt2":
                program = torch.export.export(model, (example,), dynamic_shapes=shapes)
                torch.export.save(program, tmp)
            else:
                torch.onnx.export(model, (example,), tmp, dynamo=True, external_data=False, dynamic_shapes=shapes,
                                  input_names=["images"], output_names=["probabilities"])
        meta.update(format=fmt, batch_size=None if dynamic_batch else batch_size, dynamic_batch=dynamic_batch,
                    checkpoint=str(ckpt_path))
        side = output.with_name(output.name + ".json")
        side_tmp = side.with_name(f".{side.name}.tmp{os.getpid()}")
        side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, output)
        os.replace(side_tmp, side)
    finally:
        for leftover in (tmp, output.with_name(f".{output.name}.json.tmp{os.getpid()}")):
            if leftover.exists():
                leftover.unlink()
    return output, side


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lightning_app.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt_path", required=True, help="a checkpoint of this template (read with weights_only=True)")
    ap.add_argument("--format", choices=FORMATS, required=True)
    ap.add_argument("--output", required=True, help="the model file; PATH.json is written beside it")
    ap.add_argument("--batch-size", type=int, default=None,
                    help=f"fix the batch size to N (default: any batch from 1 to {MAX_BATCH})")
    ap.add_argument("--dynamic-batch", action="store_true", help=argparse.SUPPRESS)  # the default now
    args = ap.parse_args(argv)
    try:
        model_path, side = export(args.ckpt_path, args.format, args.output, batch_size=args.batch_size)
    except (WeightsError, DiskFull) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # a full disk: one paragraph (torch.onnx and torch.export wrap the OSError)
        if no_space(e) is None:
            raise
        full = DiskFull(args.output, folder=os.path.dirname(os.path.abspath(args.output)))
        full.elsewhere, full.then = "write it to another disk with --output", "run the export again"
        print(f"error: {full}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {model_path} and {side}")


if __name__ == "__main__":
    main()
