"""conv11: a small VGG-style net with exactly eleven 3x3 convolutions, fast on a CPU at 32 px."""
from __future__ import annotations

from torch import Tensor, nn

from models.registry import register_model

# Convolutions per stage; stages have widths [w, 2w, 4w, 8w]. 2 + 3 + 3 + 3 = 11.
STAGE_DEPTHS = (2, 3, 3, 3)


def _conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]


class Conv11(nn.Module):
    """Eleven conv-BN-ReLU layers in four stages, 2x2 max-pooling between stages, then
    global average pooling, optional dropout and one Linear.

    Pooling uses ``ceil_mode=True`` so a 1x1 map stays 1x1: any input of 1 px or more works
    (32 px gives 32 -> 16 -> 8 -> 4 before the global pool).
    """

    def __init__(self, num_classes: int, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for stage, depth in enumerate(STAGE_DEPTHS):
            if stage > 0:
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
            c_out = width * 2**stage
            for _ in range(depth):
                layers += _conv_bn_relu(c_in, c_out)
                c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(c_in, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        return self.fc(self.dropout(self.flatten(self.pool(x))))


@register_model("conv11")
def conv11(num_classes: int, image_size: int = 224, width: int = 32, dropout: float = 0.0) -> nn.Module:
    """conv11 at any input size (``image_size`` is accepted for the common factory signature)."""
    return Conv11(num_classes=num_classes, width=width, dropout=dropout)
