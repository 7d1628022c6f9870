"""The training core: the LightningModule, the CLI, callbacks, strategies, runs, predict and export."""
from __future__ import annotations

__all__ = ["ImageClassifier"]


def __getattr__(name: str):
    # imported on first use: `python -m netsim down` needs no torch
    if name == "ImageClassifier":
        from lightning_app.module import ImageClassifier

        return ImageClassifier
    raise AttributeError(f"module 'lightning_app' has no attribute {name!r}")
