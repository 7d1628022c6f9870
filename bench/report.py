"""Writes a benchmark's results as a Markdown table, JSON and a PNG bar chart, with the machine described.

Every command writes ``OUT/<machine>.<kind>.{md,json,png}`` and then rebuilds
``OUT/<machine>.md``, which holds the machine description and every section found.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - an optional library that fails to import is "absent"
        return None
    return getattr(mod, "__version__", "unknown")


def machine_info() -> dict[str, Any]:
    """CPU model and cores, memory, GPUs (if any) and the versions of the libraries that matter."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1)})
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name, module in (("torchvision", "torchvision"), ("pytorch_lightning", "pytorch_lightning"),
                         ("dali", "nvidia.dali"), ("lmdb", "lmdb"), ("PIL", "PIL"), ("numpy", "numpy")):
        versions[name] = _version(module)
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        versions["cudnn"] = torch.backends.cudnn.version()
    return {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "gpus": gpus,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "versions": versions,
        "torch_threads": torch.get_num_threads(),
    }


def machine_name(info: dict[str, Any] | None = None) -> str:
    """A file-name slug that says what ran it: 'gpu-1x-nvidia-h100-...' or 'cpu-2c-intel-xeon-processor'."""
    info = info or machine_info()
    if info["gpus"]:
        names = sorted({g["name"] for g in info["gpus"]})
        base = f"gpu-{len(info['gpus'])}x-{'-'.join(names)}"
    else:
        base = f"cpu-{info['cpu_cores']}c-{info['cpu']}"
    base = re.sub(r"\((r|tm)\)|cpu @.*$|processor$", "", base.lower())
    return re.sub(r"[^a-z0-9]+", "-", base).strip("-")[:80]


def describe_machine(info: dict[str, Any]) -> str:
    gpu = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in info["gpus"]) or "none (CPU only)"
    v = info["versions"]
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)
    absent = [k for k, val in v.items() if val is None]
    return "\n".join([
        f"- CPU: {info['cpu']}, {info['cpu_cores']} cores; memory {info['memory_gb']} GB",
        f"- GPU: {gpu}",
        f"- Libraries: {libs}" + (f" (not installed: {', '.join(absent)})" if absent else ""),
        f"- Platform: {info['platform']}",
    ])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return "" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    align = "|".join(":--" if i == 0 else "--:" for i in range(len(headers)))
    lines = ["| " + " | ".join(headers) + " |", "|" + align + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def bar_chart(path: Path, title: str, labels: Sequence[str], series: dict[str, Sequence[float | None]],
              ylabel: str, notes: Sequence[str] = (), lines: dict[str, float] | None = None) -> Path:
    """Grouped horizontal bars (one group per label, one bar per series); None bars are left out.

    ``lines``: name -> value, each drawn as a labelled vertical line (ceilings).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(labels))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * n * max(1, len(series))))
    height = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        ys = [i + k * height for i in range(len(labels))]
        vals = [v if v is not None else 0.0 for v in values]
        bars = ax.barh(ys, vals, height=height, label=name)
        for bar, v in zip(bars, values, strict=False):
            text = "skipped" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
    for k, (name, value) in enumerate((lines or {}).items()):
        ax.axvline(value, color=f"C{len(series) + k}", linestyle="--" if "warm" in name else ":", linewidth=1.2,
                   label=f"{name}: {value:,.0f}" if abs(value) >= 100 else f"{name}: {value:.3g}")
    ax.set_yticks([i + height * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1 or lines:
        ax.legend(fontsize=7, loc="lower right")
    if notes:
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=7, va="bottom")
        fig.subplots_adjust(bottom=0.1 + 0.03 * len(notes))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def repo_relative(path: str) -> str:
    """A path inside the repository, relative to it (results files are committed)."""
    from datamodules.base import REPO_ROOT

    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path


def write_results(out_dir: str | os.PathLike, kind: str, markdown: str, data: dict[str, Any],
                  chart: dict[str, Any], machine: str | None = None, note: str | None = None) -> dict[str, Path]:
    """Write OUT/<machine>.<kind>.md/.json/.png and rebuild OUT/<machine>.md; return the paths."""
    out = Path(out_dir)
    info = data.setdefault("machine", machine_info())
    name = machine or machine_name(info)
    data.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    data.setdefault("command", shlex.join(["python", "-m", "bench", *sys.argv[1:]]))
    if note:
        data["note"] = note
    paths = {"md": out / f"{name}.{kind}.md", "json": out / f"{name}.{kind}.json", "png": out / f"{name}.{kind}.png"}
    header = f"## {kind}\n\n" + (f"> **{note}**\n\n" if note else "")
    section = (header + f"`{data['command']}` at {data['created']}\n\n" + markdown.strip()
               + f"\n\n![{kind}]({paths['png'].name})\n")
    atomic_write(paths["md"], section)
    atomic_write(paths["json"], json.dumps(data, indent=1, default=str) + "\n")
    bar_chart(paths["png"], **chart)
    paths["summary"] = combine(out, name, info)
    return paths


def combine(out_dir: Path, name: str, info: dict[str, Any]) -> Path:
    """OUT/<name>.md: the machine, then the loaders, train and nodes sections (whichever exist)."""
    parts = [f"# Benchmarks on {name}\n", describe_machine(info), ""]
    for kind in ("loaders", "train", "nodes", "nodes-accuracy"):
        p = out_dir / f"{name}.{kind}.md"
        if p.exists():
            parts.append(p.read_text())
    path = out_dir / f"{name}.md"
    atomic_write(path, "\n".join(parts))
    return path
