"""`python -m bench loaders`: its flags, and `run(args)`: the settings they name, timed by `timing.measure`."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from bench.cli import AddCommon, BenchError, Subparsers, columns_epilog
from bench.loaders.backends import BACKENDS
from bench.loaders.report import COLUMNS


def add_parser(subparsers: Subparsers, common: AddCommon) -> argparse.ArgumentParser:
    lo = subparsers.add_parser(
        "loaders", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="images/s and MB/s of every data backend, cold and warm page cache, with the bottleneck named",
        description="Times one epoch (or --max-batches) of each backend's real train_dataloader() on the same "
                    "dataset, first with the backend's files evicted from the page cache (cold), then again (warm, "
                    "--warm-epochs epochs), in --rounds rounds over all backends; each row is its median round. "
                    "Also measures, in the same run, the raw read rate of the files (IO ceiling, cold) and "
                    "decode-only on all cores with the backend's decoder (decode ceiling), and names each row's "
                    "bottleneck. Backends that are not installed or cannot run here are listed as skipped with "
                    "the reason. Each region-decode row (ImageFolder, LMDB) is set beside its whole-decode row and "
                    "PIL's ceiling, round by round: the ratio of the images/s and of the CPU time per image of all "
                    "its processes (the timing process and its workers, from /proc), the steadier one on a machine "
                    "others share (whole epochs only: with --max-batches the batches the workers decoded ahead "
                    "count too).",
        epilog=columns_epilog(COLUMNS))
    lo.add_argument("--data-dir", default=None, help="your ImageFolder tree (ROOT/train/<class>/*, ROOT/val/...), "
                    "e.g. real ImageNet photos: docs/data.md, \"Region decode\", says how to make one from "
                    "github.com/EliSchwartz/imagenet-sample-images; default: the built-in dataset (--builtin)")
    lo.add_argument("--builtin", default="imagenet", help="built-in preset when no --data-dir (default: imagenet, "
                    "~470x390 JPEGs, 1000 train images)")
    lo.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class")
    lo.add_argument("--val-per-class", type=int, default=None, help="built-in: val images per class")
    lo.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma list from {','.join(BACKENDS)} (default: all)")
    lo.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    lo.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="loader workers (default: all cores)")
    lo.add_argument("--image-size", type=int, default=224, help="train crop (default: 224)")
    lo.add_argument("--min-scale", type=float, default=0.25, help="train crop's smallest area fraction (default: "
                    "0.25, the DataModules'; ImageNet recipes: 0.08): region decode gains more on smaller crops")
    lo.add_argument("--downscale-size", type=int, default=160,
                    help="Downscaled backend: shorter side <= N (default: 160, as configs/data/downscaled.yaml)")
    lo.add_argument("--warm-epochs", type=int, default=2, help="warm epochs timed per backend (default: 2)")
    lo.add_argument("--rounds", type=int, default=3, help="rounds over all backends; each row is its median round "
                    "(default: 3)")
    lo.add_argument("--max-batches", type=int, default=None,
                    help="stop an epoch after N batches (default: whole epoch)")
    lo.add_argument("--work-dir", default=None, help="where the LMDB and the downscaled copy are made, before the "
                    "clock (default: bench/out/work/<dataset name>)")
    lo.add_argument("--drop-caches", action="store_true", help="cold cache by /proc/sys/vm/drop_caches (root, "
                    "whole machine) instead of posix_fadvise on the dataset's files")
    lo.add_argument("--ceiling-images", type=int, default=2000, help="images sampled for the decode ceiling")
    lo.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (no bottleneck column)")
    lo.add_argument("--device", default=None, help="where batches go (default: cuda if available, else cpu)")
    common(lo)
    return lo


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every backend of --backends timed on --data-dir (or the built-in data); BenchError for an unknown one."""
    import torch

    from bench.loaders import timing
    from bench.loaders.backends import default_root
    from bench.loaders.prepared import Settings

    root = Path(args.data_dir) if args.data_dir else default_root(args.builtin, args.train_per_class,
                                                                  args.val_per_class)
    work = Path(args.work_dir) if args.work_dir else Path("bench/out/work") / root.name
    work.mkdir(parents=True, exist_ok=True)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(wanted) - set(BACKENDS))
    if unknown:
        raise BenchError(f"--backends: unknown {unknown}; choose from {','.join(BACKENDS)}")
    settings = Settings(root=root, work=work, batch_size=args.batch_size, num_workers=args.num_workers,
                        image_size=args.image_size, min_scale=args.min_scale, downscale_size=args.downscale_size,
                        max_batches=args.max_batches, drop_caches=args.drop_caches,
                        warm_epochs=args.warm_epochs, rounds=args.rounds,
                        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return timing.measure(settings, wanted, measure_ceilings=not args.no_ceilings, ceiling_images=args.ceiling_images)
