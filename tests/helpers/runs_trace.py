"""How often `runs.plan_run` enters each file of lightning_app/runs/ for one `--ckpt_path`: the path a reader follows.

A file is entered each time control passes into it from another file (a call whose caller's code is in another file;
a generator resumed from contextlib counts too); a return is not an entry. Four prepared cases, each in a fresh
folder: fit with `last` and a matching run, fit with `last` and no run, fit with a checkpoint file, validate with one.

    python -m tests.helpers.runs_trace      # one line per case: files entered, entries, and per file
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.helpers import REPO

RUNS = str(REPO / "lightning_app" / "runs") + "/"
TRAINING = {"seed": 0, "model": {"arch": "tiny", "num_classes": 3}, "data": {"class_path": "d.D", "data_dir": "/x"},
            "trainer": {"max_epochs": 1, "callbacks": []}}


def entries(call: Callable[[], object]) -> tuple[Counter, list[str]]:
    """(entries per runs/ file, each entry as `file:function` in order) while `call()` runs."""
    counts: Counter = Counter()
    order: list[str] = []

    def tracer(frame, event, arg) -> None:  # no local tracer: calls are all it watches
        if event == "call":
            here = frame.f_code.co_filename
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            if here.startswith(RUNS) and here != caller:
                name = here[len(RUNS):].removesuffix(".py")
                counts[name] += 1
                order.append(f"{name}:{frame.f_code.co_name}")

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return counts, order


def _checkpoint(path: Path) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"hyper_parameters": {"arch": "tiny", "num_classes": 3}, "state_dict": {"w": torch.zeros(3, 2)}}, path)
    return path


def _run_with_last(root: Path) -> Path:
    """ROOT/version_0 with this config's run.json and a checkpoints/last.ckpt."""
    from lightning_app.runs.plan import write_new_run

    run = root / "version_0"
    run.mkdir(parents=True)
    write_new_run(run, TRAINING)
    return _checkpoint(run / "checkpoints" / "last.ckpt")


def cases() -> dict[str, Callable[[Path], tuple[str, str | None]]]:
    """{case: prepare(root) -> (subcommand, ckpt_path)}."""
    return {"fit last, a matching run": lambda root: (_run_with_last(root), ("fit", "last"))[1],
            "fit last, no run": lambda root: ("fit", "last"),
            "fit FILE": lambda root: ("fit", str(_run_with_last(root))),
            "validate FILE": lambda root: ("validate", str(_run_with_last(root)))}


def trace(case: str) -> tuple[Counter, list[str]]:
    """Entries per runs/ file for one case of `cases()`, planned in a fresh folder; its lock is released after."""
    from lightning_app import runs

    signature = runs.ModelSignature("tiny", 3, {"w": (3, 2)})
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        subcommand, ckpt_path = cases()[case](root)
        plans = []
        counts, order = entries(lambda: plans.append(runs.plan_run(subcommand, ckpt_path, root, TRAINING, signature)))
        if plans[0].lock is not None:
            plans[0].lock.release()
    return counts, order


def main() -> None:
    for case in cases():
        counts, order = trace(case)
        per_file = ", ".join(f"{name} {n}" for name, n in counts.most_common())
        print(f"{case}: {sum(counts.values())} entries in {len(counts)} files ({per_file})")
        if "-v" in sys.argv:
            print("   " + " -> ".join(order))


if __name__ == "__main__":
    main()
