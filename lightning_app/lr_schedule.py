"""The learning-rate schedule: linear warm-up then cosine decay (`warmup_cosine`), over the optimizer steps of the
whole fit (`total_steps`), counted from the datamodule's `train_batches()` with Lightning's arithmetic for limits,
accumulation, max_epochs and max_steps; not from `trainer.estimated_stepping_batches`, which would make a stateful
loader replay its epoch after a mid-epoch resume (Lightning issue #20550; docs/design.md, "LR schedule").
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch


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


class SettingsKeepingLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restore keeps this run's optimiser settings. Lightning restores the optimizer's state, then
    the scheduler's (pytorch_lightning/trainer/connectors/checkpoint_connector.py,
    restore_optimizers_and_schedulers), and torch's Optimizer.load_state_dict takes each param group's settings
    from the checkpoint: a fit resumed with `--model.lr` (or weight decay, momentum) changed said "resuming ...
    with changed settings: model.lr ..." and trained on at the checkpoint's rate. The restored step count and the
    optimizer's per-parameter state (momentum buffers) stay; the groups' settings and base rates become this run's,
    with the lr at the restored step of the new schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda) -> None:
        super().__init__(optimizer, lr_lambda)
        self._configured = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                            for group in optimizer.param_groups]

    def state_dict(self) -> dict:
        state = super().state_dict()  # LRScheduler's: its whole __dict__ but the optimizer
        state.pop("_configured", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        configured = self._configured  # LRScheduler.load_state_dict updates __dict__ with what was saved
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_configured"})
        self._configured = configured
        if len(self._configured) != len(self.optimizer.param_groups):
            return  # Optimizer.load_state_dict refuses another group count before this is reached
        for group, configured in zip(self.optimizer.param_groups, self._configured, strict=True):
            group.update(configured)  # initial_lr included: LambdaLR's base rate of the group
        self.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
