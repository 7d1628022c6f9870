"""ResNet-50 from torchvision (never pretrained), with a CIFAR-style stem for small inputs."""
from __future__ import annotations

from torch import nn
from torchvision.models import resnet50 as tv_resnet50

from models.blurpool import apply_blurpool
from models.registry import register_model

# Below this input size the 7x7/2 stem + max-pool (a 4x reduction) throws away too much.
SMALL_INPUT = 64


@register_model("resnet50")
def resnet50(num_classes: int, image_size: int = 224, blurpool: bool = False) -> nn.Module:
    """torchvision ResNet-50, random init.

    ``image_size < 64``: 3x3 stride-1 stem (64 channels) and no max-pooling, so 32 px ends
    at 4x4 before the global pool. Otherwise the standard 7x7/2 stem + 3x3/2 max-pool.
    Every layer pads, so no input size shrinks a map to zero.
    ``blurpool``: blur before every strided conv, as FFCV (``arch_kwargs: {blurpool: true}``; models/blurpool.py).
    """
    # zero_init_residual: each block's last BN starts with gamma 0, so every residual block
    # begins as the identity; the deep net trains like a shallow one early on and tolerates
    # larger learning rates / batch sizes (Goyal et al., 2017).
    model = tv_resnet50(weights=None, num_classes=num_classes, zero_init_residual=True)
    if image_size < SMALL_INPUT:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    if blurpool:
        apply_blurpool(model)
    return model
