"""`bench train`'s rows: the workload per machine, the columns, every row's settings and why a row cannot run here."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

import torch

# a row waiting this much for data measures the loader, not the row: the fit's own end-of-run diagnosis
from lightning_app.callbacks.throughput import INPUT_BOUND_FRAC

# The workload when no flag says otherwise. On a CPU, the seed's small net at 32 px. On CUDA, that
# workload is input-bound on any GPU (AMP, cudnn.benchmark, channels_last and compile would all read
# about 1.0x): ResNet-50 on the 96 px built-in set, 6000 images (23 steps of 256 an epoch), every CPU
# of this process decoding.
WORKLOADS = {
    "cpu": {"builtin": "small", "train_per_class": 300, "arch": "conv11", "width": 32, "image_size": 32,
            "batch_size": 256, "num_workers": 2},
    "cuda": {"builtin": "medium", "train_per_class": 600, "arch": "resnet50", "width": 32, "image_size": 96,
             "batch_size": 256, "num_workers": None},  # None: this process's share of the affinity mask
}


def apply_workload(args, cuda: bool | None = None) -> str:
    """Fill every workload flag left unset (None) from WORKLOADS for this machine; return its name."""
    from datamodules.budget.cpus import cpus_per_process

    kind = "cuda" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    for key, value in WORKLOADS[kind].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value if value is not None else min(16, cpus_per_process(1)))
    return kind


def is_input_bound(row: dict) -> bool:
    wait = row.get("data_wait_frac")
    return wait is not None and wait >= INPUT_BOUND_FRAC

COLUMNS = {
    "row": "what differs from the baseline (single process, 32-bit, cudnn.benchmark off)",
    "strategy": "single: one device; dp: DataParallel over all GPUs in one process; ddp: one process per "
                "device (gloo on CPU)",
    "precision": "32-true, 16-mixed or bf16-mixed (autocast)",
    "benchmark": "cudnn.benchmark (autotuned convolution algorithms; CUDA only)",
    "devices": "processes (ddp) or GPUs (dp) used",
    "seconds": "training time of all epochs (validation off; process start not included)",
    "images/s": "training images per second over all processes, epochs after the first (warm-up)",
    "speed-up": "images/s of the row divided by the baseline's (same run, same data): > 1 is faster",
    "data wait": "share of step time spent waiting for the next batch (as perf/data_wait_frac); "
                 f"'input-bound' at >= {INPUT_BOUND_FRAC:.0%}",
}


@dataclass(frozen=True)
class RowSpec:
    name: str
    strategy: str = "single"       # single | dp | ddp | plain
    precision: str = "32-true"
    benchmark: bool = False
    channels_last: bool = False
    compile: bool = False


def row_specs(cuda: bool) -> list[RowSpec]:
    """Every row, baseline first and the hand-written loop right after it (back to back)."""
    fast = "16-mixed" if cuda else "32-true"
    rows = [RowSpec("baseline"), RowSpec("plain-pytorch (hand-written loop)", strategy="plain")]
    for strategy in ("single", "dp", "ddp"):
        for precision in ("32-true", "16-mixed", "bf16-mixed"):
            for bench in (False, True):
                if (strategy, precision, bench) == ("single", "32-true", False):
                    continue
                if precision == "bf16-mixed" and (bench or strategy != "single"):
                    continue  # one bf16 row is enough to show it
                parts = [] if strategy == "single" else [strategy]
                parts += [] if precision == "32-true" else [precision]
                parts += ["cudnn.benchmark"] if bench else []
                rows.append(RowSpec("+".join(parts), strategy, precision, bench))
    rows.append(RowSpec("channels_last" + (" (16-mixed, benchmark)" if cuda else ""), precision=fast,
                        benchmark=cuda, channels_last=True))
    rows.append(RowSpec("compile" + (" (16-mixed, benchmark)" if cuda else ""), precision=fast,
                        benchmark=cuda, compile=True))
    return rows


ROW_NAMES = [r.name.split(" (")[0] for r in row_specs(False)]


def skip_reason(spec: RowSpec) -> str | None:
    """Why ``spec`` cannot run on this machine, or None."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if spec.benchmark and not cuda:
        return "cudnn.benchmark needs CUDA (cuDNN); no GPU here"
    if spec.precision == "16-mixed" and not cuda:
        return "16-mixed on a CPU falls back to bf16-mixed: see the bf16-mixed row"
    if spec.precision == "bf16-mixed" and cuda and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16"
    if spec.strategy == "dp":
        if gpus < 2:
            return f"DataParallel needs >= 2 CUDA GPUs ({gpus} here)"
        try:
            from pytorch_lightning.strategies import StrategyRegistry

            import lightning_app.cli
            if "dp" not in StrategyRegistry:
                import lightning_app.strategies  # noqa: F401
        except ImportError as e:
            return f"the dp strategy is not importable ({e})"
        if "dp" not in StrategyRegistry:
            return "the dp strategy is not registered in this checkout"
    if spec.strategy == "ddp":
        if cuda and gpus < 2:
            return f"multi-GPU DDP needs >= 2 GPUs ({gpus} here)"
        if not cuda and (os.cpu_count() or 1) < 2:
            return "DDP on CPU needs >= 2 cores"
    if spec.compile:
        if not cuda and not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
            return "torch.compile on CPU needs a C compiler"
        if sys.version_info >= (3, 14):
            return "torch.compile does not support this Python"
    return None
