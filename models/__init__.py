"""Backbones and their registry: conv11, resnet50, vgg11, vgg16, then every torchvision classifier by name."""
# Imported for their @register_model side effect.
from models import conv11, resnet, torchvision_zoo, vgg  # noqa: F401
from models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
