"""What `bench memory` computes a row from: the config as `main.py fit` parses it, its train sizes, and the
memory plan its DataModule class gives for a layout (`plan_for`, the code a run sizes its loaders with)."""
from __future__ import annotations

import importlib
import warnings
from typing import Any

from datamodules.budget.memory import MemoryPlan
from datamodules.budget.sizing import Layout


def parse_config(configs: list[str], extra: list[str]) -> dict[str, Any]:
    """The merged config as `main.py fit` parses it, nothing instantiated."""
    from lightning_app.cli import ClassifierCLI

    class ParseOnly(ClassifierCLI):
        def instantiate_classes(self) -> None:  # parse (defaults, configs, flags) and stop there
            pass

    args = [a for c in configs for a in ("--config", c)] + [a for a in extra if a != "--"]
    with warnings.catch_warnings():
        # `python -m bench memory`'s own argv is in sys.argv: LightningCLI warns whenever both are given
        # (pytorch_lightning/cli.py, LightningCLI.parse_arguments); these args are the config's, built here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        return ParseOnly(args=args, run=False).config.as_dict()


def train_sizes(config: dict[str, Any]) -> list[int]:
    from lightning_app.callbacks.progressive_resizing import ProgressiveResizing

    sizes: list[int] = []
    for cb in config["trainer"].get("callbacks") or []:
        if isinstance(cb, dict) and cb.get("class_path", "").endswith("ProgressiveResizing"):
            sizes += ProgressiveResizing(**cb.get("init_args", {})).sizes(config["trainer"].get("max_epochs"))
    return sizes


def plan_of(config: dict[str, Any], layout: Layout) -> tuple[str, MemoryPlan]:
    data = config["data"]
    module, _, name = data["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return name, cls.plan_for(data.get("init_args") or {}, layout, train_sizes(config))
