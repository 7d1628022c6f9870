"""What the model's inputs are, besides the backbone: MixUp/CutMix on the device batch, and the validation input
(size, resize, mean and std) a checkpoint keeps for export."""
from __future__ import annotations

from torchvision.transforms import v2

from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_app.errors import UserError


def batch_mix(num_classes: int, mixup_alpha: float, cutmix_alpha: float,
              switch_prob: float = 0.5) -> v2.Transform | None:
    """MixUp, CutMix, or a random choice between them per batch (as torchvision's reference recipe); None when off."""
    if mixup_alpha < 0 or cutmix_alpha < 0 or not 0 <= switch_prob <= 1:
        raise UserError(f"model.mixup_alpha and model.cutmix_alpha must be >= 0 and model.mix_switch_prob in [0, 1], "
                         f"got {mixup_alpha}, {cutmix_alpha}, {switch_prob}.")
    mixes = []
    if mixup_alpha > 0:
        mixes.append((v2.MixUp(alpha=mixup_alpha, num_classes=num_classes), 1 - switch_prob))
    if cutmix_alpha > 0:
        mixes.append((v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes), switch_prob))
    if len(mixes) < 2:
        return mixes[0][0] if mixes else None
    return v2.RandomChoice([m for m, _ in mixes], p=[p for _, p in mixes])


def inference_settings(datamodule) -> dict:
    """What export needs to feed the model as validation did: input size, resize, mean/std (0..1 units)."""
    size = getattr(datamodule, "val_image_size", None)
    if not size:
        return {}
    ratio = float(getattr(datamodule, "val_crop_ratio", 1.0) or 1.0)
    return {"image_size": int(size), "resize": round(size / ratio), "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD)}
