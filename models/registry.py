"""A tiny timm-style model registry: ``@register_model("name")`` and ``create_model``.

Our four archs (models/conv11.py, resnet.py, vgg.py) register first; models/torchvision_zoo.py then registers every
other classification builder of torchvision under its own name. A family whose library is slow to import (timm:
about 0.6 s on top of torch) registers a loader instead (`register_family`): its names are registered the first
time a name with its prefix is looked up, so a run of conv11 never imports timm.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from torch import nn

ModelFactory = Callable[..., nn.Module]

_REGISTRY: dict[str, ModelFactory] = {}
_ORIGIN: dict[str, str] = {}  # name -> "ours" | "torchvision" | "timm"
_FAMILIES: dict[str, tuple[str, Callable[[], None]]] = {}  # name prefix ("timm/") -> (origin, loader), run once


def register_model(name: str, origin: str = "ours") -> Callable[[ModelFactory], ModelFactory]:
    """Register ``fn(num_classes: int, image_size: int, **kwargs) -> nn.Module`` under ``name``."""

    def decorator(fn: ModelFactory) -> ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        _ORIGIN[name] = origin
        return fn

    return decorator


def register_family(prefix: str, origin: str, load: Callable[[], None]) -> None:
    """``load()`` registers every name that starts with ``prefix`` (of ``origin``); it runs when such a name is first
    looked up, or when the names of that origin (or all names) are listed."""
    _FAMILIES[prefix] = (origin, load)


def _load_families(name: str | None = None, origin: str | None = None) -> None:
    """Register the names of the families whose prefix ``name`` has, or of ``origin``'s (every family when both
    are None)."""
    for prefix, (of, load) in list(_FAMILIES.items()):
        if (str(name).startswith(prefix) if name is not None else origin in (None, of)):
            del _FAMILIES[prefix]
            load()


def is_registered(name: str) -> bool:
    _load_families(name)
    return name in _REGISTRY


def closest_names(name: str, n: int = 5) -> list[str]:
    """The registered names most like ``name`` (difflib), for "did you mean"; a name with a family's prefix
    (timm/...) is compared with that family's names only."""
    _load_families(name)
    family = str(name).split("/")[0] + "/" if "/" in str(name) else ""
    names = [k for k in _REGISTRY if k.startswith(family) and (family or "/" not in k)]
    return difflib.get_close_matches(name, names, n=n, cutoff=0.5)


def unknown_arch_message(arch: str) -> str:
    close = closest_names(str(arch))
    hint = f"the closest names are {', '.join(close)}" if close else "no known name is close"
    return (f"--model.arch {arch!r} is not a known architecture: {hint}. The names are ours (conv11, resnet50, vgg11, "
            "vgg16), torchvision's classification builders (torchvision.models.list_models()) and timm's models as "
            "timm/NAME (timm.list_models()); `python main.py fit --help` lists the families.")


def list_models(origin: str | None = None) -> list[str]:
    """Sorted names of the registered architectures: all of them (what create_model accepts), or those of one
    origin: "ours" (conv11, resnet50, vgg11, vgg16), "torchvision" or "timm" (timm/NAME; none without timm)."""
    _load_families(origin=origin)
    return sorted(n for n in _REGISTRY if origin is None or _ORIGIN[n] == origin)


def create_model(arch: str, num_classes: int, image_size: int = 224, **kwargs: Any) -> nn.Module:
    """Build ``arch``: a module mapping float NCHW [B, 3, H, W] to logits [B, num_classes].

    ``image_size`` is the (train) input side length; some archs adapt their stem to it.
    Extra keyword arguments go to the arch's factory (e.g. ``width`` for conv11).
    """
    _load_families(arch)
    try:
        factory = _REGISTRY[arch]
    except KeyError:
        raise ValueError(unknown_arch_message(arch)) from None
    return factory(num_classes=num_classes, image_size=image_size, **kwargs)


def own_kwargs(arch: str, arch_kwargs: dict | None) -> dict[str, Any]:
    """The builder arguments of ``arch`` in ``--model.arch_kwargs``: either flat (``{width: 16}``, for whichever arch
    is chosen) or by arch (``{conv11: {width: 16}}``, only the chosen arch's: switching --model.arch leaves
    another arch's arguments behind). By arch means every key is an architecture's name with a mapping."""
    kwargs = dict(arch_kwargs or {})
    if kwargs and all(isinstance(v, dict) for v in kwargs.values()) and all(_is_arch(k) for k in kwargs):
        return dict(kwargs.get(arch) or {})
    return kwargs


def _is_arch(name: str) -> bool:
    if any(str(name).startswith(prefix) for prefix in _FAMILIES):  # timm/NAME: not loaded for this check
        return True
    return name in _REGISTRY
