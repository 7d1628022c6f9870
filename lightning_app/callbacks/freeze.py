"""Fine-tuning: the backbone (everything but the head) frozen for the first epochs, the same on every rank.

Freezing by `requires_grad = False` (Lightning's BaseFinetuning, callbacks/finetuning.py) happens in `setup`, before
the strategy wraps the model; DDP registers only the parameters that require grad when it is built
(torch/nn/parallel/distributed.py, `_build_params_for_reducer`), so after the unfreeze the backbone's gradients were
never averaged and every rank trained a backbone of its own. Two ways out: keep every parameter registered and drop
the frozen ones' gradients, or rebuild DDP at the unfreeze. This file does the first:

- every parameter keeps `requires_grad`, so DDP buckets and all-reduces all of them from the first step;
- after each backward (`on_after_backward`, called once DDP's all-reduce has finished and before GradScaler's unscale,
  gradient clipping and the step: pytorch_lightning/plugins/precision/precision.py, `post_backward`, and amp.py,
  `optimizer_step`), the frozen parameters' gradients are set to None. SGD steps only parameters whose `.grad` is
  not None (torch/optim/sgd.py, `_init_group`, fused kernel included): no weight decay, no momentum, whatever rate
  the warm-up + cosine LambdaLR writes into their group. A zero gradient would not do: weight decay adds
  `wd * w` to it and moves the weight;
- BatchNorm of the frozen part normalises with batch statistics and leaves its running statistics alone
  (`track_running_stats = False`, as BaseFinetuning.freeze_module does; torch/nn/modules/batchnorm.py).

Rebuilding DDP would spare the frozen epochs the backbone's gradients and their all-reduce, but it means swapping
the module Lightning's DDPStrategy wrapped (`_setup_model`) mid-fit, registering the comm hook again
(`_register_ddp_hooks`), new buckets, which PowerSGD's state is keyed by (lightning_app/strategies/comm_hooks.py),
and a recompile of a compiled backbone inside DDP, whose graph breaks follow the buckets. Here the buckets, the comm
hook's state and the compiled graph stay as built; the cost is that a frozen epoch takes as long as a trained one.

Without DDP (one process, or DataParallel, whose replicas are copied from the module at every forward) nothing is
registered ahead, so the frozen part simply stops requiring gradients: the backward pass ends at the head, and a frozen
epoch costs a forward pass through the backbone. A compiled backbone recompiles once at the unfreeze (dynamo guards
on requires_grad).
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.nn.parallel import DistributedDataParallel


class FreezeBackboneEpochs(pl.Callback):
    """Backbone frozen for `epochs` epochs, BatchNorm statistics included; then the whole network trains.

    The frozen parameters stay in the optimizer from the start (LambdaLR schedules only the groups it was built
    with) and in DDP's buckets; the state follows `trainer.current_epoch`, so a resumed run freezes or not by itself.
    """

    def __init__(self, epochs: int) -> None:
        super().__init__()
        self.epochs = epochs
        self.frozen: list[torch.nn.Parameter] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        freeze = trainer.current_epoch < self.epochs
        modules = pl_module.backbone_body_modules()
        for module in modules:
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = not freeze
        params = [p for m in modules for p in m.parameters(recurse=False)]
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            self.frozen = params if freeze else []  # registered with DDP: their gradients are dropped after it
        else:
            for p in params:
                p.requires_grad_(not freeze)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for p in self.frozen:
            p.grad = None
