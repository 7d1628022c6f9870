"""VGG-11/16 with BatchNorm, built from torchvision's VGG layer configs (never pretrained).

torchvision's head expects a 7x7x512 map (a 25,088 x 4,096 Linear, ~120M parameters);
ours pools globally to 512 features and uses one Linear(512, num_classes), so any input
size works. The features are torchvision's own (``make_layers`` on the vgg11_bn/vgg16_bn
configs), so ``features.*`` state-dict keys match ``vgg11_bn`` / ``vgg16_bn``.
We do not call ``vgg16_bn(weights=None)`` and then swap the head: that would allocate and
initialise the 120M-parameter head on every build (~1.6 s and ~0.5 GB per process).
"""
from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.vgg import cfgs, make_layers

from models.registry import register_model


class VGG(nn.Module):
    """VGG-BN features, global average pooling, dropout (default 0) and Linear(512, num_classes).

    Minimum input: 1 px. Max-pools use ``ceil_mode=True``, so a 1x1 map stays 1x1 and no
    input below 32 px pools to size 0; sizes divisible by 32 (32, 224, ...) pool exactly as
    torchvision's (32 px reaches 1x1 after the five pools).
    """

    def __init__(self, cfg: str, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = make_layers(cfgs[cfg], batch_norm=True)
        for m in self.features:
            if isinstance(m, nn.MaxPool2d):
                m.ceil_mode = True
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(512, num_classes))
        self._init_weights()

    def _init_weights(self) -> None:
        # Same scheme as torchvision's VGG.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.flatten(self.avgpool(self.features(x))))


@register_model("vgg11")
def vgg11(num_classes: int, image_size: int = 224, dropout: float = 0.0) -> nn.Module:
    """VGG-11-BN (8 convs), any input of 1 px or more."""
    return VGG("A", num_classes, dropout)


@register_model("vgg16")
def vgg16(num_classes: int, image_size: int = 224, dropout: float = 0.0) -> nn.Module:
    """VGG-16-BN (13 convs), any input of 1 px or more."""
    return VGG("D", num_classes, dropout)
