"""`bench train`: strategy x precision x cudnn.benchmark (+ channels_last, compile) as real `main.py fit` runs,
and a minimal hand-written PyTorch loop on the same model, data, batch and precision.

Each Lightning row is a subprocess `python main.py fit ...` with validation off and the
`EpochTimer` callback below writing per-epoch times; the hand-written loop is a subprocess
of `plain_loop.py` (`python -m lightning_app.bench.plain_loop SPEC.json`). The first epoch
(worker start, autotuning, compilation) is left out of images/s.
"""
from __future__ import annotations

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

from datamodules.base import BUILTIN_ROOT, REPO_ROOT
from lightning_app.bench.plain_loop import TIMES_ENV
from lightning_app.bench.report import repo_relative

INPUT_BOUND_FRAC = 0.3  # as lightning_app.callbacks: a row waiting this much measures the loader, not the row

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
    from datamodules.cpus import cpus_per_process

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
        self._last = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._sync(trainer)
        self.epochs.append({"seconds": time.perf_counter() - self._t0, "wait": self._wait,
                            "images": self._images * trainer.world_size})

    def on_fit_end(self, trainer, pl_module) -> None:
        path = os.environ.get(TIMES_ENV)
        if path and trainer.global_rank == 0:
            Path(path).write_text(json.dumps({"epochs": self.epochs, "world_size": trainer.world_size}))


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
        "--trainer.callbacks+=lightning_app.bench.train.EpochTimer",
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

def run(args, rows: list[str] | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    if args.data_dir:
        root = Path(args.data_dir).resolve()
    else:
        from datamodules.builtin import ensure_builtin

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
                     ("lr", 0.1), ("momentum", 0.9), ("nesterov", True), ("weight_decay", 5e-5),
                     ("warmup_epochs", 1.0), ("label_smoothing", 0.1))}}
        spec_file = tmp / f"plain{k}.json"
        spec_file.write_text(json.dumps(plain))
        return [sys.executable, "-m", "lightning_app.bench.plain_loop", str(spec_file)]

    try:
        bar = tqdm(specs, desc="train rows", unit="row", dynamic_ncols=True)
        for k, spec in enumerate(bar):
            bar.set_postfix_str(spec.name)
            res = Result(spec.name, spec.strategy, spec.precision, spec.benchmark, spec.channels_last, spec.compile)
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
            data, res.wall_seconds, error = _run(cmd, tmp / f"row{k}.json", args.timeout)
            if data is None:
                res.status, res.reason = "failed", error
                continue
            _fill(res, data)
        pairs = _overhead_pairs(results, commands, tmp, args)
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


def _overhead_pairs(results: list[Result], commands: dict[str, list[str]], tmp: Path, args) -> list[tuple]:
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
            data, _, _ = _run(commands[key], tmp / f"pair{i}-{key}.json", args.timeout)
            if data is None:
                return pairs
            got[key] = _steady_images_s(data["epochs"])
        pairs.append((got["baseline"], got["plain"]))
    return pairs


def to_markdown(result: dict[str, Any]) -> str:
    from lightning_app.bench.report import markdown_table

    s = result["settings"]
    table = []
    for r in result["rows"]:
        strategy = "single (hand-written)" if r["strategy"] == "plain" else r["strategy"]
        head = [r["row"], strategy, r["precision"], "on" if r["benchmark"] else "off"]
        if r["status"] != "ok":
            table.append(head + ["", "", "", f"{r['status']}: {r['reason']}", ""])
            continue
        wait = r.get("data_wait_frac")
        table.append(head + [r["devices"], f"{r['seconds']:.1f}", f"{r['images_s']:,.0f}",
                             f"{r['speedup']:.2f}x" if r["speedup"] else "",
                             "" if wait is None else f"{100 * wait:.0f}%" + (" input-bound" if is_input_bound(r) else "")])
    head_line = (f"{s['arch']} (width {s['width']}), {s['image_size']} px, global batch {s['batch_size']}, "
                 f"{s['epochs']} epochs ({s['num_workers']} workers per process), data {repo_relative(s['root'])}")
    lines = [head_line, "",
             markdown_table(list(COLUMNS), table), ""]
    bound = [r["row"] for r in result["rows"] if r["status"] == "ok" and is_input_bound(r)]
    if bound:
        lines.append(f"- **Input-bound** (data wait >= {INPUT_BOUND_FRAC:.0%}): {', '.join(bound)}. These rows measure the "
                     "data loader, not their setting: their speed-ups say little about AMP, cudnn.benchmark, "
                     "channels_last or compile. Use a faster backend (LMDB, DALI, a downscaled copy), more "
                     "--num-workers, or a heavier model per image.")
    o = result.get("overhead")
    if o:
        pairs = o.get("pairs") or [{"lightning_img_s": o["lightning_img_s"], "plain_img_s": o["plain_img_s"]}]
        each = ", ".join(f"{q['lightning_img_s']:,.0f} vs {q['plain_img_s']:,.0f}" for q in pairs)
        lines.append(f"- Template overhead: Lightning baseline vs hand-written loop, images/s, {len(pairs)} pair(s) "
                     f"run back to back: {each}. Median ratio {o['ratio']:.3f}: the template spends "
                     f"{o['overhead_pct']:+.1f}% time per image against the hand-written loop (goal: within +2%).")
    else:
        lines.append("- Template overhead: not measured (the baseline or the hand-written loop did not run).")
    lines.append("- Ratios are from one run, side by side; absolute times on a CPU are not comparable across machines.")
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    return {"title": "Training throughput per configuration (images/s)", "labels": [r["row"] for r in rows],
            "series": {"images/s": [r["images_s"] for r in rows]}, "ylabel": "images/s (higher is better)"}
