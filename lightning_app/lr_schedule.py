"""The learning-rate schedule: linear warm-up then cosine decay (`warmup_cosine`), over the optimizer steps of the
whole fit (`total_steps`), counted from the datamodule's `train_batches()` with Lightning's arithmetic for limits,
accumulation, max_epochs and max_steps; not from `trainer.estimated_stepping_batches`, which would make a stateful
loader replay its epoch after a mid-epoch resume (Lightning issue #20550; docs/design.md, "LR schedule").
"""
from __future__ import annotations

import math

import pytorch_lightning as pl


def total_steps(trainer: pl.Trainer) -> int:
    """Optimizer steps of the whole fit (as estimated_stepping_batches counts them), at least 1."""
    datamodule = trainer.datamodule
    if datamodule is None or not hasattr(datamodule, "train_batches"):
        # Dataloaders given without one of our datamodules: no stateful loader of ours to protect.
        return max(1, int(trainer.estimated_stepping_batches))
    if trainer.max_epochs == -1:
        return max(1, trainer.max_steps) if trainer.max_steps != -1 else 1
    batches = int(datamodule.train_batches())
    limit = trainer.limit_train_batches  # pytorch_lightning/trainer/connectors/data_connector.py, _parse_num_batches
    if isinstance(limit, int):
        batches = min(batches, limit)
    elif limit is not None:
        batches = int(batches * limit)
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(trainer.max_epochs or 1, 1)
    if trainer.max_steps != -1:
        steps = min(steps, trainer.max_steps)
    return max(1, steps)


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier: linear from 1/(warmup+1) to 1 over warm-up, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
