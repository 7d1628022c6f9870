"""`python -m bench memory`: the pinned, shared and host memory each rank and each node of a config holds.

Computed, not measured: the config is parsed by the training CLI itself (configs/default.yaml first, then
each --config, then any `--data.x y` after `--`), and the DataModule class it names sizes its loaders
with its own `plan_for` (datamodules/sizing.py, datamodules/memory.py; DALI: datamodules/dali/loader.py):
the code a run uses at start-up, for the layout given here instead of the one a run finds. Train sizes
come from the config's ProgressiveResizing callback, if any: a ring holds one size at a time (the old
size's buffers are freed as they come back), so the largest size is what counts. No data is read.
"""
from __future__ import annotations

import argparse
import importlib
import os
from typing import Any

from datamodules.cpus import cpu_share
from datamodules.memory import GIB, MemoryPlan
from datamodules.sizing import Layout


def add_parser(sub, common) -> argparse.ArgumentParser:
    m = sub.add_parser(
        "memory", help="pinned, shared and host memory per rank and per node of each --config (computed, no run)",
        description=__doc__.split("\n\n", 1)[1])
    m.add_argument("--config", action="append", default=[],
                   help="a config; repeat to stack them as main.py does (later files win)")
    m.add_argument("--rows", nargs="+", default=None, metavar="CONFIG",
                   help="one row per CONFIG (e.g. every recipe), each read first and the --config files on top")
    m.add_argument("--ranks", type=int, default=8, help="training processes (GPUs) per node (default: 8)")
    m.add_argument("--nodes", type=int, default=1, help="nodes (default: 1); the global batch is split over all")
    m.add_argument("--cpus-per-rank", type=int, default=None,
                   help="each rank's CPUs (default: this machine's CPUs / --ranks, at least 1)")
    m.add_argument("--cpu", action="store_true", help="batches stay on the CPU (no pinned memory); default: GPUs")
    m.add_argument("cli", nargs=argparse.REMAINDER, help="after `--`: main.py flags, e.g. -- --data.batch_size 512")
    common(m)
    return m


def parse_config(configs: list[str], extra: list[str]) -> dict[str, Any]:
    """The merged config as `main.py fit` parses it, nothing instantiated."""
    from lightning_app.cli import ClassifierCLI

    class ParseOnly(ClassifierCLI):
        def instantiate_classes(self) -> None:  # parse (defaults, configs, flags) and stop there
            pass

    args = [a for c in configs for a in ("--config", c)] + [a for a in extra if a != "--"]
    return ParseOnly(args=args, run=False).config.as_dict()


def train_sizes(config: dict[str, Any]) -> list[int]:
    from lightning_app.callbacks.progressive_resizing import ProgressiveResizing

    sizes: list[int] = []
    for cb in config["trainer"].get("callbacks") or []:
        if isinstance(cb, dict) and cb.get("class_path", "").endswith("ProgressiveResizing"):
            sizes += ProgressiveResizing(**cb.get("init_args", {})).sizes(config["trainer"].get("max_epochs"))
    return sizes


def plan_of(config: dict[str, Any], layout: Layout) -> tuple[str, MemoryPlan]:
    data = config["data"]
    module, _, name = data["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return name, cls.plan_for(data.get("init_args") or {}, layout, train_sizes(config))


def run(args) -> dict[str, Any]:
    cpus = args.cpus_per_rank or max(1, cpu_share(1).cpus // max(1, args.ranks))
    layout = Layout(world=args.ranks * args.nodes, ranks_per_node=args.ranks, cpus=cpus, cuda=not args.cpu)
    stacks = [[row, *args.config] for row in args.rows] if args.rows else [args.config]
    if not stacks[0]:
        raise SystemExit("bench memory: give --config FILE (repeatable) and/or --rows FILE [FILE ...].")
    rows = []
    for stack in stacks:
        name, plan = plan_of(parse_config(stack, args.cli or []), layout)
        rows.append({"configs": stack, "datamodule": name, "loaders": [p.describe() for p in plan.loaders],
                     "pinned": plan.pinned, "shm": plan.shm, "host": plan.host, "budget": vars(plan.budget),
                     "over_budget": plan.over_budget(), "line": plan.describe()})
    return {"layout": vars(layout), "nodes": args.nodes, "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    from bench.report import markdown_table

    lay = result["layout"]
    ranks = lay["ranks_per_node"]
    lines = [f"- Layout: {ranks} ranks per node x {result['nodes']} node(s), {lay['cpus']} CPUs per rank, "
             + ("batches to the GPU (pinned)" if lay["cuda"] else "batches stay on the CPU (not pinned)")
             + "; computed from each DataModule's own sizing (`plan_for`), not measured.", ""]
    table = []
    for r in result["rows"]:
        b = r["budget"]
        table.append([" + ".join(os.path.basename(c) for c in r["configs"]), r["datamodule"], "; ".join(r["loaders"]),
                      *(f"{r[k] / GIB:.2f} / {b[k] / GIB:.0f}" for k in ("pinned", "shm", "host")),
                      *(f"{r[k] * ranks / GIB:.1f}" for k in ("pinned", "shm", "host")),
                      "OVER: " + "; ".join(r["over_budget"]) if r["over_budget"] else "yes"])
    lines.append(markdown_table(["config", "data", "loaders per rank", "pinned GiB/rank (budget)",
                                 "shm GiB/rank (budget)", "host GiB/rank (budget)", "pinned GiB/node",
                                 "shm GiB/node", "host GiB/node", "within budget"], table))
    lines += ["", ("Host counts pinned and shared memory (both are RAM) and a dataset held in RAM; not each worker "
                   "process's own Python and torch. DALI rows count nvJPEG's buffers and the pinned batches, not "
                   "DALI's own queues.")]
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    labels = [" + ".join(os.path.basename(c) for c in r["configs"]) for r in result["rows"]]
    return {"title": f"Memory per rank at {result['layout']['ranks_per_node']} ranks per node", "labels": labels,
            "series": {k: [r[k] / GIB for r in result["rows"]] for k in ("pinned", "shm", "host")},
            "ylabel": "GiB per rank (lower is better)"}


def main(args) -> tuple[str, dict]:
    from bench import report

    result = run(args)
    md = to_markdown(result)
    return md, report.write_results(args.out, "memory", md, result, chart(result), args.machine, args.note)
