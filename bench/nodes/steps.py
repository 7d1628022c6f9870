"""`bench nodes`: step time, images/s, the share of the step spent communicating and the bytes sent per
step, for each DDP comm hook, on two simulated hosts joined by a link of each --rate (netsim).

Every row is a real 2-node `python main.py fit` (one process per namespace, half the CPUs each) of
ResNet-50 at 32 px on the built-in data, timed per step by bench/nodes/probe.py inside the nodes. A
reference row runs the same two processes as two independent single-process fits (half the global batch
each, no all-reduce) at the same time: its step time is the compute alone, and a row's communication share
is 1 - compute / step. Bytes are the kernel's counters of each node's end of the link.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.nodes.probe import OUT_ENV
from bench.progress_bars import Progress
from netsim import link as netlink
from netsim.nodes import LAYOUT, Nodes

DEFAULT_HOOKS = "none,fp16,bf16,powersgd:1,powersgd:2,powersgd:4"
DEFAULT_RATES = "1gbit,100mbit"
# The gradients are 94 MB per step whatever the batch; the compute grows with it. 32 images per node keep a
# one-core step (a few seconds) near what 94 MB takes at 100-200 Mbit/s, the balance a GPU node meets on
# 1-10 Gbit/s Ethernet; at 128 per node this CPU's step hides the all-reduce even at 200 Mbit/s.
DEFAULT_BATCH = 64
# the compute-alone reference: each node a single-process fit (strategy auto: no process group at all)
LOCAL_LAYOUT = ["--trainer.num_nodes", "1", "--trainer.devices", "1", "--trainer.accelerator", "cpu",
                "--trainer.strategy", "auto"]


@dataclass
class Hook:
    name: str                 # none, fp16, bf16, powersgd
    rank: int | None = None   # PowerSGD's

    @property
    def label(self) -> str:
        return f"PowerSGD rank {self.rank}" if self.name == "powersgd" else ("no compression" if self.name == "none"
                                                                             else f"{self.name} compression")

    def config_args(self) -> list[str]:
        return [] if self.name == "none" else ["--config", f"configs/comm/{self.name}.yaml"]

    def args(self, start_iter: int) -> list[str]:
        extra = self.config_args()
        if self.name == "powersgd":
            extra += ["--trainer.strategy.powersgd_rank", str(self.rank),
                      "--trainer.strategy.powersgd_start_iter", str(start_iter)]
        return extra


def parse_hooks(text: str) -> list[Hook]:
    """'none,fp16,powersgd:2' -> hooks; a clear ValueError for anything else."""
    hooks = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, rank = item.partition(":")
        if name not in ("none", "fp16", "bf16", "powersgd") or (rank and name != "powersgd"):
            raise ValueError(f"--hooks: {item!r} is not none, fp16, bf16 or powersgd:RANK")
        if name == "powersgd" and not rank.isdigit():
            raise ValueError(f"--hooks: {item!r} needs a rank, e.g. powersgd:2")
        hooks.append(Hook(name, int(rank) if rank else None))
    return hooks


@dataclass
class Row:
    link: str
    hook: str
    status: str = "ok"
    reason: str = ""
    step_s: float | None = None
    images_s: float | None = None
    comm_share: float | None = None
    sent_mb_per_step: float | None = None
    vs_none: float | None = None
    step_times: list[float] = field(default_factory=list)


def fit_args(settings: dict[str, Any], root: Path, batch: int) -> list[str]:
    return ["fit", "--config", "configs/ddp.yaml",
            "--data.data_dir", settings["data_dir"], "--data.batch_size", str(batch), "--data.num_workers", "0",
            "--data.image_size", str(settings["image_size"]), "--data.val_image_size", str(settings["image_size"]),
            "--model.arch", settings["arch"], "--model.arch_kwargs", "{}",
            "--trainer.precision", settings["precision"], "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", str(settings["warmup"] + settings["steps"]),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
            "--checkpoint.save_top_k", "0", "--checkpoint.save_last", "false",
            "--trainer.callbacks+=bench.nodes.probe.StepProbe"]


def read_marks(marks: list[list[float]], warmup: int) -> tuple[list[float], float]:
    """(step times after the warm-up, megabytes sent per step over them)."""
    timed = marks[warmup:]  # marks[0] is the start, marks[k] the end of step k
    times = [b[0] - a[0] for a, b in itertools.pairwise(timed)]
    sent = (timed[-1][1] - timed[0][1]) / max(1, len(times)) / 1e6
    return times, sent


def _launch(pair: netlink.Link, args: list[list[str]], layout: list[str], out: Path, timeout_s: int
            ) -> tuple[list[dict] | None, str]:
    nodes = Nodes(pair, args, env={OUT_ENV: str(out)}, layout=layout)
    try:
        codes = nodes.wait(timeout_s)
    finally:
        nodes.stop(grace_s=0)
    if codes != [0, 0] or not all((out / f"node{n}.json").exists() for n in (0, 1)):
        lines = [ln for n in (0, 1) for ln in nodes.lines[n] if ln.strip()]
        why = next((ln for ln in reversed(lines) if "rror" in ln or "failed" in ln), lines[-1] if lines else "")
        return None, (f"timed out after {timeout_s} s (--timeout)" if None in codes else f"exit {codes}: {why[-300:]}")
    return [json.loads((out / f"node{n}.json").read_text()) for n in (0, 1)], ""


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The compute-alone reference, then every hook of --hooks on a link of each --rate."""
    from datamodules.builtin.tree import ensure_builtin

    hooks = parse_hooks(args.hooks)
    args.batch_size = args.batch_size or DEFAULT_BATCH
    rates = [r.strip() for r in (args.rate or DEFAULT_RATES).split(",") if r.strip()]
    for rate in rates:
        netlink.rate_bits(rate)
    data = Path(args.data_dir) if args.data_dir else ensure_builtin(args.builtin)
    settings = {"data_dir": str(data), "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size,
                "precision": args.precision, "warmup": args.warmup, "steps": args.steps, "rates": rates,
                "hooks": [h.label for h in hooks]}
    tmp = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    rows: list[Row] = []
    try:
        with Progress("bench nodes", 1 + len(rates) * len(hooks), tmp) as progress:
            progress.row("compute alone (two single-process fits)", 1)
            with netlink.simulated_link() as pair:  # the compute alone: two single-process fits side by side
                half = args.batch_size // 2
                got, why = _launch(pair, [fit_args(settings, tmp / f"local{n}", half) for n in (0, 1)], LOCAL_LAYOUT,
                                   tmp / "local", args.timeout)
            local = Row("none (two single-process fits)", "no all-reduce")
            if got is None:
                local.status, local.reason = "failed", why
            else:
                local.step_times = read_marks(got[0]["marks"], args.warmup)[0]
                local.step_s = statistics.median(local.step_times)
                local.images_s = args.batch_size / local.step_s
            for r, rate in enumerate(rates):
                with netlink.simulated_link(rate=rate) as pair:
                    for k, hook in enumerate(hooks):
                        progress.row(f"{rate} {hook.label}", 2 + r * len(hooks) + k)
                        rows.append(_row(pair, rate, hook, settings, tmp / f"{rate}-{k}", args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for rate in rates:
        base = next((r for r in rows if r.link == rate and r.hook == "no compression" and r.step_s), None)
        for r in rows:
            if r.link == rate and r.step_s:
                r.vs_none = r.step_s / base.step_s if base else None
                r.comm_share = max(0.0, 1 - local.step_s / r.step_s) if local.step_s else None
    return {"rows": [r.__dict__ for r in rows], "local": local.__dict__, "settings": settings,
            "created_unix": time.time()}


def _row(pair: netlink.Link, rate: str, hook: Hook, settings: dict[str, Any], work: Path, args) -> Row:
    row = Row(rate, hook.label)
    main_args = fit_args(settings, work / "logs", args.batch_size) + hook.args(start_iter=2)
    got, why = _launch(pair, [main_args, main_args], LAYOUT, work / "probe", args.timeout)
    if got is None:
        row.status, row.reason = "failed", why
        return row
    measured = [read_marks(g["marks"], args.warmup) for g in got]
    row.step_times = measured[0][0]
    row.step_s = statistics.median(row.step_times)
    row.images_s = args.batch_size / row.step_s
    row.sent_mb_per_step = statistics.mean(m[1] for m in measured)
    return row
