"""`bench gpu`'s table and chart from the result `command.run` returns."""
from __future__ import annotations

from typing import Any

from bench.report import markdown_table, repo_relative


def to_markdown(result: dict[str, Any]) -> str:
    g, s = result["gpu"], result["settings"]
    lines = [f"- GPU: {', '.join(g['gpus']) or 'none (every GPU row is skipped)'}"
             + (f"; driver {g['driver']}, CUDA {g['cuda']}, cuDNN {g['cudnn']}" if g["gpus"] else ""),
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in result.get("machine", {}).get("versions", {}).items()
                                        if v is not None),
             f"- Workload: {s['arch']} at {s['image_size']} px, batch {s['batch_size']}, {s['warmup']} warm-up + "
             f"{s['steps']} timed steps per row (backends: batches streamed across epochs), "
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
    steps = [c for c in result["checks"] if c["group"] == "trainer" and c["status"] == "ok"]
    if steps:
        lines.append("- The template's own step (ImageClassifier under a Lightning Trainer): "
                     + "; ".join(f"{c['name']} {c['images_s']:,.0f} img/s, {c['extra']['syncs_per_step']:g} host "
                                 f"syncs per step, peak {c['extra']['peak_memory_gib']:.1f} GiB" for c in steps) + ".")
    failed = [c["name"] for c in result["checks"] if c["status"] == "FAIL"]
    lines.append(f"- FAILED: {', '.join(failed)}" if failed else "- No path failed.")
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    timed = [c for c in result["checks"] if c["images_s"]]
    return {"title": "GPU paths: training images/s (ceiling, backends, precisions, flags, dp)",
            "labels": [f"{c['group']}: {c['name']}" for c in timed],
            "series": {"images/s": [c["images_s"] for c in timed]}, "ylabel": "images/s (higher is better)"}
