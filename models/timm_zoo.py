"""Every model of timm in the registry as ``timm/NAME`` (``--model.arch timm/resnet10t``), for each
``timm.list_models()`` name.

Imported only when a ``timm/`` name is first looked up (models/__init__.py registers the family): importing timm
costs about 0.6 s on top of torch. Each model is ``timm.create_model(NAME, num_classes=N, **arch_kwargs)``, random
init; timm's pretrained weights are loaded afterwards by lightning_app/timm_weights.py through ``pretrained_file``.

Input sizes: a model whose pretrained_cfg says ``fixed_input_size`` (ViT, DeiT, Swin, MaxViT, Mixer, ...) takes an
``img_size`` argument that sizes its position embeddings / attention windows when it is built
(timm/models/_builder.py, ``_update_default_model_kwargs``, which otherwise fills in the pretrained 224); it gets the
data's train size, as ``timm.create_model(NAME, img_size=S)`` does for a timm user, and timm's weight filters resample
pretrained position embeddings to it when they load (vision_transformer.py, ``checkpoint_filter_fn``). Such a model
runs at that one size unless it takes ``dynamic_img_size=True`` (ViT and its kin). What a model cannot run is found
on the meta device (shapes only) and said with a size that works.
"""
from __future__ import annotations

import functools
from typing import Any

import timm
import torch
from timm.models import get_pretrained_cfg
from torch import nn

from models.blurpool import apply_blurpool
from models.registry import is_registered, register_model

PREFIX = "timm/"
SIZE_STEP = 32  # sizes tried, from the asked one up, when a model does not run at it


def timm_names() -> list[str]:
    """timm's model names (``timm.list_models()``: architectures, without pretrained tags)."""
    return timm.list_models()


def pretrained_input_size(name: str) -> int | None:
    """The image side timm's default pretrained weights of ``name`` were trained at (pretrained_cfg input_size)."""
    cfg = get_pretrained_cfg(name)
    size = getattr(cfg, "input_size", None) if cfg is not None else None
    return int(size[-1]) if size else None


def _fixed_input_size(name: str) -> bool:
    cfg = get_pretrained_cfg(name)
    return bool(cfg is not None and cfg.fixed_input_size)


def _create_kwargs(name: str, image_size: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if _fixed_input_size(name):
        kwargs.setdefault("img_size", image_size)
    return kwargs


def build(name: str, num_classes: int, image_size: int = 224, blurpool: bool = False,
          pretrained_file: str | None = None, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, num_classes=num_classes, **kwargs)`` (``img_size=image_size`` for fixed-size models).

    ``name`` may carry a pretrained tag (resnet10t.c3_in1k): its pretrained_cfg is the one the model keeps.
    ``pretrained_file``: load timm's pretrained weights from this local file through timm's own loader
    (``pretrained=True, pretrained_cfg_overlay=dict(file=...)``, timm/models/_builder.py: a ``file`` in the cfg
    wins over the hub and the URL, so nothing is downloaded); the classifier is left new when num_classes differs
    from the weights' (``load_pretrained`` drops ``pretrained_cfg['classifier']``'s tensors and loads the rest).
    ``blurpool``: blur before every strided conv with >= 16 input channels (models/blurpool.py); refused
    (ValueError) where the model has none (ViTs: their one strided conv sees the 3 RGB channels).
    """
    kwargs = _create_kwargs(name, image_size, kwargs)
    if pretrained_file is not None:
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(pretrained_file)})
    model = timm.create_model(name, num_classes=num_classes, **kwargs)
    if blurpool and apply_blurpool(model) == 0:
        raise ValueError(f"blurpool does not apply to timm/{name}: it has no strided nn.Conv2d with 16 or more input "
                         "channels to blur. Drop blurpool from --model.arch_kwargs (timm's own anti-aliasing is "
                         "--model.arch_kwargs '{aa_layer: blurpc}' where the model takes aa_layer).")
    return model


def _runs_at(name: str, built: int, sizes: list[int], kwargs: dict[str, Any]) -> dict[int, bool | None]:
    """For each size, whether the model built for ``built`` px runs a forward at it, on the meta device; None where
    that cannot be told there (the model cannot be built on meta, or not with these kwargs)."""
    try:
        with torch.device("meta"):
            model = build(name, num_classes=2, image_size=built, **kwargs)
    except Exception:  # noqa: BLE001 - unknown kwargs, an init that reads data: reported by whoever builds it
        return dict.fromkeys(sizes)
    found: dict[int, bool | None] = {}
    for size in sizes:
        try:
            with torch.no_grad():
                model.eval()(torch.empty(1, 3, size, size, device="meta"))
            found[size] = True
        except NotImplementedError:  # an op without a meta kernel
            found[size] = None
        except Exception:  # noqa: BLE001 - a shape assert, a map shrunk to nothing, a broadcast of wrong sizes
            found[size] = False
    return found


def size_problem(name: str, sizes: list[int], **kwargs: Any) -> str | None:
    """Why timm's ``name`` cannot take these input sizes (every train size, then val), saying what it needs; None if
    it can (or if the meta device cannot tell). The model is built for the first (train) size."""
    kwargs = {k: v for k, v in kwargs.items() if k != "blurpool"}
    built, wanted = sizes[0], list(dict.fromkeys(sizes))
    runs = _runs_at(name, built, wanted, kwargs)
    if all(ok is not False for ok in runs.values()):
        return None
    shown = "/".join(map(str, sizes))
    pretrained = pretrained_input_size(name) or 224
    if runs[built] is False:
        for size in [*range(built + SIZE_STEP, max(pretrained, built) + 1, SIZE_STEP), pretrained]:
            if size > built and _runs_at(name, size, [size], kwargs)[size]:
                return (f"timm/{name} does not run at {built} px; {size} px is the first size from {built} px up (in "
                        f"steps of {SIZE_STEP}, and its pretrained size {pretrained} px) that it runs at: set "
                        f"--data.image_size and --data.val_image_size to {size}")
        return None  # not even at its pretrained size: the meta device cannot tell; building it will say
    bad = [s for s, ok in runs.items() if ok is False]
    if "img_size" not in _create_kwargs(name, built, kwargs):
        return (f"timm/{name} does not run at {'/'.join(map(str, bad))} px, only at {built} px of {shown} px (train, "
                f"val): set --data.val_image_size {built} (and no progressive resizing)")
    dynamic = ("" if kwargs.get("dynamic_img_size") or
               not all(_runs_at(name, built, bad, {**kwargs, "dynamic_img_size": True}).values()) else
               ", or pass --model.arch_kwargs '{dynamic_img_size: true}' (timm then adapts the model to each "
               "input size as it runs)")
    return (f"timm/{name} is built for one input size (img_size {built} px, the train size --data.image_size) and "
            f"does not run at {'/'.join(map(str, bad))} px of {shown} px (train, val): set --data.val_image_size "
            f"{built} (and no progressive resizing){dynamic}")


for _name in timm_names():
    if not is_registered(PREFIX + _name):
        register_model(PREFIX + _name, origin="timm")(functools.partial(build, _name))
