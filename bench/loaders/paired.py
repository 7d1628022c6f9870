"""`bench loaders`' side-by-side ratios: each region-decode row against its whole-decode row and against PIL's
decode-only ceiling, warm cache, one ratio per round (the rows and the ceilings take turns in a round, so a ratio
compares what ran under the same load), and the median of the rounds. Two ratios each: of the wall-clock rates,
and of the CPU time per image (cpu_time.py), which a machine others share disturbs far less."""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

WHOLE = ", whole decode"  # the label of a region row's twin (backends.py, LABELS)


def cpu_us(rounds: Iterable[tuple]) -> list[float | None]:
    """Microseconds of CPU per image of each round's (images, seconds, cpu seconds or None)."""
    return [None if cpu is None or not n else round(1e6 * cpu / n, 1) for n, _, cpu in rounds]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(rows: list, decode_rounds: dict[tuple[str, str, str], list[dict]]) -> list[dict[str, Any]]:
    """For each warm region row: (row, against, wall ratio, CPU ratio, and each round's), > 1: the row is faster or
    spends less CPU per image than what it is compared with."""
    warm = {r.backend: r for r in rows if r.cache == "warm" and r.status == "ok"}
    pil = decode_rounds.get(("original", "pil", "warm"), [])
    ceiling = {"images_s": [c["images_s"] for c in pil],
               "cpu_us": [1e6 * c["cpu_s"] / c["images"] if c.get("cpu_s") and c["images"] else None for c in pil]}
    out = []
    for label, row in warm.items():
        if label.endswith(WHOLE) or label + WHOLE not in warm or row.extra.get("images_key") != "original":
            continue
        twin = warm[label + WHOLE].extra
        whole = {"images_s": twin["rounds_images_s"], "cpu_us": twin["rounds_cpu_us"]}
        for against, other in ((label + WHOLE, whole), ("PIL decode-only ceiling", ceiling)):
            wall = [_ratio(a, b) for a, b in zip(row.extra["rounds_images_s"], other["images_s"], strict=False)]
            cpu = [_ratio(b, a) for a, b in zip(row.extra["rounds_cpu_us"], other["cpu_us"], strict=False)]
            out.append({"row": label, "against": against, "wall": _median(wall), "cpu": _median(cpu),
                        "wall_rounds": [None if v is None else round(v, 3) for v in wall],
                        "cpu_rounds": [None if v is None else round(v, 3) for v in cpu]})
    return out


def lines(result: dict[str, Any]) -> list[str]:
    """The ratios as Markdown list items (none when the run had no pair)."""
    def said(v: float | None, rounds: list) -> str:
        return "not measured" if v is None else \
            f"{v:.3f}x (rounds {', '.join('-' if r is None else f'{r:.3f}' for r in rounds)})"

    return [f"- Side by side, warm, the median of each round's ratio: {p['row']} / {p['against']}: images/s "
            f"{said(p['wall'], p['wall_rounds'])}; CPU time per image (all its processes) "
            f"{said(p['cpu'], p['cpu_rounds'])}" for p in result.get("paired", [])]
