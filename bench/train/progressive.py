"""Does progressive resizing reach accuracy sooner? A plain run against a progressive-resizing run.

    python -m bench.progressive --out bench/results           # the full measurement
    python -m bench.progressive --epochs 2 --budget 60 ...    # a smoke run

Both runs train the same model on the built-in `medium` preset (96 px) with the same settings and
epochs, each capped by the same wall-clock budget; the progressive run's train crop follows
64 -> 96 px (lightning_app.callbacks.progressive_resizing.ProgressiveResizing). Each run records val/acc1 against the
seconds since training started (validation included). The report says whether, and when, the
progressive run reached the plain run's final val/acc1, and writes OUT/<machine>.progressive.<arch>.md,
.json and .png (both curves). Run it on an otherwise idle machine: timings are its whole point.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from bench.cli import data_dir_problem
from bench.progress_bars import Progress, report_step, trainer_step
from bench.report import atomic_write, machine_info, machine_name, markdown_table
from datamodules.base import REPO_ROOT
from datamodules.errors import DataError

CURVE_ENV = "BENCH_CURVE_JSON"


class AccuracyClock(pl.Callback):
    """Appends {epoch, seconds, val_acc1, train_size} after every validation to $BENCH_CURVE_JSON (rank 0).

    Seconds run from the start of training (after setup and the sanity check), validation included.
    """

    def __init__(self) -> None:
        self.points: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            report_step(trainer_step(trainer, batch_idx))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0 or "val/acc1" not in trainer.callback_metrics:
            return
        self.points.append({
            "epoch": trainer.current_epoch,
            "seconds": round(time.perf_counter() - self._t0, 3),
            "val_acc1": float(trainer.callback_metrics["val/acc1"]),
            "train_size": trainer.datamodule.train_size,
        })
        path = os.environ.get(CURVE_ENV)
        if path:
            atomic_write(Path(path), json.dumps(self.points))


def run_config(args: argparse.Namespace, progressive: bool) -> dict[str, Any]:
    callbacks: list[dict[str, Any]] = [{"class_path": "bench.train.progressive.AccuracyClock"}]
    if progressive:
        start = round(args.ramp[0] * args.epochs)
        end = max(start + 1, round(args.ramp[1] * args.epochs))
        resizing = "lightning_app.callbacks.progressive_resizing.ProgressiveResizing"
        callbacks.insert(0, {"class_path": resizing, "init_args": {
            "start_size": args.start_size, "end_size": args.image_size, "start_epoch": start, "end_epoch": end,
            "step": args.step}})
    return {"trainer": {"max_epochs": args.epochs, "max_time": {"seconds": args.budget}, "callbacks+": callbacks,
                        "enable_progress_bar": False},
            "model": {"arch": args.arch, "arch_kwargs": {"width": args.width} if args.arch == "conv11" else {}},
            "data": {"init_args": {"builtin": args.preset, "data_dir": args.data_dir, "image_size": args.image_size,
                                   "val_image_size": args.image_size, "batch_size": args.batch_size,
                                   "num_workers": args.num_workers}}}


def output_stem(machine: str, arch: str) -> str:
    """`<machine>.progressive.<arch>`: runs of two archs on one machine keep their own files."""
    return f"{machine}.progressive.{arch}"


def train(args: argparse.Namespace, name: str, progressive: bool, tmp: Path) -> dict[str, Any]:
    config = tmp / f"{name}.yaml"
    config.write_text(json.dumps(run_config(args, progressive)))  # JSON is YAML
    curve = tmp / f"{name}.curve.json"
    cmd = [sys.executable, "main.py", "fit", "--config", str(config),
           "--trainer.default_root_dir", str(tmp / name), *args.extra]
    env = {**os.environ, CURVE_ENV: str(curve), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    points = json.loads(curve.read_text()) if curve.exists() else []
    return {"name": name, "command": " ".join(cmd), "config": run_config(args, progressive), "points": points,
            "process_seconds": round(wall, 1)}


def compare(plain: dict[str, Any], prog: dict[str, Any]) -> dict[str, Any]:
    """When the progressive run first reached the plain run's final val/acc1, if it did."""
    if not plain["points"] or not prog["points"]:
        return {"reached": False, "verdict": "a run recorded no validation: nothing to compare"}
    target, plain_s = plain["points"][-1]["val_acc1"], plain["points"][-1]["seconds"]
    hit = next((p for p in prog["points"] if p["val_acc1"] >= target), None)
    out = {"target_acc1": target, "plain_seconds": plain_s, "progressive_final_acc1": prog["points"][-1]["val_acc1"],
           "progressive_final_seconds": prog["points"][-1]["seconds"]}
    if hit is None:
        out.update(reached=False, verdict=f"the progressive run did not reach the plain run's final val/acc1 "
                                          f"{target:.4f} (its best: {max(p['val_acc1'] for p in prog['points']):.4f})")
    else:
        saved = 1 - hit["seconds"] / plain_s if plain_s else 0.0
        out.update(reached=True, seconds=hit["seconds"], epoch=hit["epoch"], faster=hit["seconds"] < plain_s,
                   verdict=(f"the progressive run reached the plain run's final val/acc1 {target:.4f} after "
                            f"{hit['seconds']:.0f} s (epoch {hit['epoch']}), against {plain_s:.0f} s for the plain "
                            "run: "
                            f"{100 * saved:+.0f}% wall time saved" if hit["seconds"] < plain_s else
                            f"the progressive run reached {target:.4f} only after {hit['seconds']:.0f} s, "
                            f"not sooner than the plain run's {plain_s:.0f} s"))
    return out


