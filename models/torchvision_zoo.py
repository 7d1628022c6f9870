"""Every classification builder of torchvision in the registry, under torchvision's name (``--model.arch resnet18``).

Our conv11, resnet50, vgg11 and vgg16 keep their names and small-image stems; torchvision's builders of the same
names are not registered (its BatchNorm VGGs stay reachable as vgg11_bn, vgg16_bn). Each model is built with
``weights=None, num_classes=N``, so its last layer is already the head for the data's classes; starting weights are
copied in afterwards by lightning_app/weights.py, which leaves that head new when its class count differs.

Input sizes (read in torchvision/models/*.py):
  * vit_*: the position embeddings are sized at build time for the builder's ``image_size``, 224; forward asserts
    that exact size (vision_transformer.py, ``_process_input``). Train and validation sizes must both be 224.
  * maxvit_t: built for one ``input_size`` (passed here as the data's image size); every stage's grid, from
    ``_make_block_input_shapes`` (maxvit.py), must be a multiple of the partition size 7.
  * swin: pads odd maps and windows (swin_transformer.py, ``_patch_merging_pad``, ``shifted_window_attention``):
    any size works.
  * CNNs pool adaptively, but some shrink a map to nothing on small inputs (alexnet, inception_v3): the
    smallest size that works is found by running the model on the meta device (shapes only, no memory).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision.models import get_model_builder
from torchvision.models import list_models as tv_list_models

from models import conv11, resnet, vgg  # noqa: F401  (registered first, so their names win)
from models.blurpool import apply_blurpool
from models.registry import is_registered, register_model

MAXVIT_PARTITION = 7  # torchvision maxvit_t's partition_size
MAX_PROBED_SIZE = 1024


def torchvision_names() -> list[str]:
    """torchvision's classification builders (torchvision.models.list_models(module=torchvision.models))."""
    return tv_list_models(module=torchvision.models)


def _builder_kwargs(name: str, image_size: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if name in ("googlenet", "inception_v3"):
        # Their auxiliary classifiers make forward return a namedtuple in train mode; init_weights=True is the
        # current default spelled out (None warns).
        kwargs.setdefault("aux_logits", False)
        kwargs.setdefault("init_weights", True)
    if name.startswith("maxvit"):
        kwargs.setdefault("input_size", (image_size, image_size))
    return kwargs


def build(name: str, num_classes: int, image_size: int = 224, blurpool: bool = False, **kwargs: Any) -> nn.Module:
    """torchvision's ``name``, random init, its classifier sized for ``num_classes``.

    ``blurpool``: blur before every strided conv with >= 16 input channels (models/blurpool.py); refused (ValueError)
    where the model has none (ViT, swin: their strided convs see the 3 RGB channels only).
    """
    model = get_model_builder(name)(weights=None, num_classes=num_classes, **_builder_kwargs(name, image_size, kwargs))
    if blurpool and apply_blurpool(model) == 0:
        raise ValueError(f"blurpool does not apply to {name}: it has no strided convolution with 16 or more input "
                         "channels to blur. Drop blurpool from --model.arch_kwargs.")
    return model


def fixed_size(name: str) -> int | None:
    """The one input size a ViT accepts: its builder's default image_size (None for every other arch)."""
    return 224 if name.startswith("vit_") else None


def _maxvit_ok(size: int) -> bool:
    # maxvit.py, _make_block_input_shapes: the stem and each of the 4 blocks halve with a 3x3/2 conv (padding 1)
    side, sides = (size - 1) // 2 + 1, []
    for _ in range(4):
        side = (side - 1) // 2 + 1
        sides.append(side)
    return all(s % MAXVIT_PARTITION == 0 for s in sides)


def _runs_at(name: str, size: int, kwargs: dict[str, Any]) -> bool | None:
    """Whether a forward at ``size`` px works, on the meta device; None when the model cannot be built (there)."""
    try:
        with torch.device("meta"):
            model = get_model_builder(name)(weights=None, num_classes=2, **_builder_kwargs(name, size, kwargs))
    except NotImplementedError:  # e.g. regnet's init copies data, which meta tensors have none of
        return None
    except (TypeError, ValueError):  # arguments it does not take: reported by whoever builds it
        return None
    try:
        with torch.no_grad():
            model.eval()(torch.empty(1, 3, size, size, device="meta"))
    except (RuntimeError, AssertionError, ValueError):  # a map shrunk to nothing; torch._assert on a shape
        return False
    return True


def size_problem(name: str, sizes: list[int], **kwargs: Any) -> str | None:
    """Why torchvision's ``name`` cannot take these input sizes (every train size, then val), saying what it needs;
    None if it can."""
    fixed = fixed_size(name)
    if fixed is not None:
        if all(s == fixed for s in sizes):
            return None
        return (f"{name} takes only {fixed} px images (its position embeddings are sized when it is built; "
                f"torchvision's forward asserts the size), not {'/'.join(map(str, sizes))} px (train, val): set "
                f"--data.image_size {fixed} and --data.val_image_size {fixed}")
    if name.startswith("maxvit"):
        if len(set(sizes)) == 1 and _maxvit_ok(sizes[0]):
            return None
        legal = [s for s in range(32, MAX_PROBED_SIZE + 1, 32) if _maxvit_ok(s)]
        return (f"{name} is built for one input size whose stages (the size halved 2, 3, 4 and 5 times) are all "
                f"multiples of its partition size {MAXVIT_PARTITION}, such as {', '.join(map(str, legal))} px; got "
                f"{'/'.join(map(str, sizes))} px (train, val): set --data.image_size and --data.val_image_size to "
                "one of those")
    for size in sorted(set(sizes)):
        if _runs_at(name, size, kwargs) is False:
            lo, hi = size, MAX_PROBED_SIZE  # the smallest size that runs, by bisection (smaller maps only shrink)
            if _runs_at(name, hi, kwargs) is False:
                return f"{name} does not run at {size} px (nor at {hi} px); check --model.arch_kwargs"
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if _runs_at(name, mid, kwargs) else (mid, hi)
            return (f"{name} needs images of at least {hi} px (below that a layer's output shrinks to nothing), got "
                    f"{size} px: set --data.image_size and --data.val_image_size to {hi} or more")
    return None


for _name in torchvision_names():
    if not is_registered(_name):  # ours win: conv11, resnet50, vgg11, vgg16 keep their small-image adaptations
        register_model(_name, origin="torchvision")(functools.partial(build, _name))
