"""Backbones and their registry: conv11, resnet50, vgg11, vgg16, then every torchvision classifier by name, and
timm's models as timm/NAME (registered when such a name is first looked up: models/timm_zoo.py)."""
import importlib.util

# Imported for their @register_model side effect.
from models import conv11, resnet, torchvision_zoo, vgg  # noqa: F401
from models.registry import create_model, list_models, own_kwargs, register_family, register_model


def _register_timm() -> None:
    if importlib.util.find_spec("timm") is not None:  # an optional extra (requirements-extras.txt)
        from models import timm_zoo  # noqa: F401


register_family("timm/", "timm", _register_timm)

__all__ = ["create_model", "list_models", "own_kwargs", "register_model"]
