"""The training core: the LightningModule, the CLI, callbacks/, strategies/, runs/, export (docs/design.md)."""
from __future__ import annotations

__all__ = ["ImageClassifier"]


def __getattr__(name: str):
    # imported on first use: what needs only lightning_app.runs or .errors (scripts/chaos_requeue.py) loads no torch
    if name == "ImageClassifier":
        from lightning_app.module import ImageClassifier

        return ImageClassifier
    raise AttributeError(f"module 'lightning_app' has no attribute {name!r}")
