"""The optimiser and its schedule from ImageClassifier's settings: the family's recipe where a setting is null,
the rate scaled to the global batch, no weight decay on norms and biases, warm-up + cosine over the whole fit."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from lightning_app import weights as weights_lib
from lightning_app.lr_schedule import SettingsKeepingLambdaLR, total_steps, warmup_cosine
from models.recipes import Recipe, batch_scale, recipe

OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}  # as their papers and torch.optim spell them


def resolved(hparams) -> tuple[str, float, float, Recipe | None]:
    """(optimizer, lr per 256 images, weight decay, the family recipe that filled what is unset, or None)."""
    h = hparams
    family = recipe(h.arch)
    unset = h.get("optimizer") is None or h.lr is None or h.weight_decay is None
    return (h.get("optimizer") or family.optimizer, family.lr if h.lr is None else h.lr,
            family.weight_decay if h.weight_decay is None else h.weight_decay, family if unset else None)


def recipe_line(hparams, setting_sources: dict[str, str]) -> str:
    """`--model.arch A: SGD, lr ... from the recipe (its source); weight decay ... from best.yaml`: each value with
    where it came from (the recipe where the config leaves it null, else `setting_sources`, which the CLI fills
    with the config file or the command line that set it)."""
    h = hparams
    name, lr, weight_decay, _ = resolved(h)
    family = recipe(h.arch)
    rate = family.said if h.lr is None and name == family.optimizer else f"lr {lr:g} per 256 images"
    by_source: dict[str, list[str]] = {}
    for key, words in (("optimizer", OPTIMIZER_NAMES.get(name, name)), ("lr", rate),
                       ("weight_decay", f"weight decay {weight_decay:g}")):
        where = (f"the recipe ({family.source}: models/recipes.py)" if h.get(key) is None
                 else setting_sources.get(key, "the config"))
        by_source.setdefault(where, []).append(words)
    said = "; ".join(f"{', '.join(words)} from {where}" for where, words in by_source.items())
    return (f"--model.arch {h.arch}: {said}. --model.optimizer, --model.lr and --model.weight_decay set "
            "what the recipe gives.")


def described(hparams) -> str:
    """`SGD, lr 0.4 per 256 images, weight decay 0.0005 (conv11's recipe: ...)`: the optimiser a fit of these settings
    runs, in one phrase (bench gpu's trainer rows name it)."""
    name, lr, weight_decay, family = resolved(hparams)
    words = f"{OPTIMIZER_NAMES.get(name, name)}, lr {lr:g} per 256 images, weight decay {weight_decay:g}"
    if family is None:
        return words
    every = all(hparams.get(key) is None for key in ("optimizer", "lr", "weight_decay"))
    return words + f" ({'' if every else 'the unset values from '}{hparams.arch}'s recipe: {family.source})"


def scaled_lr(hparams, accumulate: int = 1) -> float:
    """lr per 256 images scaled to the global batch: linearly for SGD, by the square root for AdamW
    (models/recipes.py, batch_scale)."""
    name, lr = resolved(hparams)[:2]
    return lr * batch_scale(name, hparams.global_batch_size * accumulate)


def param_groups(module: pl.LightningModule, lr: float) -> list[dict]:
    """Groups: head first (its rate is the logged one), then the backbone at lr * backbone_lr_scale;
    no weight decay on norms and biases. Parameters frozen for the first epochs are included
    (they get no gradient, so SGD skips them) so the LR schedule covers them once trainable."""
    h = module.hparams
    heads = tuple(n + "." for n in weights_lib.head_names(module.backbone))
    weight_decay = resolved(h)[2]
    groups = []
    for in_head in (True, False):
        scale = 1.0 if in_head else h.get("backbone_lr_scale", 1.0)
        decay, no_decay = [], []
        for name, p in module.backbone.named_parameters():
            if name.startswith(heads) == in_head:
                (no_decay if p.ndim <= 1 else decay).append(p)
        for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
            if params:
                groups.append({"params": params, "weight_decay": wd, "lr": lr * scale})
    others = [p for n, p in module.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    if others:
        groups.append({"params": others, "weight_decay": 0.0, "lr": lr})
    return groups


def fused_step(module: pl.LightningModule) -> bool:
    """SGD's fused kernel on CUDA: one kernel per step, and under 16-mixed no host sync; gradient clipping
    keeps the plain kernel (docs/design.md, "No host sync per step")."""
    trainer = module._trainer
    clipping = trainer is not None and bool(trainer.gradient_clip_val)
    return module.device.type == "cuda" and not clipping


def optimizer_and_schedule(module: pl.LightningModule, lr: float) -> dict:
    """What configure_optimizers returns: the optimiser at `lr` (already scaled) and warm-up + cosine per step."""
    h = module.hparams
    name, _, _, family = resolved(h)
    if family is not None:
        rank_zero_info(module.recipe_line())
    if name == "adamw":
        optimizer = torch.optim.AdamW(param_groups(module, lr), lr=lr, fused=fused_step(module))
    else:
        optimizer = torch.optim.SGD(param_groups(module, lr), lr=lr, momentum=h.momentum, nesterov=h.nesterov,
                                    fused=fused_step(module))
    trainer = module.trainer
    total = total_steps(trainer)  # not estimated_stepping_batches: lightning_app/lr_schedule.py says why
    epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
    warmup = min(total - 1, int(h.warmup_epochs * total / epochs))
    module.warmup_steps = warmup  # PowerSGD never starts before it (ClusterDDPStrategy.powersgd_start_iter)
    schedule = SettingsKeepingLambdaLR(optimizer, warmup_cosine(warmup, total))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
