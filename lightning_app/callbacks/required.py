"""The callbacks of configs/callbacks/default.yaml that a run's safety needs: dropping one is refused.

Every other callback of that list can be dropped from a config. The run guard (lightning_app/runs/guard.py) is
safety too, but no list holds it: lightning_app/cli.py adds it because it needs the run plan.
"""
from __future__ import annotations

import importlib
from typing import Any

from lightning_app.errors import UserError

LIST_FILE = "configs/callbacks/default.yaml"
# class path -> why the run cannot do without it
SAFETY = {
    "lightning_app.callbacks.checkpoints.CheckpointOnSigterm":
        "it saves last.ckpt when the run is stopped (a scheduler's SIGTERM, SLURM's requeue signal, Ctrl-C, a dead "
        "loader worker), the checkpoint `--ckpt_path last` resumes from; without it a preempted run loses every "
        "step since its last save",
}


def _class(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None  # jsonargparse has already refused a class it cannot import


def _listed_classes(callbacks: Any) -> list[type]:
    """The classes of trainer.callbacks as parsed (a list of {class_path, init_args}, one of them, or None)."""
    items = callbacks if isinstance(callbacks, list) else [] if callbacks is None else [callbacks]
    paths = [item.get("class_path") for item in items if hasattr(item, "get")]
    return [cls for cls in map(_class, filter(None, paths)) if cls is not None]


def refuse_dropped_safety(callbacks: Any) -> None:
    """One paragraph (exit status 2) when trainer.callbacks lacks a safety callback (a subclass counts)."""
    listed = _listed_classes(callbacks)
    for class_path, why in SAFETY.items():
        needed = _class(class_path)
        if needed is not None and not any(issubclass(cls, needed) for cls in listed):
            name = class_path.rpartition(".")[2]
            raise UserError(
                f"trainer.callbacks has no {name}, and the run needs it: {why}. A config's plain `callbacks:` "
                f"under `trainer:` (or --trainer.callbacks without +) replaces the whole default list of "
                f"{LIST_FILE}; add to that list instead with `callbacks+:` in the config or --trainer.callbacks+=CLASS "
                f"on the command line, or keep `- class_path: {class_path}` in your own list.")
