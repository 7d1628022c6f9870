"""An exponential moving average of the weights that is used only once it has started, updated without a host sync.

Lightning's `EMAWeightAveraging` swaps its copy of the model in for validation and checkpoints even before a
delayed start (`update_starting_at_step/epoch`), and that copy is the random initialisation (docs/design.md,
"EMA"). Here, until the average has taken its first update, validation, checkpoints and the end of training use
the live weights; the first update copies the live weights into the average, so it starts from the weights being
trained (those of `--model.weights` included).

The update is ours, not `AveragedModel.update_parameters` (torch/optim/swa_utils.py): that one reads its count
from the `n_averaged` buffer twice per update (`bool(self.n_averaged == 0)`, `if self.n_averaged > 0`), two host
syncs per step on a GPU, and with Lightning's `get_ema_avg_fn` launches three kernels per tensor. Here the count
is kept on the host and the floating-point tensors move in one `torch._foreach_lerp_`. The AveragedModel, its
`n_averaged` buffer (still counted, on the device) and the checkpoint layout stay Lightning's: checkpoints
written before load, and the host count is read back from `n_averaged` once, at load.
"""
from __future__ import annotations

import itertools
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging as _LightningEMA


class DelayedStartEMA(_LightningEMA):
    """Lightning's EMAWeightAveraging (same arguments) that validates and saves the live weights until it starts."""

    _swapped = False

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, decay: float = 0.999,
                 update_every_n_steps: int = 1, update_starting_at_step: int | None = None,
                 update_starting_at_epoch: int | None = None, **kwargs: Any) -> None:
        super().__init__(device=device, use_buffers=use_buffers, decay=decay,
                         update_every_n_steps=update_every_n_steps, update_starting_at_step=update_starting_at_step,
                         update_starting_at_epoch=update_starting_at_epoch, **kwargs)
        self.decay = decay
        self.updates = 0  # the average's update count, on the host (n_averaged's value)

    @property
    def state_key(self) -> str:
        return "EMAWeightAveraging"  # the key of checkpoints saved before the class was renamed: their average loads

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new AveragedModel, n_averaged 0
            self.updates = 0
            # Lightning's hooks decide when to update and call the average's update_parameters (pytorch_lightning/
            # callbacks/weight_averaging.py, on_train_batch_end and on_train_epoch_end): that call becomes ours
            self._average_model.update_parameters = self.update

    def started(self) -> bool:
        """True once the average holds at least one update."""
        return self._average_model is not None and self.updates > 0

    @torch.no_grad()
    def update(self, pl_module: pl.LightningModule) -> None:
        """One update of the average from `pl_module`, as AveragedModel.update_parameters with get_ema_avg_fn does
        it, but reading nothing from the device."""
        average = self._average_model
        if self._use_buffers:  # the buffers averaged too (Lightning's default), else copied
            mine = itertools.chain(average.module.parameters(), average.module.buffers())
            theirs = itertools.chain(pl_module.parameters(), pl_module.buffers())
        else:
            mine, theirs = average.module.parameters(), pl_module.parameters()
        pairs = [(a.detach(), p.detach().to(a.device)) for a, p in zip(mine, theirs, strict=True)]
        if self.updates == 0:
            torch._foreach_copy_([a for a, _ in pairs], [p for _, p in pairs])
        else:
            floats = [(a, p) for a, p in pairs if a.is_floating_point()]
            # ema + (1 - decay) * (live - ema): get_ema_avg_fn's decay * ema + (1 - decay) * live, to rounding
            if floats:
                torch._foreach_lerp_([a for a, _ in floats], [p for _, p in floats], 1 - self.decay)
            for a, p in pairs:
                if not a.is_floating_point():  # BatchNorm's num_batches_tracked: as get_ema_avg_fn, then copy_
                    a.copy_(self.decay * a + (1 - self.decay) * p)
        if not self._use_buffers:
            for a, p in zip(average.module.buffers(), pl_module.buffers(), strict=True):
                a.detach().copy_(p.detach().to(a.device))
        average.n_averaged += 1  # for the checkpoint; never read back during training
        self.updates += 1

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        if self._average_model is not None:
            self.updates = int(self._average_model.n_averaged)  # once per load: the count travels as n_averaged

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swapped = self.started()
        if self._swapped:
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            super().on_validation_epoch_end(trainer, pl_module)
        self._swapped = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.started():
            super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._average_model is not None and not self.started():
            # the live weights are what validate, test, predict and export will load; the averaging state
            # (n_averaged 0) still travels, so a resumed fit starts the average as this one would have
            checkpoint["state_dict"] = checkpoint["current_model_state"]