def to_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    data = f"`{s['data_dir']}`" if s["data_dir"] else f"the built-in `{s['preset']}` data"
    settings = (f"{s['arch']} on {data}, {s['image_size']} px, global batch {s['batch_size']}, {s['epochs']} epochs, "
                f"budget {s['budget']} s per run; progressive: {s['start_size']} -> {s['image_size']} px (ramp "
                f"{s['ramp'][0]:.2f}-{s['ramp'][1]:.2f} of the epochs, step {s['step']} px).")
    lines = [settings, "", f"**Verdict:** {result['comparison']['verdict']}.", ""]
    rows = []
    for run in (result["plain"], result["progressive"]):
        for p in run["points"]:
            rows.append([run["name"], p["epoch"], p["train_size"], f"{p['seconds']:.1f}", f"{p['val_acc1']:.4f}"])
    lines.append(markdown_table(["run", "epoch", "train px", "seconds", "val/acc1"], rows))
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in (result["plain"], result["progressive"]):
        xs = [p["seconds"] for p in run["points"]]
        ax.plot(xs, [p["val_acc1"] for p in run["points"]], marker="o", markersize=3, label=run["name"])
    cmp = result["comparison"]
    if "target_acc1" in cmp:
        ax.axhline(cmp["target_acc1"], color="grey", linestyle=":", linewidth=1, label="plain run's final val/acc1")
    ax.set_xlabel("wall-clock seconds since training started")
    ax.set_ylabel("val/acc1")
    ax.set_title(f"Progressive resizing vs plain ({result['settings']['arch']}, {result['machine_name']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.progressive", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="conv11", help="conv11 (default) or resnet50 (its standard stem at >= 64 px)")
    ap.add_argument("--width", type=int, default=16, help="conv11 width")
    ap.add_argument("--preset", default="medium", help="built-in dataset preset (default medium: 96 px)")
    ap.add_argument("--data-dir", default=None, help="an ImageFolder root instead of the built-in data")
    ap.add_argument("--image-size", type=int, default=96, help="the plain run's (and the final) train size")
    ap.add_argument("--start-size", type=int, default=64, help="the progressive run's first train size")
    ap.add_argument("--ramp", type=float, nargs=2, default=(0.25, 0.75), metavar=("START", "END"),
                    help="the ramp's start and end, as fractions of the epochs (default 0.25 0.75)")
    ap.add_argument("--step", type=int, default=16, help="ramp sizes are multiples of this (px)")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--budget", type=int, default=3600, help="wall-clock cap per run, seconds")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--out", default="bench/out", help="results folder (default bench/out; bench/results to publish)")
    ap.add_argument("extra", nargs="*", help="more `main.py fit` flags for both runs, after --")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    problem = data_dir_problem(args.data_dir)
    if problem:
        raise DataError(problem)  # python -m bench.progressive ends it in one paragraph, exit 2
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-progressive-") as tmp, \
            Progress("python -m bench.progressive", 2, Path(tmp)) as progress:
        progress.row("plain", 1)
        plain = train(args, "plain", False, Path(tmp))
        progress.row("progressive", 2)
        prog = train(args, "progressive", True, Path(tmp))
    result = {"settings": {k: v for k, v in vars(args).items() if k != "extra"} | {"ramp": list(args.ramp)},
              "plain": plain, "progressive": prog, "comparison": compare(plain, prog), "machine": info,
              "machine_name": machine_name(info), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO_ROOT / out
    stem = out / output_stem(result["machine_name"], args.arch)
    atomic_write(Path(f"{stem}.json"), json.dumps(result, indent=1, default=str) + "\n")
    atomic_write(Path(f"{stem}.md"), f"## progressive resizing vs plain\n\n`python -m bench."
                  f"progressive {' '.join(argv if argv is not None else sys.argv[1:])}` at {result['created']}\n\n"
                  + to_markdown(result) + f"\n![curves]({stem.name}.png)\n")
    plot(result, Path(f"{stem}.png"))
    print(to_markdown(result))
    print(f"Wrote {stem}.md, .json and .png")
    return result


if __name__ == "__main__":
    main()
