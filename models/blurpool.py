"""BlurPool (Zhang, 2019, "Making convolutional networks shift-invariant again"), as FFCV applies it.

FFCV's ImageNet script (ffcv-imagenet train_imagenet.py, `BlurPoolConv2d` / `apply_blurpool`)
low-pass filters the input of every strided convolution with at least 16 input channels with
a 3x3 binomial kernel ([1 2 1] x [1 2 1] / 16, depthwise, stride 1) before the convolution.
Here the blurring convolution is a Conv2d subclass, so state-dict keys stay those of the plain
model (torchvision weights load unchanged) and the fixed filter is not saved.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BlurConv2d(nn.Conv2d):
    """A Conv2d that first blurs its input with a fixed 3x3 binomial filter per channel."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        kernel = torch.tensor([1.0, 2.0, 1.0])
        kernel = (kernel[:, None] * kernel[None, :]) / 16
        self.register_buffer("blur_filter", kernel.expand(self.in_channels, 1, 3, 3).clone(), persistent=False)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> BlurConv2d:
        blur = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                   dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
                   padding_mode=conv.padding_mode, device=conv.weight.device, dtype=conv.weight.dtype)
        blur.load_state_dict(conv.state_dict())
        return blur

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blurred = F.conv2d(x, self.blur_filter.to(x.dtype), padding=1, groups=self.in_channels)
        return super().forward(blurred)


def apply_blurpool(model: nn.Module, min_channels: int = 16) -> int:
    """Replace, in place, every strided Conv2d with >= min_channels inputs by a BlurConv2d; returns how many."""
    count = 0
    for name, child in model.named_children():
        if type(child) is nn.Conv2d and max(child.stride) > 1 and child.in_channels >= min_channels:
            setattr(model, name, BlurConv2d.from_conv(child))
            count += 1
        else:
            count += apply_blurpool(child, min_channels)
    return count
