"""The device decode's time split, JPEG decode against crop and resize, for each device resize, side by side.

    python -m bench.gpu.resize_split [--data-dir DIR] [--device cuda] [--batches 4] [--batch-size 64]
                                     [--modes dense,banded,auto]

`DeviceDecode` (datamodules/sample/device_decode.py) over the same batches of real JPEGs (by default the built-in
data's ImageNet-sized preset, about 470 x 390 px, written to a temporary folder) at 224 px with the ImageNet
recipes' crops, with a decoder per FIC_DEVICE_RESIZE mode, the modes in turn on each batch; for each, the seconds
its `Waits` counted in the JPEG decode and in the crop and resize, and the crop's share of the two: what the
end-of-run line (decode_line) says. `auto` is the default form: on a CPU the sparse CSR products
(sparse_resize.py), on CUDA the Triton kernels. On a CPU the decode is libjpeg-turbo and every resize runs on one
intra-op thread (device_resize.py, `_on_one_thread`). On CUDA the crop's seconds are its launches (the kernels
run on after them).

On the shared 2-core VM (Intel Xeon, 2026-12-02, load 6 to 11; bench/results/cpu-2c-intel-xeon.resize-split.md),
`--batches 3 --batch-size 64`, three runs: the crop and resize 19 to 26% of the two with auto (sparse), 63 to 74%
banded, 67 to 72% dense; before the sparse form and the one thread, the banded form's were 79 to 82% (1.8 s a
batch against 0.4 s of JPEG decode).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

MODES = ("dense", "banded", "auto")


def resize_split(root: Path, device: str = "cpu", batches: int = 4, batch_size: int = 64, size: int = 224,
                 modes: tuple[str, ...] = MODES) -> dict[str, dict[str, float]]:
    """Per mode: jpeg and crop seconds a batch, and crop's share of jpeg + crop."""
    from datamodules.sample.crop import TrainCrop
    from datamodules.sample.dataset import FileSource
    from datamodules.sample.device_decode import DeviceDecode
    from datamodules.sample.encoded import EncodedDataset

    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))[:(batches + 1) * batch_size]
    source = FileSource(paths, "the bench's data")
    dataset = EncodedDataset(source, [0] * len(paths), TrainCrop(0.08), size)
    torch.manual_seed(0)
    encoded = [dataset.__getitems__(list(range(k * batch_size, (k + 1) * batch_size))) for k in range(batches + 1)]
    before = os.environ.get("FIC_DEVICE_RESIZE")
    decoders = {}
    try:
        for mode in modes:  # each warmed up on the first batch, not counted (TorchScript compiles on its first call)
            os.environ["FIC_DEVICE_RESIZE"] = mode
            decoders[mode] = DeviceDecode(device, source.describe)
            decoders[mode](encoded[0])
            decoders[mode].waits.jpeg = decoders[mode].waits.crop = 0.0
        for batch in encoded[1:]:  # the modes in turn on each batch: a shared machine's load falls on all alike
            for mode, decoder in decoders.items():
                os.environ["FIC_DEVICE_RESIZE"] = mode
                decoder(batch)
                if decoder.cuda:
                    torch.cuda.synchronize()
    finally:
        if before is None:
            os.environ.pop("FIC_DEVICE_RESIZE", None)
        else:
            os.environ["FIC_DEVICE_RESIZE"] = before
    result = {}
    for mode, decoder in decoders.items():
        jpeg, crop = decoder.waits.jpeg / batches, decoder.waits.crop / batches
        result[mode] = {"jpeg_s": jpeg, "crop_s": crop, "crop_share": crop / (jpeg + crop)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, help="an ImageFolder tree of JPEGs (default: the built-in "
                        "ImageNet-sized preset, written to a temporary folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="resize-split-") as tmp:
        root = args.data_dir
        if root is None:
            from datamodules.builtin.tree import generate

            per_class = -(-(args.batches + 1) * args.batch_size // 10)
            root = generate(Path(tmp) / "img", "imagenet", train_per_class=per_class, val_per_class=1, progress=False)
        start = time.perf_counter()
        split = resize_split(root, args.device, args.batches, args.batch_size, modes=tuple(args.modes.split(",")))
    seconds = time.perf_counter() - start
    print(f"{args.batches} batches of {args.batch_size} at 224 px on {args.device} ({seconds:.0f} s)")
    for mode, row in split.items():
        print(f"{mode:>7}: JPEG decode {row['jpeg_s'] * 1e3:7.1f} ms a batch, crop + resize {row['crop_s'] * 1e3:7.1f} "
              f"ms a batch: {row['crop_share']:.0%} of the two")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
