"""`python -m bench train`: its flags, and `run(args)`: the rows they name, run by `timing.measure`."""
from __future__ import annotations

import argparse
from typing import Any

from bench.cli import AddCommon, BenchError, Subparsers, columns_epilog
from bench.train.rows import COLUMNS, ROW_NAMES


def add_parser(subparsers: Subparsers, common: AddCommon) -> argparse.ArgumentParser:
    tr = subparsers.add_parser(
        "train", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="seconds and images/s for strategy x precision x cudnn.benchmark (+ channels_last, compile), "
             "and the template's overhead against a hand-written PyTorch loop",
        description="Runs each row as a real `python main.py fit` subprocess on the same data, batch and epochs "
                    "(validation off), then a minimal hand-written PyTorch loop with the same model, data, "
                    "optimizer, batch and precision. The first epoch is warm-up and is left out of images/s. "
                    "Rows that cannot run here are listed as skipped with the reason.",
        epilog=columns_epilog(COLUMNS) + "\n\nrows: " + ", ".join(ROW_NAMES))
    tr.add_argument("--data-dir", default=None, help="ImageFolder tree (default: built-in --builtin)")
    tr.add_argument("--builtin", default=None, help="built-in preset (default: small on a CPU, medium (96 px) on CUDA)")
    tr.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class "
                    "(default: 300 on a CPU, i.e. 3000 images an epoch, to keep the run short; 600 on CUDA)")
    tr.add_argument("--val-per-class", type=int, default=None, help="built-in: val images per class")
    tr.add_argument("--arch", default=None, help="model (default: conv11 on a CPU, as the seed's 11-conv table; "
                    "resnet50 on CUDA, where conv11 at 32 px is input-bound)")
    tr.add_argument("--width", type=int, default=None, help="conv11 width (default: 32; ignored for other archs)")
    tr.add_argument("--image-size", type=int, default=None, help="train crop (default: 32 on a CPU, 96 on CUDA)")
    tr.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch size (default: 256)")
    tr.add_argument("--num-workers", type=int, default=None, help="loader workers per process (default: 2 on a "
                    "CPU; on CUDA this process's CPUs, at most 16)")
    tr.add_argument("--epochs", type=int, default=3, help="epochs per row, the first is warm-up (default: 3)")
    tr.add_argument("--overhead-pairs", type=int, default=3, help="(baseline, hand-written loop) pairs run back to "
                    "back for the overhead ratio, the median pair reported (default: 3; the table's pair is the first)")
    tr.add_argument("--rows", default=None,
                    help=f"comma list of rows to run (default: all); names: {','.join(ROW_NAMES)}")
    tr.add_argument("--timeout", type=int, default=900, help="seconds before a row is stopped and marked failed")
    common(tr)
    return tr


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The rows of --rows (default: all) on this machine's workload; BenchError for an unknown row."""
    from bench.train import timing
    from bench.train.rows import apply_workload

    rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
    unknown = sorted(set(rows or ()) - set(ROW_NAMES))
    if unknown:
        raise BenchError(f"--rows: unknown {unknown}; choose from {','.join(ROW_NAMES)}")
    apply_workload(args)
    return timing.measure(args, rows)
