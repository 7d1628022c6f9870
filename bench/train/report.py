"""`bench train`'s table and chart from the result `timing.measure` returns."""
from __future__ import annotations

from typing import Any

from bench.report import markdown_table, repo_relative
from bench.train.rows import COLUMNS, INPUT_BOUND_FRAC, is_input_bound


def to_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    table = []
    for r in result["rows"]:
        strategy = "single (hand-written)" if r["strategy"] == "plain" else r["strategy"]
        head = [r["row"], strategy, r["precision"], "on" if r["benchmark"] else "off"]
        if r["status"] != "ok":
            table.append(head + ["", "", "", f"{r['status']}: {r['reason']}", ""])
            continue
        wait = r.get("data_wait_frac")
        table.append(head + [r["devices"], f"{r['seconds']:.1f}", f"{r['images_s']:,.0f}",
                             f"{r['speedup']:.2f}x" if r["speedup"] else "",
                             "" if wait is None
                             else f"{100 * wait:.0f}%" + (" input-bound" if is_input_bound(r) else "")])
    head_line = (f"{s['arch']} (width {s['width']}), {s['image_size']} px, global batch {s['batch_size']}, "
                 f"{s['epochs']} epochs ({s['num_workers']} workers per process), data {repo_relative(s['root'])}")
    lines = [head_line, "",
             markdown_table(list(COLUMNS), table), ""]
    bound = [r["row"] for r in result["rows"] if r["status"] == "ok" and is_input_bound(r)]
    if bound:
        lines.append(f"- **Input-bound** (data wait >= {INPUT_BOUND_FRAC:.0%}): {', '.join(bound)}. "
                     "These rows measure the "
                     "data loader, not their setting: their speed-ups say little about AMP, cudnn.benchmark, "
                     "channels_last or compile. Use a faster backend (LMDB, DALI, a downscaled copy), more "
                     "--num-workers, or a heavier model per image.")
    o = result.get("overhead")
    if o:
        pairs = o.get("pairs") or [{"lightning_img_s": o["lightning_img_s"], "plain_img_s": o["plain_img_s"]}]
        each = ", ".join(f"{q['lightning_img_s']:,.0f} vs {q['plain_img_s']:,.0f}" for q in pairs)
        lines.append(f"- Template overhead: Lightning baseline vs hand-written loop, images/s, {len(pairs)} pair(s) "
                     f"run back to back: {each}. Median ratio {o['ratio']:.3f}: the template spends "
                     f"{o['overhead_pct']:+.1f}% time per image against the hand-written loop (goal: within +2%).")
    else:
        lines.append("- Template overhead: not measured (the baseline or the hand-written loop did not run).")
    lines.append("- Ratios are from one run, side by side; absolute times on a CPU are not comparable across machines.")
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    return {"title": "Training throughput per configuration (images/s)", "labels": [r["row"] for r in rows],
            "series": {"images/s": [r["images_s"] for r in rows]}, "ylabel": "images/s (higher is better)"}
