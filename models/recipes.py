"""Each model family's optimiser defaults: what `--model.arch NAME` trains with when the config leaves the optimiser,
the learning rate or the weight decay unset (null). Rates are per 256 images (the module scales them by the global
batch), from the recipe each family was published with:

- conv11: SGD + Nesterov 0.4, weight decay 5e-4: tuned for it on the built-in data (docs/training.md).
- ResNets and other CNNs: SGD 0.1 per 256, weight decay 1e-4, torchvision's reference recipe
  (references/classification/README.md: ResNet, `--lr 0.1` over 8 GPUs x 32); VGG takes `--lr 0.01` there.
- ConvNeXt: AdamW 4e-3 per 4096 (2.5e-4 per 256), weight decay 0.05 (Liu et al. 2022, "A ConvNet for the 2020s").
- Vision transformers (ViT, DeiT, Swin, BEiT, EVA): AdamW 5e-4 per 512 (2.5e-4 per 256), weight decay 0.05
  (Touvron et al. 2021, DeiT; timm's train.py recipes for these use the same).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    optimizer: str  # sgd (momentum and Nesterov from the module's settings) or adamw
    lr: float  # per 256 images
    weight_decay: float
    source: str


CONV11 = Recipe("sgd", 0.4, 5e-4, "tuned for conv11 on the built-in data")
CNN = Recipe("sgd", 0.1, 1e-4, "torchvision's reference recipe for ResNets")
VGG = Recipe("sgd", 0.01, 1e-4, "torchvision's reference recipe for VGG")
CONVNEXT = Recipe("adamw", 2.5e-4, 0.05, "ConvNeXt's recipe: AdamW 4e-3 per 4096")
TRANSFORMER = Recipe("adamw", 2.5e-4, 0.05, "DeiT's recipe: AdamW 5e-4 per 512")
# (pattern on the arch's name without a timm/ prefix, recipe): the first that matches
FAMILIES = ((r"conv11", CONV11), (r"vgg", VGG), (r"convnext", CONVNEXT),
            (r"(vit|deit|swin|beit|eva|cait|xcit|pit|levit)", TRANSFORMER))


def recipe(arch: str) -> Recipe:
    """The family recipe of `arch` (a registry name, timm/NAME included); any other model is a CNN."""
    name = arch.split("/", 1)[-1].lower()
    return next((r for pattern, r in FAMILIES if re.match(pattern, name)), CNN)
