"""A tiny timm-style model registry: ``@register_model("name")`` and ``create_model``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

ModelFactory = Callable[..., nn.Module]

_REGISTRY: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Register ``fn(num_classes: int, image_size: int, **kwargs) -> nn.Module`` under ``name``."""

    def decorator(fn: ModelFactory) -> ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def list_models() -> list[str]:
    """Sorted names of all registered architectures."""
    return sorted(_REGISTRY)


def create_model(arch: str, num_classes: int, image_size: int = 224, **kwargs: Any) -> nn.Module:
    """Build ``arch``: a module mapping float NCHW [B, 3, H, W] to logits [B, num_classes].

    ``image_size`` is the (train) input side length; some archs adapt their stem to it.
    Extra keyword arguments go to the arch's factory (e.g. ``width`` for conv11).
    """
    try:
        factory = _REGISTRY[arch]
    except KeyError:
        raise ValueError(
            f"unknown arch {arch!r}; known archs: {', '.join(list_models())}"
        ) from None
    return factory(num_classes=num_classes, image_size=image_size, **kwargs)
