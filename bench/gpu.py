"""`python -m bench gpu`: every GPU path of the template, checked and timed, in one command.

One row per path, each with a verdict (what it was compared with, and the tolerance) and a figure:
the compute ceiling (ResNet-50 at 224 on synthetic on-device batches), each data backend's end-to-end
training images/s as a share of that ceiling, DALI `mixed` (pixels against DALI CPU, images/s with and
without the hardware JPEG decoder), 16-mixed and bf16-mixed against 32-true, channels_last,
cudnn.benchmark and compile against the plain step, dp (>= 2 GPUs) and NCCL DDP (every GPU of the node).

Without CUDA every GPU row is skipped with its reason and the command exits 0; the compute ceiling
(at a small size) and the backend shares run for real on the CPU.
"""
from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench import gpu_checks as gc
from bench.gpu_checks import Check, Workload

GROUPS = ("ceiling", "backends", "dali", "precision", "flags", "dp", "ddp")
DALI_TOLERANCE = 2.0  # mean |mixed - cpu| in grey levels: nvJPEG's and libjpeg-turbo's IDCTs differ slightly, and
# CPU decoding resizes on the host with torchvision's geometry where mixed resizes in DALI (1.5 on CPU, dali.py)
NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False)"
# On a CPU the same code runs, small enough to finish in a minute or two.
DEFAULTS = {"cuda": {"image_size": 224, "batch_size": 128, "steps": 20, "warmup": 5, "epochs": 2},
            "cpu": {"image_size": 64, "batch_size": 16, "steps": 3, "warmup": 1, "epochs": 1}}


def add_parser(sub, common) -> argparse.ArgumentParser:
    g = sub.add_parser(
        "gpu", help="every GPU path checked and timed: DALI mixed, AMP, speed flags, dp, NCCL DDP, and each "
                    "backend's training images/s as a share of the compute ceiling",
        description=__doc__.split("\n\n", 1)[1])
    g.add_argument("--data-dir", default=None, help="ImageFolder tree for the backend and DALI rows "
                   "(default: the built-in --builtin)")
    g.add_argument("--builtin", default="imagenet", help="built-in preset (default: imagenet, ~470x390 JPEGs)")
    g.add_argument("--train-per-class", type=int, default=None, help="built-in: train images per class")
    g.add_argument("--arch", default="resnet50", help="model of every row (default: resnet50)")
    g.add_argument("--image-size", type=int, default=None, help="px (default: 224 on CUDA, 64 on a CPU)")
    g.add_argument("--batch-size", type=int, default=None, help="per step (default: 128 on CUDA, 16 on a CPU)")
    g.add_argument("--steps", type=int, default=None, help="timed steps per row (default: 20 on CUDA, 3 on a CPU)")
    g.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 on CUDA, 1 on a CPU)")
    g.add_argument("--epochs", type=int, default=None, help="timed epochs per backend after one warm-up epoch "
                   "(default: 2 on CUDA, 1 on a CPU)")
    g.add_argument("--max-batches", type=int, default=None, help="stop each backend epoch after N batches")
    g.add_argument("--num-workers", type=int, default=None, help="loader workers (default: this process's CPUs)")
    g.add_argument("--backends", default=None, help="comma list of backends (default: all)")
    g.add_argument("--groups", default=",".join(GROUPS), help=f"comma list from {','.join(GROUPS)} (default: all)")
    common(g)
    g.set_defaults(out="bench/out")
    return g


