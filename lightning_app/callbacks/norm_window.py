"""BatchNorm's running statistics describe the weights being validated, however short an epoch is.

In training a BatchNorm layer normalises with its batch's statistics; validation, test, predict and an export use
its running statistics, an exponential average of the batches' (torch/nn/modules/batchnorm.py: running = (1 -
momentum) * running + momentum * batch, momentum 0.1 by default, starting from mean 0 and variance 1). That average
forgets slowly: after S batches a share 0.9^S of it is older than those batches. With ImageNet's 5,000 steps an
epoch that share is nothing; with a small tree of 5 steps an epoch, 59% of the statistics validated after an epoch
come from weights that no longer exist and from the initial 0 and 1 (21% of them still after 3 epochs).

That is why `--model.arch resnet18` from the quickstart's command stayed at chance on a few hundred images
(issue 54 item 4): the weights had learnt (train/acc1 0.58, and 66% on the validation images with batch
statistics), the running statistics had not caught up (23.7% with them; 64% once recomputed over the train set).

The fix leaves training untouched (the statistics are not used in a training step): when an epoch has fewer
batches than the momentum needs to forget its past to `FORGOTTEN`, the momentum rises until it does in one epoch,
1 - FORGOTTEN^(1/S) (0.60 for 5 batches; above about 44 batches the layer keeps its own). Recomputing the
statistics before each validation with the final weights (PreciseBN: Wu and Johnson 2021, "Rethinking 'Batch' in
BatchNorm", section 3; fvcore's `update_bn_stats`) scored the same 63% at the end of the same run, at the cost of
extra forward passes in every epoch; this costs none.
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

FORGOTTEN = 0.01  # the share of the running statistics older than the last epoch, at most


def epoch_momentum(batches: int, own: float) -> float:
    """The momentum whose running statistics keep at most FORGOTTEN of what came before the last `batches`."""
    return max(own, 1 - FORGOTTEN ** (1 / max(1, batches)))


def fit_to_epoch(model: nn.Module, batches: float) -> float | None:
    """Raise the momentum of every BatchNorm of `model` that tracks running statistics to `epoch_momentum`;
    the new momentum when one rose, else None."""
    if not batches or not math.isfinite(batches):
        return None  # an iterable without a length: its epoch is not known
    raised = None
    for layer in model.modules():
        if isinstance(layer, _BatchNorm) and layer.track_running_stats and layer.momentum is not None:
            own = layer.__dict__.setdefault("own_momentum", layer.momentum)  # a second fit starts from the same
            layer.momentum = epoch_momentum(int(batches), own)
            if layer.momentum > own:
                raised = layer.momentum
    return raised


class NormStatisticsPerEpoch(pl.Callback):
    """`fit_to_epoch` on the model at the start of every fit, with the train batches of an epoch on this process."""

    # --ckpt_path last ignores it (lightning_app/runs/identity.py): no training step reads running statistics,
    # and runs made before it was listed in configs/callbacks/default.yaml record no callbacks
    changes_training = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = trainer.num_training_batches
        momentum = fit_to_epoch(pl_module, batches)
        if momentum is not None:
            rank_zero_info(f"BatchNorm: momentum {momentum:.2f} for the running statistics, so that an epoch of "
                           f"{int(batches)} batches replaces them (lightning_app/callbacks/norm_window.py).")
