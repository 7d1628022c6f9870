"""Auto-augment and random erasing: uint8 in, uint8 out, labels untouched, on every PIL/tensor backend."""
from __future__ import annotations

import pytest
import torch

from datamodules import DownscaledDataModule, ImageFolderDataModule
from datamodules.errors import DataError
from datamodules.sample.augment import AUTO_AUGMENTS, make_train_augment
from datamodules.sample.crop import TrainCrop
from tests.helpers.optional import needs_dali


@pytest.mark.parametrize("policy", [*AUTO_AUGMENTS, None])
@pytest.mark.parametrize("erasing", [0.0, 1.0])
def test_each_augmentation_keeps_uint8_chw(policy, erasing):
    augment = make_train_augment(policy, erasing)
    if policy is None and erasing == 0.0:
        assert augment is None  # every switch off: the transform is exactly what it was
        return
    torch.manual_seed(0)
    changed = 0
    for _ in range(8):
        image = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8)
        out = augment(image)
        assert out.dtype == torch.uint8 and out.shape == image.shape
        changed += int(not torch.equal(out, image))
    assert changed >= 4  # the policy does something (AutoAugment's ImageNet policy skips some images)


def test_random_erasing_fills_with_the_mean_colour():
    torch.manual_seed(0)
    image = torch.zeros(3, 64, 64, dtype=torch.uint8)
    out = make_train_augment(None, 1.0)(image)
    erased = (out != 0).any(0)
    assert erased.any()
    # ImageNet's mean colour (0.485, 0.456, 0.406) x 255, rounded: 0 once normalised, as torchvision's
    # reference scripts erase (after normalising, with 0)
    assert out[:, erased].T.unique(dim=0).tolist() == [[124, 116, 104]]


def test_bad_settings_name_the_setting():
    with pytest.raises(DataError, match="data.auto_augment"):
        make_train_augment("augmix")
    with pytest.raises(DataError, match="data.random_erasing"):
        make_train_augment(None, 1.5)


def test_augment_runs_after_crop_and_flip():
    seen = []

    def augment(x):
        seen.append((x.dtype, tuple(x.shape)))
        return x

    import random

    assert TrainCrop(0.25, augment)(torch.zeros(3, 40, 50, dtype=torch.uint8), 24,
                                    random.Random(0)).shape == (3, 24, 24)
    assert seen == [(torch.uint8, (3, 24, 24))]


@pytest.mark.parametrize("module", [ImageFolderDataModule, DownscaledDataModule])
def test_backend_batches_stay_uint8_with_the_same_labels(module, tiny_data, tmp_path):
    kwargs = {"cache_dir": str(tmp_path / "copy"), "max_size": 32} if module is DownscaledDataModule else {}
    batches = {}
    for policy in (None, "trivialaugment"):
        dm = module(data_dir=str(tiny_data), batch_size=240, num_workers=0, image_size=24, auto_augment=policy,
                    random_erasing=0.5 if policy else 0.0, **kwargs)
        dm.setup("fit")
        dataset = dm.datasets["train"]
        images, labels = zip(*(dataset[i] for i in range(0, len(dataset), 7)), strict=False)
        batches[policy] = (torch.stack(images), torch.tensor(labels))
    plain, augmented = batches[None], batches["trivialaugment"]
    assert augmented[0].dtype == torch.uint8 and augmented[0].shape == plain[0].shape
    assert torch.equal(augmented[1], plain[1])
    assert not torch.equal(augmented[0], plain[0])


# -- DALI's native subset (real DALI, CPU) -------------------------------------------------
def _dali_batch(policy: str, images: list) -> list:
    from nvidia.dali import fn, pipeline_def

    from datamodules.dali.augment import dali_auto_augment

    @pipeline_def(enable_conditionals=True, batch_size=len(images), num_threads=1, device_id=None, seed=1)
    def pipe():
        x = fn.external_source(source=lambda: images, batch=True, layout="HWC")
        return dali_auto_augment(x, policy)

    p = pipe()
    p.build()
    (out,) = p.run()
    return [out.at(i) for i in range(len(images))]


@needs_dali
@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
def test_dali_policies_keep_uint8_hwc(policy):
    import numpy as np

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(8)]
    out = _dali_batch(policy, images)
    assert all(o.dtype == np.uint8 and o.shape == i.shape for o, i in zip(out, images, strict=False))
    assert sum(not np.array_equal(o, i) for o, i in zip(out, images, strict=False)) >= 4


def test_dali_refuses_what_it_does_not_have():
    from datamodules.dali.augment import check_dali_augment

    check_dali_augment("trivialaugment")
    with pytest.raises(DataError, match="data.auto_augment 'augmix'.*DALI"):
        check_dali_augment("augmix")
    with pytest.raises(DataError, match="data.random_erasing"):
        check_dali_augment(None, 0.1)