def _defaults(args) -> Workload:
    from datamodules.cpus import cpus_per_process

    cuda = torch.cuda.is_available()
    for key, value in DEFAULTS["cuda" if cuda else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_workers is None:
        args.num_workers = cpus_per_process(1)
    return Workload(args.arch, args.image_size, args.batch_size, args.warmup, args.steps, "cuda" if cuda else "cpu")


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


# ------------------------------------------------------------------------------ data rows

def _root(args) -> Path:
    if args.data_dir:
        return Path(args.data_dir)
    from bench.loader_backends import default_root

    return default_root(args.builtin, args.train_per_class, None)


def train_through(dm, w: Workload, epochs: int, max_batches: int | None) -> float:
    """Training images/s through a backend's train_dataloader(): to the device, on_after_batch_transfer,
    then the ceiling's training step. One untimed warm-up epoch first (workers, autotuning)."""
    from bench.loaders import _close, _prepare, _to_device

    device = torch.device(w.device)
    loader = dm.train_dataloader()
    _prepare(loader)
    images, seconds = 0, 0.0
    try:
        with gc.cudnn_flags(benchmark=device.type == "cuda"):
            step = gc.TrainStep(gc.make_model(w, num_classes=dm.num_classes), gc.fastest_precision(w.device),
                                channels_last=True)
            for epoch in range(1 + epochs):
                gc._sync(w.device)
                t0, n = time.perf_counter(), 0
                for i, batch in enumerate(loader):
                    x, y = dm.on_after_batch_transfer(_to_device(batch, device), 0)
                    step(x, y)
                    n += int(x.shape[0])
                    if max_batches and i + 1 >= max_batches:
                        break
                gc._sync(w.device)
                if epoch:
                    images, seconds = images + n, seconds + time.perf_counter() - t0
    finally:
        _close(loader)  # stop a DataLoader's persistent workers before the next backend
    return images / max(seconds, 1e-9)


def backend_rows(args, w: Workload, root: Path, ceiling: float | None) -> list[Check]:
    from bench import loaders

    wanted = [b.strip() for b in (args.backends or ",".join(loaders.BACKENDS)).split(",") if b.strip()]
    work = Path("bench/out/work") / root.name
    work.mkdir(parents=True, exist_ok=True)
    s = loaders.Settings(root=root, work=work, batch_size=w.batch_size, num_workers=args.num_workers,
                         image_size=w.image_size, max_batches=args.max_batches, device=w.device)
    rows = []
    for name in loaders.BACKENDS:
        row = Check("backend", loaders.LABELS[name])
        rows.append(row)
        if name not in wanted:
            row.status, row.verdict = "skipped", "not selected (--backends)"
            continue
        try:
            prepared = loaders.FACTORIES[name](s)
        except loaders.Skip as e:
            row.status, row.verdict = "skipped", str(e)
            continue
        except Exception as e:  # noqa: BLE001 - a backend that cannot start is a FAIL row with its error
            row.status, row.verdict = "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            row.images_s = train_through(prepared.datamodule, w, args.epochs, args.max_batches)
        except Exception as e:  # noqa: BLE001
            row.status, row.verdict = "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
            continue
        finally:
            loaders._shutdown(prepared.datamodule)
        share = row.images_s / ceiling if ceiling else None
        row.extra["share"] = share
        row.verdict = f"end-to-end training, {args.num_workers} workers" + (
            f"; {prepared.note}" if prepared.note else "")
        row.figure = f"{row.images_s:,.0f} img/s" + (f", {share:.0%} of the ceiling" if share else "")
    return rows


def dali_rows(args, w: Workload, root: Path) -> list[Check]:
    """DALI mixed: validation pixels against DALI CPU, then images/s with and without the hardware decoder."""
    names = ["DALI mixed vs CPU pixels", "DALI mixed, hw_decoder_load 0.65", "DALI mixed, hw_decoder_load 0"]
    if w.device != "cuda":
        return [Check("DALI mixed", n, "skipped", NO_CUDA) for n in names]
    try:
        from datamodules.dali.datamodule import DALIDataModule, require_dali

        require_dali()
    except Exception as e:  # noqa: BLE001 - DataError with the install hint
        return [Check("DALI mixed", n, "skipped", str(e).splitlines()[0]) for n in names]
    from datamodules.sample.transforms import IMAGENET_STD

    common = {"data_dir": str(root), "batch_size": w.batch_size, "image_size": w.image_size,
              "val_image_size": w.image_size}
    mods = {d: DALIDataModule(dali_device=d, **common) for d in ("gpu", "cpu")}
    seen = {}
    for d, dm in mods.items():
        dm.setup("fit")
        xs, ys = [], []
        for x, y in dm.val_dataloader():
            x, y = dm.on_after_batch_transfer((x.cuda(), y.cuda()), 0)
            xs.append(x.float().cpu())
            ys.append(y.cpu())
        seen[d] = (torch.cat(xs), torch.cat(ys))
        dm.teardown()
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    diff = ((seen["gpu"][0] - seen["cpu"][0]) * std).abs()
    same_labels = torch.equal(seen["gpu"][1], seen["cpu"][1])
    ok = same_labels and float(diff.mean()) <= DALI_TOLERANCE
    rows = [Check("DALI mixed", names[0], "ok" if ok else "FAIL",
                  f"{len(diff)} val images: mean |mixed - cpu| {float(diff.mean()):.2f} grey levels (tolerance "
                  f"{DALI_TOLERANCE}), 99th percentile {float(diff.flatten()[::97].quantile(0.99)):.1f}; labels "
                  f"equal: {same_labels}", figure=f"{float(diff.mean()):.2f} grey levels")]
    for name, load in zip(names[1:], (0.65, 0.0)):
        dm = DALIDataModule(dali_device="gpu", hw_decoder_load=load, **common)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.prepare()
        count, seconds = 0, 0.0
        for epoch in range(1 + args.epochs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = sum(int(x.shape[0]) for x, _ in loader)
            torch.cuda.synchronize()
            if epoch:
                count, seconds = count + n, seconds + time.perf_counter() - t0
        dm.teardown()
        ips = count / max(seconds, 1e-9)
        rows.append(Check("DALI mixed", name, "ok", "train pipeline only (decode, crop, flip, normalise), "
                          f"{dm._threads()} threads; load = the share of JPEGs given to the hardware decoder "
                          "(A100/H100/H200; ignored where there is none)", ips, f"{ips:,.0f} img/s"))
    hw, sw = rows[1].images_s, rows[2].images_s
    rows[1].figure += f", {hw / sw:.2f}x software-only" if sw else ""
    return rows


# ------------------------------------------------------------------------------ the run

def run(args) -> dict[str, Any]:
    w = _defaults(args)
    groups = {g.strip() for g in args.groups.split(",") if g.strip()}
    cuda = w.device == "cuda"
    checks: list[Check] = []

    def skipped(group: str, names: list[str], why: str) -> None:
        checks.extend(Check(group, n, "skipped", why) for n in names)

    def guarded(group: str, name: str, fn) -> list[Check]:
        """A path that raises (out of memory, a driver error) is a FAIL row with the error, not a crash."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            return [Check(group, name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}")]
        finally:
            if cuda:
                torch.cuda.empty_cache()  # each group starts with the memory the last one held

    ceiling = None
    if "ceiling" in groups:
        checks += guarded("compute ceiling", "compute ceiling", lambda: [gc.compute_ceiling(w)])
        ceiling = checks[-1].images_s
    else:
        skipped("compute ceiling", ["compute ceiling"], "not selected (--groups)")
    root = _root(args) if groups & {"backends", "dali"} else None
    if "backends" in groups:
        checks += guarded("backend", "backends", lambda: backend_rows(args, w, root, ceiling))
    else:
        skipped("backend", ["backends"], "not selected (--groups)")
    if "dali" in groups:
        checks += guarded("DALI mixed", "DALI mixed", lambda: dali_rows(args, w, root))
    else:
        skipped("DALI mixed", ["DALI mixed"], "not selected (--groups)")
    for group, names, fn in (("precision", ["32-true", "16-mixed", "bf16-mixed"], gc.precision_steps),
                             ("flags", ["plain (AMP)", "channels_last", "cudnn.benchmark", "compile"], gc.speed_flags),
                             ("dp", ["dp"], lambda w: [gc.dp_check(w)]),
                             ("ddp", ["NCCL DDP"], lambda w: [gc.ddp_check(w)])):
        label = {"flags": "speed flag", "ddp": "DDP"}.get(group, group)
        if group not in groups:
            skipped(label, names, "not selected (--groups)")
        elif not cuda:
            skipped(label, names, NO_CUDA)
        else:
            checks += guarded(label, names[0], lambda fn=fn: fn(w))
    from bench.report import machine_info

    return {"checks": [c.as_dict() for c in checks], "gpu": gpu_info(), "machine": machine_info(),
            "settings": {**w.__dict__, "epochs": args.epochs, "num_workers": args.num_workers,
                         "max_batches": args.max_batches, "data": str(root) if root else None}}


def to_markdown(result: dict[str, Any]) -> str:
    from bench.report import markdown_table, repo_relative

    g, s = result["gpu"], result["settings"]
    lines = [f"- GPU: {', '.join(g['gpus']) or 'none (every GPU row is skipped)'}"
             + (f"; driver {g['driver']}, CUDA {g['cuda']}, cuDNN {g['cudnn']}" if g["gpus"] else ""),
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in result.get("machine", {}).get("versions", {}).items()
                                        if v is not None),
             f"- Workload: {s['arch']} at {s['image_size']} px, batch {s['batch_size']}, {s['warmup']} warm-up + "
             f"{s['steps']} timed steps per row; backends: 1 warm-up + {s['epochs']} timed epoch(s), "
             f"{s['num_workers']} workers" + (f", data {repo_relative(s['data'])}" if s.get("data") else ""), ""]
    rows = [[c["group"], c["name"], c["status"], c["figure"], c["verdict"]] for c in result["checks"]]
    lines += [markdown_table(["group", "path", "status", "figure", "verdict (compared with, tolerance) or reason"],
                             rows), ""]
    ceiling = next((c for c in result["checks"] if c["group"] == "compute ceiling" and c["images_s"]), None)
    shares = [c for c in result["checks"] if c["group"] == "backend" and c["status"] == "ok"]
    if ceiling and shares:
        lines.append(f"- Share of the compute ceiling ({ceiling['images_s']:,.0f} img/s): "
                     + "; ".join(f"{c['name']} {c['extra']['share']:.0%}" for c in shares)
                     + ". Below ~90%, the GPU waits for data: a faster backend, more CPUs, or DALI mixed helps.")
    failed = [c["name"] for c in result["checks"] if c["status"] == "FAIL"]
    lines.append(f"- FAILED: {', '.join(failed)}" if failed else "- No path failed.")
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    timed = [c for c in result["checks"] if c["images_s"]]
    return {"title": "GPU paths: training images/s (ceiling, backends, precisions, flags, dp)",
            "labels": [f"{c['group']}: {c['name']}" for c in timed],
            "series": {"images/s": [c["images_s"] for c in timed]}, "ylabel": "images/s (higher is better)"}


def main(args) -> tuple[str, dict]:
    from bench import report

    result = run(args)
    md = to_markdown(result)
    paths = report.write_results(args.out, "gpu", md, result, chart(result), args.machine, args.note)
    return md, paths
