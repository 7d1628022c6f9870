"""Per-sample train augmentation on uint8 CHW tensors: auto-augment policies and random erasing.

Applied after the random resized crop and flip (`TrainCrop(augment=...)` in datamodules/sample/crop.py), so
every PIL/tensor backend gets the same policy. DALI has its own subset: datamodules/dali/augment.py.

Every random choice comes from the sample's own `random.Random` (the one its crop draws from, seeded per
sample in sample/dataset.py), never from torch's generator: the sample path builds samples on several
threads at once, and torchvision's policies draw from torch's one shared generator
(torchvision/transforms/v2/_auto_augment.py: torch.randint/torch.rand in each policy's forward;
_augment.py: RandomErasing.make_params), so a seeded run would depend on which thread came first.
The draws below follow those forwards one for one; the image operations are torchvision's own
(`_apply_image_or_video_transform`, F.erase), so the pixels are torchvision's for the same choices.
"""
from __future__ import annotations

import math
import random

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from datamodules.errors import DataError
from datamodules.sample.transforms import IMAGENET_MEAN

AUTO_AUGMENTS = ("trivialaugment", "randaugment", "autoaugment")
# torchvision's reference scripts erase AFTER normalising with value 0, i.e. with the mean colour;
# on uint8 before normalising, that is the ImageNet mean in [0, 255].
ERASE_VALUE = [round(m * 255) for m in IMAGENET_MEAN]


def auto_augment_policy(name: str) -> v2.Transform:
    """torchvision v2's policy for `name` (its defaults, as the torchvision reference recipes use them)."""
    if name == "trivialaugment":
        return v2.TrivialAugmentWide()
    if name == "randaugment":
        return v2.RandAugment()  # num_ops 2, magnitude 9
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    raise DataError(f"data.auto_augment must be one of {', '.join(AUTO_AUGMENTS)} or null, got {name!r}.")


def _signed(magnitude: float, signed: bool, rng: random.Random) -> float:
    return -magnitude if signed and rng.random() <= 0.5 else magnitude


def _policy_ops(policy: v2.Transform, height: int, width: int, rng: random.Random) -> list[tuple[str, float]]:
    """(operation, magnitude) pairs: the choices the policy's forward makes, drawn from `rng`."""
    space = policy._AUGMENTATION_SPACE
    if isinstance(policy, v2.AutoAugment):
        ops = []
        for op, probability, magnitude_idx in policy._policies[rng.randrange(len(policy._policies))]:
            if not rng.random() <= probability:
                continue
            magnitudes_fn, signed = space[op]
            magnitudes = magnitudes_fn(10, height, width)
            ops.append((op, _signed(float(magnitudes[magnitude_idx]), signed, rng) if magnitudes is not None else 0.0))
        return ops
    names = list(space)
    if isinstance(policy, v2.RandAugment):
        ops = []
        for _ in range(policy.num_ops):
            op = names[rng.randrange(len(names))]
            magnitudes_fn, signed = space[op]
            magnitudes = magnitudes_fn(policy.num_magnitude_bins, height, width)
            ops.append((op, _signed(float(magnitudes[policy.magnitude]), signed, rng) if magnitudes is not None
                        else 0.0))
        return ops
    if isinstance(policy, v2.TrivialAugmentWide):
        op = names[rng.randrange(len(names))]
        magnitudes_fn, signed = space[op]
        magnitudes = magnitudes_fn(policy.num_magnitude_bins, height, width)
        if magnitudes is None:
            return [(op, 0.0)]
        return [(op, _signed(float(magnitudes[rng.randrange(policy.num_magnitude_bins)]), signed, rng))]
    raise TypeError(f"no seeded draws for {type(policy).__name__}")


def erase_box(image: torch.Tensor, rng: random.Random, scale: tuple[float, float] = (0.02, 0.33),
              ratio: tuple[float, float] = (0.3, 3.3)) -> tuple[int, int, int, int] | None:
    """(top, left, h, w) of RandomErasing's rectangle (its make_params with `rng`), None after 10 misses."""
    img_h, img_w = image.shape[-2:]
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = img_h * img_w * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h, w = round(math.sqrt(erase_area * aspect)), round(math.sqrt(erase_area / aspect))
        if h < img_h and w < img_w:
            return rng.randint(0, img_h - h), rng.randint(0, img_w - w), h, w
    return None


class SeededAugment:
    """The auto-augment policy, then random erasing with probability `erasing`; draws from the sample's rng."""

    takes_rng = True  # TrainCrop passes the sample's random.Random

    def __init__(self, policy: v2.Transform | None, erasing: float) -> None:
        self.policy, self.erasing = policy, erasing
        self.erase_value = torch.tensor(ERASE_VALUE, dtype=torch.float32)[:, None, None]

    def __call__(self, image: torch.Tensor, rng: random.Random | None = None) -> torch.Tensor:
        rng = rng or random.Random(int(torch.randint(2**62, ())))  # a caller without one: seeded from torch
        if self.policy is not None:
            for op, magnitude in _policy_ops(self.policy, image.shape[-2], image.shape[-1], rng):
                image = self.policy._apply_image_or_video_transform(
                    image, op, magnitude, interpolation=self.policy.interpolation, fill=self.policy._fill)
        if self.erasing > 0 and not rng.random() >= self.erasing:
            box = erase_box(image, rng)
            if box is not None:
                image = F.erase(image, *box, self.erase_value)
        return image


def make_train_augment(auto_augment: str | None = None, random_erasing: float = 0.0) -> SeededAugment | None:
    """The per-sample augmentation for `TrainCrop(augment=...)`, or None when both are off."""
    if not 0.0 <= random_erasing <= 1.0:
        raise DataError(f"data.random_erasing is a probability in [0, 1], got {random_erasing}.")
    policy = auto_augment_policy(str(auto_augment).lower()) if auto_augment else None
    if policy is None and random_erasing <= 0:
        return None
    return SeededAugment(policy, random_erasing)
