"""`bench train`: strategy x precision x cudnn.benchmark (+ channels_last, compile) as real `main.py fit` runs,
and a minimal hand-written PyTorch loop on the same model, data, batch and precision.

Each Lightning row is a subprocess `python main.py fit ...` with validation off and the
`EpochTimer` callback below writing per-epoch times; the hand-written loop is a subprocess
of `plain_loop.py` (`python -m bench.train.plain_loop SPEC.json`). The first epoch
(worker start, autotuning, compilation) is left out of images/s.

The rows and their settings are in `rows.py`; the table and chart are written by `report.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from bench.progress_bars import Progress, report_step, trainer_step
from bench.train.plain_loop import TIMES_ENV
from bench.train.rows import RowSpec, is_input_bound, row_specs, skip_reason
from datamodules.base import BUILTIN_ROOT, REPO_ROOT
from models.recipes import recipe


@dataclass
class Result:
    row: str
    strategy: str
    precision: str
    benchmark: bool
    channels_last: bool
    compile: bool
    status: str = "ok"
    reason: str = ""
    devices: int | None = None
    seconds: float | None = None
    epoch_seconds: list[float] = field(default_factory=list)
    images_s: float | None = None
    speedup: float | None = None
    input_bound: bool = False
    wall_seconds: float | None = None
    data_wait_frac: float | None = None


# ------------------------------------------------------------------------------ Lightning rows

class EpochTimer(pl.Callback):
    """Writes per-epoch train seconds and images (all processes) to $BENCH_EPOCH_TIMES (rank 0)."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._sync(trainer)
        self._t0 = self._last = time.perf_counter()
        self._images, self._wait = 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._wait += time.perf_counter() - self._last

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._images += int(batch[0].shape[0])
        if trainer.global_rank == 0:
            report_step(trainer_step(trainer, batch_idx))
        self._last = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._sync(trainer)
        self.epochs.append({"seconds": time.perf_counter() - self._t0, "wait": self._wait,
                            "images": self._images * trainer.world_size})

    def on_fit_end(self, trainer, pl_module) -> None:
        path = os.environ.get(TIMES_ENV)
        if path and trainer.global_rank == 0:
            Path(path).write_text(json.dumps({"epochs": self.epochs, "world_size": trainer.world_size}))



def _or(value: Any, default: Any) -> Any:
    return default if value is None else value

def _accelerator() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def lightning_args(spec: RowSpec, cfg: dict, root_dir: Path) -> list[str]:
    cuda = torch.cuda.is_available()
    if spec.strategy == "ddp":
        strategy, devices = "ddp", str(torch.cuda.device_count() if cuda else 2)
    elif spec.strategy == "dp":
        strategy, devices = "dp", str(torch.cuda.device_count())
    else:
        strategy, devices = "auto", "1"
    args = [
        "fit",
        "--data.data_dir", str(cfg["root"]),
        "--data.batch_size", str(cfg["batch_size"]),
        "--data.num_workers", str(cfg["num_workers"]),
        "--data.image_size", str(cfg["image_size"]),
        "--data.val_image_size", str(cfg["image_size"]),
        "--model.arch", cfg["arch"],
        "--model.channels_last", str(spec.channels_last).lower(),
        "--model.compile", str(spec.compile).lower(),
        "--trainer.max_epochs", str(cfg["epochs"]),
        "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.default_root_dir", str(root_dir),
        "--trainer.accelerator", _accelerator(),
        "--trainer.devices", devices,
        "--trainer.strategy", strategy,
        "--trainer.precision", spec.precision,
        "--trainer.benchmark", str(spec.benchmark).lower(),
        "--trainer.callbacks+=bench.train.timing.EpochTimer",
    ]
    # configs/default.yaml's arch_kwargs ({width: 16}) belong to conv11: other archs get none
    args += ["--model.arch_kwargs", f"{{width: {cfg['width']}}}" if cfg["arch"] == "conv11" else "{}"]
    return args


