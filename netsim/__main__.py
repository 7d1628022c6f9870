"""`scripts/netsim.sh up|down|run`: two simulated hosts on this machine, and a 2-node fit across them.

  scripts/netsim.sh run --rate 200mbit -- --config configs/ddp.yaml      node 0 and node 1, then teardown
  scripts/netsim.sh up --rate 1gbit                                       make a pair and print its names
  scripts/netsim.sh down [TAG | --all]                                     remove a pair / leftovers of killed runs

`run` always removes its namespaces: on success, failure, Ctrl-C, SIGTERM or SIGHUP (the nodes get
SIGINT first, as from a terminal, and SIGKILL after --grace-s; resume from the last checkpoint with
--ckpt_path last). It exits with the nodes' status. Only a SIGKILL of `run` itself leaves the namespaces
behind; `down` removes pairs whose owner is gone.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from netsim import link as netlink
from netsim import nodes as netnodes

EXIT_REFUSED = 2


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame) -> None:
    raise _Interrupted(signum)


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default=None, help="link rate, a tc rate: 1gbit, 200mbit, 100mbps (bytes/s); "
                   "default: unshaped")
    p.add_argument("--delay", default=None, help="one-way latency (netem, where the kernel has it), e.g. 10ms")
    p.add_argument("--loss", default=None, help="packet loss (netem, where the kernel has it), e.g. 1%%")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/netsim.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="a 2-node `python main.py fit` across two simulated hosts")
    _shape_args(run)
    run.add_argument("--grace-s", type=float, default=15.0, help="seconds the nodes get to exit after Ctrl-C or "
                     "SIGTERM before they are killed (default 15)")
    run.add_argument("--dry-run", action="store_true", default=bool(os.environ.get("DRY_RUN")),
                     help="print each node's command and exit (also DRY_RUN=1); needs no root")
    run.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then the arguments of `python main.py fit`")
    upp = sub.add_parser("up", help="make a pair of namespaces and print their names (remove it with down TAG)")
    _shape_args(upp)
    dn = sub.add_parser("down", help="remove a pair; without TAG, the pairs whose owner is no longer running")
    dn.add_argument("tag", nargs="?", default=None, help="the pair's tag, as `up` printed it")
    dn.add_argument("--all", action="store_true", help="every pair this tool made, running or not")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "down":
            return _down(args)
        if args.command == "run" and args.dry_run:
            return _dry_run(args)
        why = netlink.unavailable()
        if why:
            print(f"netsim: {why}.", file=sys.stderr)
            return EXIT_REFUSED
        if args.command == "up":
            pair = netlink.up(args.rate, args.delay, args.loss, owner=os.getppid())
            print(pair.describe())
            print(f"run on node 0:  ip netns exec {pair.namespaces[0]} COMMAND")
            print(f"remove:         scripts/netsim.sh down {pair.tag}")
            return 0
        return _run(args)
    except netlink.NetsimError as error:
        print(f"netsim: {error}.", file=sys.stderr)
        return EXIT_REFUSED


def _down(args: argparse.Namespace) -> int:
    if args.tag:
        if args.tag not in netlink.existing():
            print(f"netsim: no pair {args.tag} (pairs now: {', '.join(netlink.existing()) or 'none'}).",
                  file=sys.stderr)
            return EXIT_REFUSED
        netlink.down(args.tag)
        removed = [args.tag]
    else:
        removed = netlink.down_stale(all_pairs=args.all)
    print(f"netsim: removed {', '.join(removed)}." if removed else "netsim: nothing to remove.")
    return 0


def _main_args(args: argparse.Namespace) -> list[str]:
    rest = list(args.main_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if rest and rest[0] == "fit":
        rest = rest[1:]
    return ["fit", *rest]


def _dry_run(args: argparse.Namespace) -> int:
    pair = netlink.Link(f"{netlink.PREFIX}{os.getpid()}x0", args.rate, args.delay, args.loss)
    for node in (0, 1):
        print(netnodes.shell_line(pair, node, _main_args(args)))
    return 0


def _run(args: argparse.Namespace) -> int:
    lock = threading.Lock()

    def echo(node: int, line: str) -> None:
        with lock:
            print(f"[node {node}] {line}", flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    pair = running = None
    try:
        pair = netlink.up(args.rate, args.delay, args.loss)
        print(f"netsim: {pair.describe()}", flush=True)
        running = netnodes.Nodes(pair, _main_args(args), echo=echo)
        codes = running.wait()
        status = netnodes.exit_status(codes)
        print(f"netsim: node exit codes {codes}; removing {pair.tag}.", flush=True)
        return status
    except _Interrupted as stop:
        print(f"netsim: {stop}: stopping the nodes (SIGINT, then SIGKILL after {args.grace_s:g} s) and removing "
              "the namespaces.", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the teardown itself is not interrupted
        if running is not None:
            running.stop(grace_s=args.grace_s)
        if pair is not None:
            netlink.down(pair.tag)


if __name__ == "__main__":
    sys.exit(main())
