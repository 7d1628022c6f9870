"""Fine-tuning: the backbone (everything but the head) frozen for the first epochs."""
from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import BaseFinetuning


class FreezeBackboneEpochs(BaseFinetuning):
    """Backbone frozen for `epochs` epochs, BatchNorm statistics included; then the whole network trains.

    Lightning's BackboneFinetuning would add the backbone as a new optimizer param group when it unfreezes;
    our LambdaLR (warm-up + cosine) schedules only the groups it was built with, so the frozen parameters stay
    in the optimizer from the start (with no gradient, SGD skips them) and are only made trainable here.
    """

    def __init__(self, epochs: int) -> None:
        super().__init__()
        self.epochs = epochs

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone_body_modules(), train_bn=False)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer) -> None:
        if epoch >= self.epochs:  # >=: a run resumed after epoch N unfreezes too (idempotent)
            self.make_trainable(pl_module.backbone_body_modules())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # BaseFinetuning.on_fit_start swaps in param groups it stored when it added some;
        # this callback adds none, so the restored optimizer state stays as it is.
        self._restarting = False