def _run(cmd: list[str], times: Path, timeout: int) -> tuple[dict | None, float, str]:
    env = {**os.environ, TIMES_ENV: str(times), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - t0, f"timed out after {timeout} s (--timeout)"
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not times.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        why = next((line for line in reversed(tail) if "Error" in line or "error" in line), tail[-1] if tail else "")
        return None, wall, f"exit {proc.returncode}: {why[-400:]}"
    return json.loads(times.read_text()), wall, ""


def _steady_images_s(epochs: list[dict]) -> float:
    """Images/s over the epochs after the first (warm-up), or over the only one."""
    steady = epochs[1:] or epochs
    return sum(e["images"] for e in steady) / max(1e-9, sum(e["seconds"] for e in steady))


def _fill(res: Result, data: dict) -> None:
    epochs = data["epochs"]
    res.epoch_seconds = [round(e["seconds"], 3) for e in epochs]
    res.seconds = sum(e["seconds"] for e in epochs)
    steady = epochs[1:] or epochs
    res.images_s = _steady_images_s(epochs)
    res.devices = data.get("world_size", 1)
    if all("wait" in e for e in steady):
        res.data_wait_frac = sum(e["wait"] for e in steady) / max(1e-9, sum(e["seconds"] for e in steady))


def _defaults() -> dict:
    import yaml

    cfg = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    return {"model": cfg.get("model", {}), "data": cfg.get("data", {}).get("init_args", {}),
            "seed": cfg.get("seed_everything", 42)}


# ------------------------------------------------------------------------------ the table

def measure(args: argparse.Namespace, rows: list[str] | None = None) -> dict[str, Any]:
    """Every row of `row_specs` (those not in ``rows`` skipped, the baseline always run), then the overhead pairs."""
    from tqdm import tqdm

    if args.data_dir:
        root = Path(args.data_dir).resolve()
    else:
        from datamodules.builtin.tree import ensure_builtin

        root = Path(ensure_builtin(args.builtin, root=BUILTIN_ROOT, train_per_class=args.train_per_class,
                                   val_per_class=args.val_per_class))
    cfg = {"root": str(root), "batch_size": args.batch_size, "num_workers": args.num_workers,
           "image_size": args.image_size, "arch": args.arch, "width": args.width, "epochs": args.epochs}
    d = _defaults()
    specs = row_specs(torch.cuda.is_available())
    results: list[Result] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    commands: dict[str, list[str]] = {}

    def _command(spec: RowSpec, k: int) -> list[str]:
        if spec.strategy != "plain":
            return [sys.executable, "main.py", *lightning_args(spec, cfg, tmp / f"logs{k}")]
        plain = {**cfg, "precision": spec.precision, "benchmark": spec.benchmark, "seed": d["seed"],
                 "min_scale": d["data"].get("min_scale", 0.25),
                 "val_crop_ratio": d["data"].get("val_crop_ratio", 0.875),
                 **{k2: d["model"].get(k2, v) for k2, v in (
                     ("momentum", 0.9), ("nesterov", True), ("warmup_epochs", 1.0), ("label_smoothing", 0.1))},
                 # null in the config: the arch family's (models/recipes.py); the plain loop runs SGD
                 "lr": _or(d["model"].get("lr"), recipe(cfg["arch"]).lr),
                 "weight_decay": _or(d["model"].get("weight_decay"), recipe(cfg["arch"]).weight_decay)}
        spec_file = tmp / f"plain{k}.json"
        spec_file.write_text(json.dumps(plain))
        return [sys.executable, "-m", "bench.train.plain_loop", str(spec_file)]

    try:
        with Progress("bench train", len(specs), tmp) as progress:
            bar = tqdm(specs, desc="train rows", unit="row", dynamic_ncols=True)
            for k, spec in enumerate(bar):
                bar.set_postfix_str(spec.name)
                res = Result(spec.name, spec.strategy, spec.precision, spec.benchmark, spec.channels_last,
                             spec.compile)
                results.append(res)
                short = spec.name.split(" (")[0]
                why = skip_reason(spec)
                if why:
                    res.status, res.reason = "skipped", why
                    continue
                if rows is not None and short not in rows and short != "baseline":
                    res.status, res.reason = "skipped", "not selected (--rows)"
                    continue
                commands[short if spec.strategy != "plain" else "plain"] = cmd = _command(spec, k)
                progress.row(spec.name, k + 1)
                data, res.wall_seconds, error = _run(cmd, tmp / f"row{k}.json", args.timeout)
                if data is None:
                    res.status, res.reason = "failed", error
                    continue
                _fill(res, data)
            pairs = _overhead_pairs(results, commands, tmp, args, progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = results[0].images_s
    for r in results:
        r.input_bound = is_input_bound(r.__dict__)
        if r.images_s and base:
            r.speedup = r.images_s / base
    overhead = None
    if pairs:
        ratios = sorted(b / p for b, p in pairs)
        ratio = ratios[len(ratios) // 2]  # the median pair
        overhead = {"lightning_img_s": base, "plain_img_s": next(r for r in results if r.strategy == "plain").images_s,
                    "pairs": [{"lightning_img_s": b, "plain_img_s": p} for b, p in pairs],
                    "ratio": ratio, "overhead_pct": 100 * (1 / ratio - 1)}
    return {"rows": [r.__dict__ for r in results], "overhead": overhead,
            "settings": {**cfg, "cuda": torch.cuda.is_available()}}


def _overhead_pairs(results: list[Result], commands: dict[str, list[str]], tmp: Path, args,
                    progress: Progress) -> list[tuple]:
    """(Lightning, hand-written) images/s pairs: the table's pair, then --overhead-pairs - 1 more, run back
    to back, so that a slow spell of the machine lands in one pair, not in the ratio. The extra pairs
    alternate which runs first (plain first, then baseline first, ...): a machine that speeds up or
    slows down within a pair then favours neither side."""
    base, plain = results[0], next((r for r in results if r.strategy == "plain"), None)
    if not (plain and plain.images_s and base.images_s):
        return []
    pairs = [(base.images_s, plain.images_s)]
    for i in range(max(1, args.overhead_pairs) - 1):
        got = {}
        for key in (("plain", "baseline") if i % 2 == 0 else ("baseline", "plain")):
            progress.row(f"overhead pair {i + 2}/{max(1, args.overhead_pairs)} ({key})")
            data, _, _ = _run(commands[key], tmp / f"pair{i}-{key}.json", args.timeout)
            if data is None:
                return pairs
            got[key] = _steady_images_s(data["epochs"])
        pairs.append((got["baseline"], got["plain"]))
    return pairs
