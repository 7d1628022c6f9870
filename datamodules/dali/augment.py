"""Auto-augment inside a DALI pipeline: the policies DALI 2.4 ships natively (`nvidia.dali.auto_aug`).

    images = dali_auto_augment(images, "trivialaugment")   # uint8 HWC, after crop + resize, before normalize

DALI has TrivialAugment Wide (`auto_aug.trivial_augment.trivial_augment_wide`), RandAugment
(`auto_aug.rand_augment.rand_augment`) and AutoAugment's ImageNet policy
(`auto_aug.auto_augment.auto_augment`). They use DALI's conditional execution, so the pipeline
must be defined with `@pipeline_def(enable_conditionals=True)`. Random erasing has no
counterpart there and is refused with a message, as is anything else not in that list.
Only imported where DALI is installed (datamodules/dali/pipelines.py).
"""
from __future__ import annotations

from datamodules.errors import DataError

DALI_AUTO_AUGMENTS = ("trivialaugment", "randaugment", "autoaugment")


def check_dali_augment(auto_augment: str | None, random_erasing: float = 0.0) -> None:
    """Raise a DataError naming the setting when DALI cannot do what the config asks."""
    if auto_augment is not None and str(auto_augment).lower() not in DALI_AUTO_AUGMENTS:
        raise DataError(
            f"data.auto_augment {auto_augment!r} is not available with the DALI backend, which supports "
            f"{', '.join(DALI_AUTO_AUGMENTS)} (nvidia.dali.auto_aug). Pick one of those, or a PIL/tensor backend "
            "(e.g. --data datamodules.ImageFolderDataModule), which also has torchvision's policies."
        )
    if random_erasing:
        raise DataError(
            f"data.random_erasing {random_erasing} is not available with the DALI backend (nvidia.dali.auto_aug has "
            "no random erasing). Set --data.random_erasing 0, or use a PIL/tensor backend "
            "(e.g. --data datamodules.ImageFolderDataModule), which erases after the crop."
        )


def dali_auto_augment(images, auto_augment: str | None, seed: int | None = None):
    """`images` (uint8 HWC DataNode) through DALI's policy `auto_augment`; unchanged when it is None.

    Settings follow torchvision's defaults, as datamodules/sample/augment.py uses them: RandAugment with 2 ops at
    magnitude 9 of 31 bins; AutoAugment's ImageNet policy; TrivialAugment Wide with 31 bins.
    """
    if auto_augment is None:
        return images
    check_dali_augment(auto_augment)
    name = str(auto_augment).lower()
    if name == "trivialaugment":
        from nvidia.dali.auto_aug import trivial_augment

        return trivial_augment.trivial_augment_wide(images, num_magnitude_bins=31, seed=seed)
    if name == "randaugment":
        from nvidia.dali.auto_aug import rand_augment

        return rand_augment.rand_augment(images, n=2, m=9, num_magnitude_bins=31, seed=seed)
    from nvidia.dali.auto_aug import auto_augment as aa

    return aa.auto_augment(images, policy_name="image_net", seed=seed)
