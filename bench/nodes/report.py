"""`bench nodes`' tables and charts: step times with a verdict per link (`steps.measure`'s result), or
val/acc1 per hook and seed (`accuracy.measure`'s, under --accuracy: kind "nodes-accuracy").
"""
from __future__ import annotations

import statistics
from typing import Any

from bench.report import markdown_table, repo_relative

ACCURACY = "nodes-accuracy"  # the kind of a --accuracy result (its files: <machine>.nodes-accuracy.*)
BANDWIDTH_BOUND = 0.5  # all-reduce this share of the step or more: the link, not the CPU, sets the pace

COLUMNS = {
    "link": "the simulated link's rate (tc tbf on each end of a veth pair between two network namespaces)",
    "hook": "the DDP comm hook (trainer.strategy.comm_hook; configs/comm/*.yaml)",
    "step (s)": "median seconds per training step after the warm-up steps, node 0",
    "vs none": "step time against no compression on the same link (below 1.00x: faster)",
    "images/s": "global batch / step time",
    "comm share": "1 - (compute-alone step / this step): the share of the step spent sending, waiting for and "
                  "compressing gradients; the compute-alone step is two single-process fits side by side, "
                  "no all-reduce",
    "sent per step": "megabytes each node sent over the link per step (kernel counters of its end), mean of both nodes",
}


def verdicts(result: dict[str, Any]) -> list[str]:
    out = []
    for rate in result["settings"]["rates"]:
        rows = [r for r in result["rows"] if r["link"] == rate and r["status"] == "ok"]
        none = next((r for r in rows if r["hook"] == "no compression"), None)
        if none is None or none.get("comm_share") is None:
            out.append(f"{rate}: no verdict (the uncompressed row or the compute-alone row did not run)")
            continue
        pick = next((r for r in rows if r["hook"] == "PowerSGD rank 2"), None)
        others = [r for r in rows if r["hook"] != "no compression" and r.get("vs_none")]
        pick = pick or (min(others, key=lambda r: r["vs_none"]) if others else None)
        share = f"all-reduce is {none['comm_share']:.0%} of the step"
        if pick is None:
            out.append(f"{rate}: {share}; no compressing hook ran")
            continue
        change = 1 - pick["vs_none"]
        effect = (f"{pick['hook']} cuts the step by {change:.0%} ({none['step_s']:.2f} s -> {pick['step_s']:.2f} s)"
                  if change > 0 else f"{pick['hook']} makes the step {-change:.0%} slower ({none['step_s']:.2f} s -> "
                                     f"{pick['step_s']:.2f} s)")
        kind = "bandwidth-bound" if none["comm_share"] >= BANDWIDTH_BOUND else "compute-bound"
        out.append(f"{rate}: {kind}: {share}; {effect}")
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def to_markdown(result: dict[str, Any]) -> str:
    return accuracy_markdown(result) if result.get("kind") == ACCURACY else steps_markdown(result)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    return accuracy_chart(result) if result.get("kind") == ACCURACY else steps_chart(result)


def steps_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    local = result["local"]
    table = []
    if local["status"] == "ok":
        table.append(["(none)", "compute alone: 2 single-process fits, no all-reduce", f"{local['step_s']:.2f}", "",
                      f"{local['images_s']:,.0f}", "0%", ""])
    else:
        table.append(["(none)", f"compute alone: {local['status']}: {local['reason']}", "", "", "", "", ""])
    for r in result["rows"]:
        if r["status"] != "ok":
            table.append([r["link"], f"{r['hook']}: {r['status']}: {r['reason']}", "", "", "", "", ""])
            continue
        table.append([r["link"], r["hook"], f"{r['step_s']:.2f}", _cell(r["vs_none"], ".2f") + "x",
                      f"{r['images_s']:,.0f}", _cell(r["comm_share"], ".0%"), _cell(r["sent_mb_per_step"], ",.1f")])
    head = (f"Two simulated hosts (network namespaces, half the CPUs each), {s['arch']} at {s['image_size']} px, "
            f"global batch {s['batch_size']}, {s['precision']}, {s['steps']} timed steps after {s['warmup']} warm-up "
            f"steps, data {repo_relative(s['data_dir'])}")
    start = ("- PowerSGD starts after 2 plain steps here (powersgd_start_iter 2), inside the warm-up: the timed steps "
             "are all compressed.")
    lines = ["**" + "**  \n**".join(verdicts(result)) + "**", "", head, "", markdown_table(list(COLUMNS), table), "",
             start, "- Ratios are from one run, side by side; the absolute times are this machine's."]
    return "\n".join(lines)


def steps_chart(result: dict[str, Any]) -> dict[str, Any]:
    hooks = result["settings"]["hooks"]
    series = {}
    for rate in result["settings"]["rates"]:
        by_hook = {r["hook"]: r["step_s"] for r in result["rows"] if r["link"] == rate}
        series[f"link {rate}"] = [by_hook.get(h) for h in hooks]
    local = result["local"].get("step_s")
    return {"title": "Seconds per step on two simulated hosts, by DDP comm hook", "labels": hooks, "series": series,
            "ylabel": "seconds per step (lower is better)", "lines": {"compute alone": local} if local else None}


def accuracy_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    by_hook: dict[str, list[dict]] = {}
    for r in result["runs"]:
        by_hook.setdefault(r["hook"], []).append(r)
    none = [r["best_acc1"] for r in by_hook.get("no compression", []) if r["best_acc1"] is not None]
    none_mean = statistics.mean(none) if none else None
    table = []
    for hook in s["hooks"]:
        got = by_hook.get(hook, [])
        accs = [r["best_acc1"] for r in got if r["best_acc1"] is not None]
        cells = [f"{r['best_acc1']:.4f} ({r['final_acc1']:.4f})" if r["best_acc1"] is not None
                 else f"failed: {r.get('error', '')[:120]}" for r in got]
        mean = statistics.mean(accs) if accs else None
        table.append([hook, *cells, "" if mean is None else f"{mean:.4f}",
                      "" if mean is None or none_mean is None else f"{100 * (mean - none_mean):+.1f}",
                      f"{statistics.mean(r['seconds'] for r in got):.0f}" if got else ""])
    head = ["hook", *(f"seed {x}: best (final) val/acc1" for x in s["seeds"]), "mean best", "vs none (points)",
            "seconds per run"]
    intro = (f"2-node fits on two simulated hosts (link {s['rate']}), `{s['config']}`, {s['epochs']} epochs, data "
             f"{repo_relative(s['data_dir'])}; PowerSGD starts at its default (powersgd_start_iter null).")
    note = ("- Seeds differ by more than most hooks do at this budget: read a difference smaller than the seed "
            "spread as no difference.")
    return "\n".join([intro, "", markdown_table(head, table), "", note])


def accuracy_chart(result: dict[str, Any]) -> dict[str, Any]:
    s = result["settings"]
    series = {f"seed {seed}": [next((r["best_acc1"] for r in result["runs"] if r["hook"] == h and r["seed"] == seed),
                                    None) for h in s["hooks"]] for seed in s["seeds"]}
    return {"title": "Best val/acc1 by DDP comm hook (2 simulated nodes)", "labels": s["hooks"], "series": series,
            "ylabel": "best val/acc1 (higher is better)"}
