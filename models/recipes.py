"""Each model family's optimiser defaults: what `--model.arch NAME` trains with when the config leaves the optimiser,
the learning rate or the weight decay unset (null), from the recipe each family was published with:

- conv11: SGD + Nesterov 0.4 per 256 images, weight decay 5e-4: tuned for it on the built-in data
  (docs/training.md).
- ResNets and other CNNs: SGD 0.1 per 256, weight decay 1e-4, torchvision's reference recipe
  (references/classification/README.md: ResNet, `--lr 0.1` over 8 GPUs x 32); VGG takes `--lr 0.01` there.
- ConvNeXt: AdamW 4e-3 per 4096, weight decay 0.05 (Liu et al. 2022, "A ConvNet for the 2020s").
- Vision transformers (ViT, DeiT, Swin, BEiT, EVA): AdamW 5e-4 per 512, weight decay 0.05 (Touvron et al. 2021,
  DeiT; timm's train.py recipes for these use the same).

A rate moves to another global batch as timm's train.py moves it (`lr_base_scale`: linearly for SGD, by the
square root for the Ada* optimisers): `batch_scale`. The module takes its rate per 256 images (`Recipe.lr`), so a
recipe's per-256 rate is its published rate moved from its published batch by the same rule, and training at the
published batch gives the published rate (ConvNeXt: 4e-3 / sqrt(4096 / 256) = 1e-3 per 256).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def batch_scale(optimizer: str, batch: float) -> float:
    """The factor on a rate per 256 images at global batch `batch`."""
    ratio = batch / 256
    return ratio ** 0.5 if optimizer == "adamw" else ratio


@dataclass(frozen=True)
class Recipe:
    optimizer: str  # sgd (momentum and Nesterov from the module's settings) or adamw
    published_lr: float  # at published_batch
    published_batch: int
    weight_decay: float
    source: str

    @property
    def lr(self) -> float:
        """The rate per 256 images that batch_scale takes to published_lr at published_batch."""
        return self.published_lr / batch_scale(self.optimizer, self.published_batch)

    @property
    def said(self) -> str:
        """'lr 0.004 per 4096 images, scaled by the square root of the global batch'."""
        rule = "by the square root of" if self.optimizer == "adamw" else "linearly with"
        return f"lr {self.published_lr:g} per {self.published_batch} images, scaled {rule} the global batch"


CONV11 = Recipe("sgd", 0.4, 256, 5e-4, "tuned for conv11 on the built-in data")
CNN = Recipe("sgd", 0.1, 256, 1e-4, "torchvision's reference recipe for ResNets")
VGG = Recipe("sgd", 0.01, 256, 1e-4, "torchvision's reference recipe for VGG")
CONVNEXT = Recipe("adamw", 4e-3, 4096, 0.05, "ConvNeXt's paper")
TRANSFORMER = Recipe("adamw", 5e-4, 512, 0.05, "DeiT's paper")
# (pattern on the arch's name without a timm/ prefix, recipe): the first that matches
FAMILIES = ((r"conv11", CONV11), (r"vgg", VGG), (r"convnext", CONVNEXT),
            (r"(vit|deit|swin|beit|eva|cait|xcit|pit|levit)", TRANSFORMER))


def recipe(arch: str) -> Recipe:
    """The family recipe of `arch` (a registry name, timm/NAME included); any other model is a CNN."""
    name = arch.split("/", 1)[-1].lower()
    return next((r for pattern, r in FAMILIES if re.match(pattern, name)), CNN)
