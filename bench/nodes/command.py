"""`python -m bench nodes`: its flags, and `run(args)`: step times per comm hook (`steps.measure`) or, with
--accuracy, val/acc1 per hook (`accuracy.measure`), on two simulated hosts; the result names its kind."""
from __future__ import annotations

import argparse
import signal
from typing import Any

from bench.cli import AddCommon, BenchError, Subparsers, columns_epilog
from bench.nodes.report import ACCURACY, COLUMNS
from bench.nodes.steps import DEFAULT_HOOKS, DEFAULT_RATES


def add_parser(subparsers: Subparsers, common: AddCommon) -> argparse.ArgumentParser:
    no = subparsers.add_parser(
        "nodes", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="two simulated hosts on a rate-limited link: step time, communication share and bytes per step for "
             "each DDP comm hook (needs root or CAP_NET_ADMIN)",
        description="Makes two network namespaces joined by a veth pair (scripts/netsim.sh), shapes the link to each "
                    "--rate and runs a real 2-node `python main.py fit` per comm hook, one process per namespace on "
                    "half the CPUs; a verdict per link says whether it is bandwidth-bound and what PowerSGD rank 2 "
                    "buys. --accuracy instead trains each hook against none at the quickstart budget with several "
                    "seeds and tabulates val/acc1.",
        epilog=columns_epilog(COLUMNS))
    no.add_argument("--rate", default=None, help=f"tc rates of the links, comma-separated (default: {DEFAULT_RATES}; "
                    "with --accuracy: unshaped, or the first rate given)")
    no.add_argument("--hooks", default=DEFAULT_HOOKS, help=f"rows: none, fp16, bf16, powersgd:RANK (default: "
                    f"{DEFAULT_HOOKS})")
    no.add_argument("--steps", type=int, default=10, help="timed steps per row (default: 10)")
    no.add_argument("--warmup", type=int, default=3, help="steps left out before timing; >= 3 so that PowerSGD "
                    "(started after 2 plain steps) is on in every timed step (default: 3)")
    no.add_argument("--arch", default="resnet50", help="model (default: resnet50, ~94 MB of float32 gradients)")
    no.add_argument("--image-size", type=int, default=32, help="train crop (default: 32)")
    no.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch, half per node (default: 64; with "
                    "--accuracy: the config's)")
    no.add_argument("--precision", default="32-true", help="trainer precision (default: 32-true)")
    no.add_argument("--builtin", default="small", help="built-in preset when no --data-dir (default: small)")
    no.add_argument("--data-dir", default=None, help="ImageFolder tree instead of the built-in data")
    no.add_argument("--timeout", type=int, default=900, help="seconds before a run is stopped and marked failed")
    no.add_argument("--accuracy", action="store_true", help="the accuracy experiment instead of step times")
    no.add_argument("--seeds", default="1,2", help="--accuracy: seeds (default: 1,2)")
    no.add_argument("--epochs", type=int, default=15, help="--accuracy: epochs per run (default: 15, the quickstart)")
    no.add_argument("--config", default="configs/ddp_amp.yaml", help="--accuracy: the config every run starts from "
                    "(default: configs/ddp_amp.yaml)")
    common(no)
    return no


def _stop(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGHUP as Ctrl-C: the nodes are stopped, the namespaces removed."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The step times (or, with --accuracy, the accuracy runs), as {"kind": "nodes" | "nodes-accuracy", ...};
    BenchError where this machine cannot simulate the link or a flag is wrong."""
    from netsim import link as netlink

    why = netlink.unavailable()
    if why:
        raise BenchError(f"bench nodes: {why}.")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    if args.accuracy:
        from bench.nodes import accuracy as job
    else:
        from bench.nodes import steps as job
    try:
        result = job.measure(args)
    except (ValueError, netlink.NetsimError) as error:
        raise BenchError(f"bench nodes: {error}") from error
    return {"kind": ACCURACY if args.accuracy else "nodes", **result}
