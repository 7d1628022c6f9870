"""`python -m bench memory`: the pinned, shared and host memory each rank and each node of a config holds.

Computed, not measured: the config is parsed by the training CLI itself (configs/default.yaml first, then
each --config, then any `--data.x y` after `--`), and the DataModule class it names sizes its loaders
with its own `plan_for` (datamodules/budget/sizing.py, datamodules/budget/memory.py; DALI: datamodules/dali/loader.py):
the code a run uses at start-up, for the layout given here instead of the one a run finds. Train sizes
come from the config's ProgressiveResizing callback, if any: a ring holds one size at a time (the old
size's buffers are freed as they come back), so the largest size is what counts. No data is read.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.cli import AddCommon, BenchError, Subparsers
from bench.memory.plan import parse_config, plan_of
from datamodules.budget.cpus import cpu_share
from datamodules.budget.sizing import Layout


def add_parser(subparsers: Subparsers, common: AddCommon) -> argparse.ArgumentParser:
    m = subparsers.add_parser(
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The memory plan of each row's config stack at --ranks x --nodes; BenchError without any config."""
    cpus = args.cpus_per_rank
    if cpus is None:
        here = cpu_share(1).cpus
        cpus = max(1, here // max(1, args.ranks))
        print(f"bench memory: sized for this machine's CPUs ({here}: {cpus} per rank of {args.ranks}); for another "
              "machine pass --cpus-per-rank (its CPUs / --ranks).", file=sys.stderr, flush=True)
    layout = Layout(world=args.ranks * args.nodes, ranks_per_node=args.ranks, cpus=cpus, cuda=not args.cpu)
    stacks = [[row, *args.config] for row in args.rows] if args.rows else [args.config]
    if not stacks[0]:
        raise BenchError("bench memory: give --config FILE (repeatable) and/or --rows FILE [FILE ...].", code=1)
    rows = []
    for stack in stacks:
        name, plan = plan_of(parse_config(stack, args.cli or []), layout)
        rows.append({"configs": stack, "datamodule": name, "loaders": [p.describe() for p in plan.loaders],
                     "pinned": plan.pinned, "shm": plan.shm, "host": plan.host, "budget": vars(plan.budget),
                     "over_budget": plan.over_budget(), "line": plan.describe()})
    return {"layout": vars(layout), "nodes": args.nodes, "rows": rows}
