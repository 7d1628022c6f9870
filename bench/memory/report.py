"""`bench memory`'s table and chart from the result `command.run` returns."""
from __future__ import annotations

import os
from typing import Any

from bench.report import markdown_table
from datamodules.budget.memory import GIB


def to_markdown(result: dict[str, Any]) -> str:
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
    lines += ["", ("Host counts pinned and shared memory (both are RAM), a dataset held in RAM, and what each worker "
                   "process holds of its own under its --data.worker_start (datamodules/budget/memory.py, "
                   "WORKER_OWN_BYTES), with the fork server. DALI rows count nvJPEG's buffers, the pinned batches "
                   "and the spawned external-source workers of an LMDB source, not DALI's own queues.")]
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    labels = [" + ".join(os.path.basename(c) for c in r["configs"]) for r in result["rows"]]
    return {"title": f"Memory per rank at {result['layout']['ranks_per_node']} ranks per node", "labels": labels,
            "series": {k: [r[k] / GIB for r in result["rows"]] for k in ("pinned", "shm", "host")},
            "ylabel": "GiB per rank (lower is better)"}
