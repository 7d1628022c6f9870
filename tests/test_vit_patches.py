"""A ViT built for small images cuts them into a grid of a few patches: said, with the setting that fixes it."""
from __future__ import annotations

import warnings

import pytest

from lightning_app.module import ImageClassifier

pytest.importorskip("timm")


def test_a_vit_at_32_px_with_16_px_patches_is_said():
    with pytest.warns(UserWarning, match=r"at --data.image_size 32 cuts each image into 2x2 patches of 16 px: 4 "
                                         r"tokens.*patch_size: 4"):
        ImageClassifier("timm/vit_tiny_patch16_224", num_classes=2, image_size=32, pictures=[])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*patches of")
        ImageClassifier("timm/vit_tiny_patch16_224", num_classes=2, image_size=32, pictures=[],
                        arch_kwargs={"patch_size": 4})  # an 8x8 grid
