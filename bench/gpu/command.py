"""`python -m bench gpu`: every GPU path of the template, checked and timed, in one command.

One row per path, each with a verdict (what it was compared with, and the tolerance) and a figure:
the compute ceiling (ResNet-50 at 224 on synthetic on-device batches), each data backend's end-to-end
training images/s as a share of that ceiling (--steps batches timed after --warmup, a stream across
epochs: throughput, not loader start-up), DALI `mixed` (pixels against DALI CPU, images/s with and
without the hardware JPEG decoder), 16-mixed and bf16-mixed against 32-true with TF32 (what fp32
training runs at on Ampere and later), channels_last, cudnn.benchmark and compile against the plain
step, dp (>= 2 GPUs) and NCCL DDP (every GPU of the node), and the template's own training step under a
Lightning Trainer (ImageClassifier, its fused SGD: 16-mixed, bf16-mixed, channels_last, compile, synthetic
and ImageFolder data, with its host syncs per step and peak memory). The `input` group says where the input time
goes with real JPEGs: the ImageFolder loader alone (to the device and normalised, no model) at 16, 14, 12 and 8
workers (capped at the CPUs), the best count with pin_memory off, end-to-end training and the step alone at that
count, one core's decode + crop rate (x the workers: the CPU decode ceiling), the training process's CPU, and a
VERDICT naming the limit (decode CPU, the main process, contention, the H2D copy / pinning, or the GPU step) with
its arithmetic (bench/gpu/input.py). The `trace` group profiles one `--data.decode gpu` fit and says where the
decode thread's batch goes: waiting on the GPU, launching, copying, allocating or its own host work, each kernel's
queue delay, the allocation calls, the decode thread's CPU time, a VERDICT naming one limit, and A/B rows of the
side stream's priority and of blocking sync, with the trace for Perfetto (bench/gpu/trace.py). The `engines` group
counts the hardware JPEG engines and times the decode alone (bench/gpu/engines.py); `ema` counts the EMA callback's
host syncs on CUDA (bench/gpu/ema.py).

Without a usable CUDA device it says so in one paragraph and exits 2. `--allow-cpu` rehearses on a CPU
instead: every GPU row skipped with its reason, the compute ceiling (at a small size) and the backend shares
run for real, figures that are no GPU result.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import torch

from bench.cli import AddCommon, BenchError, Subparsers
from bench.gpu import ema, engines, parallel, powersgd, trace, trace_ab
from bench.gpu import input as input_group  # not `input`: the builtin
from bench.gpu.checks import Check, Workload, compute_ceiling, precision_steps, speed_flags
from bench.gpu.data import NO_CUDA, backend_rows, batches_needed, dali_rows
from bench.gpu.trainer import DATA_WARMUP, DECODE_NAMES, NAMES, trainer_rows

NO_USABLE_CUDA = (
    "bench gpu: no usable CUDA device here (torch.cuda.is_available() is False), so there is no GPU path to check "
    "or time. Run it on a machine whose torch sees its GPU (`python -c \"import torch; "
    "print(torch.cuda.is_available(), torch.version.cuda)\"`; docs/clusters.md, \"Installing on a GPU cluster\"), "
    "or pass --allow-cpu to rehearse the rows that run on a CPU."
)

GROUPS = ("ceiling", "trainer", "backends", "input", "dali", "precision", "flags", "dp", "ddp", "powersgd", "engines",
          "trace", "ema")
# On a CPU the same code runs, small enough to finish in a minute or two.
DEFAULTS = {"cuda": {"image_size": 224, "batch_size": 256, "steps": 30, "warmup": 10},
            "cpu": {"image_size": 64, "batch_size": 16, "steps": 3, "warmup": 1}}


def add_parser(subparsers: Subparsers, common: AddCommon) -> argparse.ArgumentParser:
    g = subparsers.add_parser(
        "gpu", help="every GPU path checked and timed: DALI mixed, AMP, speed flags, dp, NCCL DDP, each "
                    "backend's training images/s as a share of the compute ceiling, and where the input time goes",
        description=__doc__.split("\n\n", 1)[1])
    g.add_argument("--data-dir", default=None, help="ImageFolder tree for the backend and DALI rows "
                   "(default: the built-in --builtin)")
    g.add_argument("--builtin", default="imagenet", help="built-in preset (default: imagenet, ~470x390 JPEGs)")
    g.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class")
    g.add_argument("--arch", default="resnet50", help="model of every row (default: resnet50)")
    g.add_argument("--image-size", type=int, default=None, help="px (default: 224 on CUDA, 64 on a CPU)")
    g.add_argument("--batch-size", type=int, default=None, help="per step (default: 256 on CUDA, 16 on a CPU)")
    g.add_argument("--steps", type=int, default=None, help="timed steps (batches) per row, backends included "
                   "(default: 30 on CUDA, 3 on a CPU)")
    g.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 10 on CUDA, 1 on a CPU)")
    g.add_argument("--num-workers", type=int, default=None, help="loader workers (default: this process's CPUs)")
    g.add_argument("--precision", default=None, choices=["16-mixed", "bf16-mixed"],
                   help="AMP of the backend rows and speed flags (default: the ceiling's, the faster one it "
                        "measured, when the ceiling runs; else bf16-mixed where the GPU has it)")
    g.add_argument("--backends", default=None, help="comma list of backends (default: all)")
    g.add_argument("--synthetic", default="all", choices=["all", "ceiling"],
                   help="the trainer group's synthetic rows: all, or only the two its data rows are a share of "
                        "(16-mixed + channels_last, with and without compile)")
    g.add_argument("--data-rows", default="all", choices=["all", "decode"],
                   help="the trainer group's data rows: all, or the GPU decode's goal rows in one call (ImageFolder "
                        "and LMDB, --data.decode cpu and gpu, without and with compile; the two synthetic rows they "
                        "are a share of)")
    g.add_argument("--groups", default=",".join(GROUPS), help=f"comma list from {','.join(GROUPS)} (default: all)")
    g.add_argument("--allow-cpu", action="store_true", help="without a usable CUDA device, rehearse on the CPU "
                   "(GPU rows skipped) instead of stopping with exit status 2")
    common(g)
    g.set_defaults(out="bench/out")
    return g


def _defaults(args) -> Workload:
    from datamodules.budget.cpus import cpus_per_process

    cuda = torch.cuda.is_available()
    for key, value in DEFAULTS["cuda" if cuda else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_workers is None:
        args.num_workers = cpus_per_process(1)
    return Workload(args.arch, args.image_size, args.batch_size, args.warmup, args.steps, "cuda" if cuda else "cpu",
                    args.precision)


def gpu_info() -> dict[str, Any]:
    """GPU names, the NVIDIA driver (nvidia-smi) and the CUDA/cuDNN versions torch was built with."""
    if not torch.cuda.is_available():
        return {"gpus": [], "driver": None}
    driver = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        driver = out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "driver": driver, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


# ------------------------------------------------------------------------------ data

def _root(args, w: Workload, batches: int) -> Path:
    """--data-dir, or the built-in preset with enough train images per class for `batches` (warm-up + timed)
    in one epoch (10 classes)."""
    if args.data_dir:
        return Path(args.data_dir)
    from bench.loaders.backends import default_root

    per_class = args.train_per_class or max(100, -(-batches * w.batch_size // 10))
    return default_root(args.builtin, per_class, None)


# ------------------------------------------------------------------------------ the run

def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every path of --groups checked and timed; one that fails is a FAIL row, one that cannot run here skipped."""
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise BenchError(NO_USABLE_CUDA, 2)
    w = _defaults(args)
    groups = {g.strip() for g in args.groups.split(",") if g.strip()}
    unknown = sorted(groups - set(GROUPS))
    if unknown:
        raise BenchError(f"--groups: unknown {unknown}; choose from {','.join(GROUPS)}", 2)
    cuda = w.device == "cuda"
    checks: list[Check] = []

    def skipped(group: str, names: list[str], why: str) -> None:
        checks.extend(Check(group, n, "skipped", why) for n in names)

    partial = Path(args.out) / f"{args.machine or 'this-machine'}.gpu.partial.json"

    def guarded(group: str, name: str, fn) -> list[Check]:
        """A path that raises (out of memory, a driver error) is a FAIL row with the error, not a crash. The rows
        so far are saved after each (PARTIAL_SUFFIX: a run stopped at its time limit keeps what it measured)."""
        try:
            rows = fn()
        except Exception as e:  # noqa: BLE001
            rows = [Check(group, name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}")]
        finally:
            if cuda:
                torch.cuda.empty_cache()  # each group starts with the memory the last one held
        save(rows)
        return rows

    def save(rows: list[Check]) -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"checks": [c.as_dict() for c in checks + rows], "partial": True}))

    ceiling = None
    if "ceiling" in groups:
        checks += guarded("compute ceiling", "compute ceiling", lambda: [compute_ceiling(w)])
        ceiling = checks[-1].images_s
    else:
        skipped("compute ceiling", ["compute ceiling"], "not selected (--groups)")
    # one tree for every data group, large enough for the longest window (the input group's: whole rounds of workers)
    batches = max([batches_needed(w)] * bool(groups & {"backends", "dali", "trainer"})
                  + [input_group.batches_needed(w, input_group.worker_counts(cuda))] * ("input" in groups)
                  + [max(w.warmup, DATA_WARMUP) + max(w.steps, 20)] * bool(groups & {"trace", "engines"}),
                  default=0)
    root = _root(args, w, batches) if batches else None
    # the GPU decode's measures first: a run stopped at its time limit loses the trainer rows' tail, not these
    jpeg_alone = None
    if "engines" in groups:  # on a CPU too: the CPU decode's calls, and why there is no engine count
        checks += guarded(engines.GROUP, engines.NAMES[0], lambda: engines.engine_rows(root, w))
        jpeg_alone = next((c.extra["ms_per_batch"] for c in checks
                           if c.group == engines.GROUP and c.name == engines.NAMES[1] and c.status == "ok"), None)
    else:
        skipped(engines.GROUP, engines.NAMES, "not selected (--groups)")
    if "trace" in groups:  # on a CPU too: the same fit on the decode's CPU path, its ranges without CUDA calls
        checks += guarded(trace.GROUP, trace.NAME, lambda: trace.trace_rows(w, root, args.num_workers, Path(args.out),
                                                                            jpeg_alone))
        checks += guarded(trace.GROUP, "A/B", lambda: trace_ab.ab_rows(trace.trace_window(w), root, args.num_workers))
    else:
        skipped(trace.GROUP, [trace.NAME], "not selected (--groups)")
    if "ema" in groups:  # on a CPU too: both fits run, no sync to count
        checks += guarded(ema.GROUP, ema.NAMES[1], lambda: ema.ema_rows(w))
    else:
        skipped(ema.GROUP, ema.NAMES, "not selected (--groups)")
    names = DECODE_NAMES if args.data_rows == "decode" else NAMES
    if "trainer" not in groups:
        skipped("trainer", names, "not selected (--groups)")
    elif not cuda:
        skipped("trainer", names, NO_CUDA)
    else:
        so_far: list[Check] = []  # saved row by row: the group is the longest

        def keep(row: Check) -> None:
            so_far.append(row)
            save(so_far)

        checks += guarded("trainer", "trainer", lambda: trainer_rows(w, root, args.num_workers,
                                                                     args.synthetic == "ceiling",
                                                                     args.data_rows == "decode", keep))
    if "backends" in groups:
        checks += guarded("backend", "backends", lambda: backend_rows(args, w, root, ceiling))
    else:
        skipped("backend", ["backends"], "not selected (--groups)")
    if "input" in groups:
        checks += guarded(input_group.GROUP, "input", lambda: input_group.input_rows(w, root))
        # the same attribution with the GPU decoding, at the CPU path's best count
        best = input_group.best_workers(checks)
        checks += guarded(input_group.GROUP, "input",
                          lambda: input_group.input_rows(w, root, [best] if best else None, {"decode": "gpu"},
                                                         "decode gpu: "))
    else:
        skipped(input_group.GROUP, ["input"], "not selected (--groups)")
    if "dali" in groups:
        checks += guarded("DALI mixed", "DALI mixed", lambda: dali_rows(args, w, root))
    else:
        skipped("DALI mixed", ["DALI mixed"], "not selected (--groups)")
    for group, names, fn in (("precision", ["32-true", "16-mixed", "bf16-mixed"], precision_steps),
                             ("flags", ["plain (AMP)", "channels_last", "cudnn.benchmark", "compile"], speed_flags),
                             ("dp", ["dp"], lambda w: [parallel.dp_check(w)]),
                             ("ddp", ["NCCL DDP"], lambda w: [parallel.ddp_check(w)]),
                             ("powersgd", [name for name, _, _ in powersgd.cases()], powersgd.powersgd_rows)):
        label = {"flags": "speed flag", "ddp": "DDP", "powersgd": powersgd.GROUP}.get(group, group)
        if group not in groups:
            skipped(label, names, "not selected (--groups)")
        elif not cuda:
            skipped(label, names, NO_CUDA)
        else:
            checks += guarded(label, names[0], lambda fn=fn: fn(w))
    from bench.report import machine_info

    partial.unlink(missing_ok=True)
    return {"checks": [c.as_dict() for c in checks], "gpu": gpu_info(), "machine": machine_info(),
            "settings": {**w.__dict__, "num_workers": args.num_workers, "data": str(root) if root else None}}
