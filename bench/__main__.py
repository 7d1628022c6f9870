"""`python -m bench {loaders,train,gpu,memory,nodes}`: tables (Markdown), JSON and a PNG chart for this machine."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

NOTE_HELP = "a line printed in bold above the table (e.g. 'contended smoke run, not a result')"


def _columns(columns: dict[str, str]) -> str:
    return "columns:\n" + "\n".join(
        textwrap.fill(f"{k}: {v}", width=100, initial_indent="  ", subsequent_indent="      ")
        for k, v in columns.items()
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/out", help="folder for <machine>.<kind>.md/.json/.png and the "
                   "combined <machine>.md (default: bench/out, ignored by git; the committed results are "
                   "updated only with --out bench/results)")
    p.add_argument("--machine", default=None, help="file name for this machine (default: derived from CPU/GPU model)")
    p.add_argument("--note", default=None, help=NOTE_HELP)


def build_parser() -> argparse.ArgumentParser:
    from bench.loaders.report import COLUMNS as LOADER_COLUMNS
    from bench.loaders.timing import BACKENDS
    from bench.train.rows import COLUMNS as TRAIN_COLUMNS
    from bench.train.rows import ROW_NAMES

    ap = argparse.ArgumentParser(prog="python -m bench",
                                 description="Benchmarks of this template on this machine. Results go to "
                                             "OUT/<machine>.md (all sections), plus .json and .png per command.")
    sub = ap.add_subparsers(dest="command", required=True)

    lo = sub.add_parser(
        "loaders", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="images/s and MB/s of every data backend, cold and warm page cache, with the bottleneck named",
        description="Times one epoch (or --max-batches) of each backend's real train_dataloader() on the same "
                    "dataset, first with the backend's files evicted from the page cache (cold), then again (warm, "
                    "--warm-epochs epochs), in --rounds rounds over all backends; each row is its median round. "
                    "Also measures, in the same run, the raw read rate of the files (IO ceiling, cold) and "
                    "decode-only on all cores with the backend's decoder (decode ceiling), and names each row's "
                    "bottleneck. Backends that are not installed or cannot run here are listed as skipped with "
                    "the reason.",
        epilog=_columns(LOADER_COLUMNS))
    lo.add_argument("--data-dir", default=None, help="your ImageFolder tree (ROOT/train/<class>/*, ROOT/val/...); "
                    "default: the built-in dataset (--builtin)")
    lo.add_argument("--builtin", default="imagenet", help="built-in preset when no --data-dir (default: imagenet, "
                    "~470x390 JPEGs, 1000 train images)")
    lo.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class")
    lo.add_argument("--val-per-class", type=int, default=None, help="built-in: val images per class")
    lo.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma list from {','.join(BACKENDS)} (default: all)")
    lo.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    lo.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="loader workers (default: all cores)")
    lo.add_argument("--image-size", type=int, default=224, help="train crop (default: 224)")
    lo.add_argument("--downscale-size", type=int, default=160,
                    help="Downscaled backend: shorter side <= N (default: 160, as configs/data/downscaled.yaml)")
    lo.add_argument("--warm-epochs", type=int, default=2, help="warm epochs timed per backend (default: 2)")
    lo.add_argument("--rounds", type=int, default=3, help="rounds over all backends; each row is its median round "
                    "(default: 3)")
    lo.add_argument("--max-batches", type=int, default=None,
                    help="stop an epoch after N batches (default: whole epoch)")
    lo.add_argument("--work-dir", default=None, help="where the LMDB and the downscaled copy are made, before the "
                    "clock (default: bench/out/work/<dataset name>)")
    lo.add_argument("--drop-caches", action="store_true", help="cold cache by /proc/sys/vm/drop_caches (root, "
                    "whole machine) instead of posix_fadvise on the dataset's files")
    lo.add_argument("--ceiling-images", type=int, default=2000, help="images sampled for the decode ceiling")
    lo.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (no bottleneck column)")
    lo.add_argument("--device", default=None, help="where batches go (default: cuda if available, else cpu)")
    _common(lo)

    tr = sub.add_parser(
        "train", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="seconds and images/s for strategy x precision x cudnn.benchmark (+ channels_last, compile), "
             "and the template's overhead against a hand-written PyTorch loop",
        description="Runs each row as a real `python main.py fit` subprocess on the same data, batch and epochs "
                    "(validation off), then a minimal hand-written PyTorch loop with the same model, data, "
                    "optimizer, batch and precision. The first epoch is warm-up and is left out of images/s. "
                    "Rows that cannot run here are listed as skipped with the reason.",
        epilog=_columns(TRAIN_COLUMNS) + "\n\nrows: " + ", ".join(ROW_NAMES))
    tr.add_argument("--data-dir", default=None, help="ImageFolder tree (default: built-in --builtin)")
    tr.add_argument("--builtin", default=None, help="built-in preset (default: small on a CPU, medium (96 px) on CUDA)")
    tr.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class "
                    "(default: 300 on a CPU, i.e. 3000 images an epoch, to keep the run short; 600 on CUDA)")
    tr.add_argument("--val-per-class", type=int, default=None, help="built-in: val images per class")
    tr.add_argument("--arch", default=None, help="model (default: conv11 on a CPU, as the seed's 11-conv table; "
                    "resnet50 on CUDA, where conv11 at 32 px is input-bound)")
    tr.add_argument("--width", type=int, default=None, help="conv11 width (default: 32; ignored for other archs)")
    tr.add_argument("--image-size", type=int, default=None, help="train crop (default: 32 on a CPU, 96 on CUDA)")
    tr.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch size (default: 256)")
    tr.add_argument("--num-workers", type=int, default=None, help="loader workers per process (default: 2 on a "
                    "CPU; on CUDA this process's CPUs, at most 16)")
    tr.add_argument("--epochs", type=int, default=3, help="epochs per row, the first is warm-up (default: 3)")
    tr.add_argument("--overhead-pairs", type=int, default=3, help="(baseline, hand-written loop) pairs run back to "
                    "back for the overhead ratio, the median pair reported (default: 3; the table's pair is the first)")
    tr.add_argument("--rows", default=None,
                    help=f"comma list of rows to run (default: all); names: {','.join(ROW_NAMES)}")
    tr.add_argument("--timeout", type=int, default=900, help="seconds before a row is stopped and marked failed")
    _common(tr)

    from bench.gpu import command as gpu
    from bench.memory import command as memory

    gpu.add_parser(sub, _common)
    memory.add_parser(sub, _common)
    _nodes_parser(sub)
    return ap


def _nodes_parser(sub) -> None:
    from bench.nodes.report import COLUMNS as NODES_COLUMNS
    from bench.nodes.steps import DEFAULT_HOOKS, DEFAULT_RATES

    no = sub.add_parser(
        "nodes", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="two simulated hosts on a rate-limited link: step time, communication share and bytes per step for "
             "each DDP comm hook (needs root or CAP_NET_ADMIN)",
        description="Makes two network namespaces joined by a veth pair (scripts/netsim.sh), shapes the link to each "
                    "--rate and runs a real 2-node `python main.py fit` per comm hook, one process per namespace on "
                    "half the CPUs; a verdict per link says whether it is bandwidth-bound and what PowerSGD rank 2 "
                    "buys. --accuracy instead trains each hook against none at the quickstart budget with several "
                    "seeds and tabulates val/acc1.",
        epilog=_columns(NODES_COLUMNS))
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
    _common(no)


@contextlib.contextmanager
def _no_bars_in_a_log_file() -> Iterator[None]:
    """No redrawn tqdm bars (carriage returns, cursor-up escapes) while the output goes to a file.

    tqdm reads TQDM_* defaults from the environment only once, when it is imported
    (tqdm.utils.envwrap), which happened before this runs: set it for the `main.py` subprocesses
    of `bench train`, and disable the bars of this process by a subclass the bench modules use.
    The data tools print plain lines instead (datamodules.packing.progress_display).
    """
    if sys.stderr.isatty():
        yield
        return
    import tqdm as tqdm_module

    from bench.loaders import timing as loaders

    class QuietTqdm(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    saved = (tqdm_module.tqdm, loaders.tqdm, os.environ.get("TQDM_DISABLE"))
    os.environ["TQDM_DISABLE"] = "1"
    loaders.tqdm = QuietTqdm  # imported at module level there
    tqdm_module.tqdm = QuietTqdm  # bench/train/timing.py imports it inside run()
    try:
        yield
    finally:
        tqdm_module.tqdm, loaders.tqdm = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved[2]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _no_bars_in_a_log_file():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from bench import report

    if args.command == "loaders":
        import torch

        from bench.loaders import backends as loader_backends
        from bench.loaders import report as loader_report
        from bench.loaders import timing as loaders

        root = Path(args.data_dir) if args.data_dir else loader_backends.default_root(
            args.builtin, args.train_per_class, args.val_per_class)
        work = Path(args.work_dir) if args.work_dir else Path("bench/out/work") / root.name
        work.mkdir(parents=True, exist_ok=True)
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = sorted(set(wanted) - set(loaders.BACKENDS))
        if unknown:
            print(f"--backends: unknown {unknown}; choose from {','.join(loaders.BACKENDS)}", file=sys.stderr)
            return 2
        settings = loaders.Settings(root=root, work=work, batch_size=args.batch_size, num_workers=args.num_workers,
                                    image_size=args.image_size, downscale_size=args.downscale_size,
                                    max_batches=args.max_batches, drop_caches=args.drop_caches,
                                    warm_epochs=args.warm_epochs, rounds=args.rounds,
                                    device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        result = loaders.run(settings, wanted, measure_ceilings=not args.no_ceilings,
                             ceiling_images=args.ceiling_images)
        md = loader_report.to_markdown(result)
        paths = report.write_results(args.out, "loaders", md, result, loader_report.chart(result), args.machine, args.note)
    elif args.command == "nodes":
        from netsim import link as netlink

        why = netlink.unavailable()
        if why:
            print(f"bench nodes: {why}.", file=sys.stderr)
            return 2
        import signal

        def _stop(signum, _frame):  # SIGTERM/SIGHUP as Ctrl-C: the nodes are stopped, the namespaces removed
            raise KeyboardInterrupt(signal.Signals(signum).name)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _stop)
        try:
            if args.accuracy:
                from bench.nodes import accuracy as job
                kind = "nodes-accuracy"
            else:
                from bench.nodes import report as nodes_report
                from bench.nodes import steps as job
                kind = "nodes"
            result = job.run(args)
        except (ValueError, netlink.NetsimError) as error:
            print(f"bench nodes: {error}", file=sys.stderr)
            return 2
        shown = job if args.accuracy else nodes_report
        md = shown.to_markdown(result)
        paths = report.write_results(args.out, kind, md, result, shown.chart(result), args.machine, args.note)
    elif args.command == "gpu":
        from bench.gpu import command as gpu

        md, paths = gpu.main(args)
    elif args.command == "memory":
        from bench.memory import command as memory

        md, paths = memory.main(args)
    else:
        from bench.train import report as train_report
        from bench.train import rows as train_rows
        from bench.train import timing as train

        rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
        unknown = sorted(set(rows or ()) - set(train_rows.ROW_NAMES))
        if unknown:
            print(f"--rows: unknown {unknown}; choose from {','.join(train_rows.ROW_NAMES)}", file=sys.stderr)
            return 2
        train_rows.apply_workload(args)
        result = train.run(args, rows)
        md = train_report.to_markdown(result)
        paths = report.write_results(args.out, "train", md, result, train_report.chart(result), args.machine, args.note)
    print(md)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
