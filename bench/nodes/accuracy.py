"""`bench nodes --accuracy`: what each comm hook does to the result. Every hook against none, at the
quickstart budget (configs/ddp_amp.yaml on the built-in data, 15 epochs), with several seeds, each run a
real 2-node fit on two simulated hosts. Compression changes the optimisation (PowerSGD is a biased
compressor; its error feedback makes up for it over the steps): this measures by how much.
"""
from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.nodes.steps import parse_hooks
from bench.progress_bars import Progress
from netsim import link as netlink
from netsim.nodes import Nodes

_BEST = re.compile(r"Done: best val/acc1 ([0-9.]+)")
_EPOCH = re.compile(r"^epoch (\d+)/\d+: .*val/acc1 ([0-9.]+)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every hook of --hooks against none, once per seed of --seeds, on one simulated link."""
    from datamodules.builtin.tree import ensure_builtin

    hooks = parse_hooks(args.hooks)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    data = Path(args.data_dir) if args.data_dir else ensure_builtin(args.builtin)
    rate = args.rate.split(",")[0].strip() if args.rate else None
    settings = {"config": args.config, "epochs": args.epochs, "seeds": seeds, "data_dir": str(data),
                "batch_size": args.batch_size,
                "rate": rate or "unshaped", "hooks": [h.label for h in hooks]}
    runs = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-nodes-accuracy-"))
    try:
        with netlink.simulated_link(rate=rate) as pair, \
                Progress("bench nodes --accuracy", len(hooks) * len(seeds), tmp) as progress:
            for hook in hooks:
                for seed in seeds:
                    progress.row(f"{hook.label}, seed {seed}", len(runs) + 1)
                    runs.append(_one(pair, hook, seed, settings, tmp / f"{hook.label}-{seed}", args.timeout))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"runs": runs, "settings": settings, "created_unix": time.time()}


def _one(pair: netlink.Link, hook, seed: int, settings: dict[str, Any], root: Path, timeout_s: int) -> dict[str, Any]:
    args = ["fit", "--config", settings["config"], *hook.config_args(), "--seed_everything", str(seed),
            "--data.data_dir", settings["data_dir"], "--trainer.max_epochs", str(settings["epochs"]),
            "--trainer.default_root_dir", str(root), "--trainer.callbacks+=bench.nodes.probe.ReportSteps"]
    if settings["batch_size"]:
        args += ["--data.batch_size", str(settings["batch_size"])]
    if hook.name == "powersgd":
        args += ["--trainer.strategy.powersgd_rank", str(hook.rank)]  # starts where the config says (its default)
    t0 = time.perf_counter()
    nodes = Nodes(pair, args)
    try:
        codes = nodes.wait(timeout_s)
    finally:
        nodes.stop(grace_s=0)
    out = nodes.output(0)
    best = _BEST.search(out)
    epochs = [(int(m.group(1)), float(m.group(2))) for m in map(_EPOCH.match, out.splitlines()) if m]
    row = {"hook": hook.label, "seed": seed, "seconds": round(time.perf_counter() - t0, 1), "exit": codes,
           "best_acc1": float(best.group(1)) if best else None, "final_acc1": epochs[-1][1] if epochs else None}
    if codes != [0, 0] or best is None:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        row["error"] = next((ln for ln in reversed(lines) if "rror" in ln or "failed" in ln), last)
    return row
