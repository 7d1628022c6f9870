"""The published recipes (configs/recipes/*.yaml): they parse to the published settings and train.

Also the switches they turn on in the model: MixUp/CutMix soft targets, EMA weights that are
validated and checkpointed, test-time flips and BlurPool.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import EMAWeightAveraging
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules import ImageFolderDataModule
from lightning_app.callbacks.progressive_resizing import ProgressiveResizing
from lightning_app.cli import ClassifierCLI
from lightning_app.module import ImageClassifier, batch_mix
from models import create_model
from models.blurpool import BlurConv2d
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main

RECIPES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs" / "recipes").glob("*.yaml"))


def test_recipes_exist_with_their_source():
    names = {Path(r).name for r in RECIPES}
    assert {"torchvision_resnet50_v2.yaml", "ffcv_resnet50_16ep.yaml", "ffcv_resnet50_88ep.yaml"} <= names
    for recipe in RECIPES:
        header = (REPO / recipe).read_text().split("\ntrainer:")[0]
        assert "%" in header and "Source: https://" in header, f"{recipe} needs its published result and source"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_parses_to_published_settings(recipe, tiny_data, tmp_path):
    cli = ClassifierCLI(args=["--config", recipe, *quick_args(tiny_data, tmp_path, batch=16, width=None)], run=False)
    config, model, data = cli.config, cli.model.hparams, cli.datamodule
    epochs = yaml.safe_load((REPO / recipe).read_text())["trainer"]["max_epochs"]  # quick_args ran 1
    listed = len(yaml.safe_load((REPO / "configs" / "callbacks" / "default.yaml").read_text()))
    callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]][listed:]  # the recipe's
    assert model.arch == "resnet50" and model.label_smoothing == 0.1
    if "torchvision" in recipe:
        assert (data.image_size, data.val_image_size) == (176, 224)
        assert round(data.val_image_size / data.val_crop_ratio) == 232
        assert (model.mixup_alpha, model.cutmix_alpha) == (0.2, 1.0)
        assert (data.auto_augment, data.random_erasing) == ("trivialaugment", 0.1)
        assert callbacks == ["lightning_app.callbacks.ema.DelayedStartEMA"]
        assert model.lr * 1024 / 256 == pytest.approx(0.5) and epochs == 600
    else:
        assert epochs in (16, 88) and model.test_time_flip and model.arch_kwargs == {"blurpool": True}
        assert (data.val_image_size, data.val_crop_ratio) == (256, 0.875)
        assert callbacks == ["lightning_app.callbacks.progressive_resizing.ProgressiveResizing"]
        ramp = config["trainer"]["callbacks"][-1]["init_args"]
        schedule = ProgressiveResizing(ramp["start_size"], ramp["end_size"], ramp["start_epoch"], ramp["end_epoch"])
        sizes = [schedule.size_at(e) for e in range(epochs)]
        assert sizes[0] == 160 and sizes[-1] == 192 and set(sizes) == {160, 192}
        assert model.lr * 4096 / 256 == pytest.approx(1.7)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_one_short_epoch(recipe, tiny_data, tmp_path):
    """The recipe unchanged but for small sizes and a few batches (a few seconds of ResNet-50 on a CPU)."""
    small = ["--data.image_size", "64", "--data.val_image_size", "64", "--trainer.limit_train_batches", "2",
             "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0"]
    if "ffcv" in recipe:
        small += ["--trainer.callbacks.init_args.start_size", "64", "--trainer.callbacks.init_args.end_size", "96"]
    run_main(["fit", "--config", recipe, *quick_args(tiny_data, tmp_path, batch=8, width=None), *small])
    ckpt = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    if "torchvision" in recipe:
        assert "current_model_state" in ckpt and "averaging_state" in ckpt  # the EMA travels in the checkpoint
    else:
        acc = EventAccumulator(str(next(tmp_path.glob("version_*"))), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.value for e in acc.Scalars("train/image_size")] == [64.0]


# -- MixUp / CutMix -----------------------------------------------------------------------
@pytest.mark.parametrize("alphas", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixed_targets_are_distributions_over_the_batch_labels(alphas):
    torch.manual_seed(0)
    mix = batch_mix(10, *alphas)
    images, labels = torch.randn(16, 3, 24, 24), torch.randint(0, 10, (16,))
    for _ in range(5):
        mixed, targets = mix(images, labels)
        assert mixed.shape == images.shape and targets.shape == (16, 10)
        torch.testing.assert_close(targets.sum(-1), torch.ones(16))
        assert (targets >= 0).all()
        # each sample's mass sits on its own label and its partner's (the batch rolled by one)
        own = targets.gather(1, labels[:, None])[:, 0]
        partner = targets.gather(1, labels.roll(1)[:, None])[:, 0]
        torch.testing.assert_close(own + partner - (labels == labels.roll(1)) * own, torch.ones(16))


@pytest.mark.parametrize("switch_prob", [1.0, 0.0, 0.5])
def test_mix_switch_prob_chooses_cutmix_or_mixup(switch_prob):
    torch.manual_seed(0)
    images, labels = torch.rand(8, 3, 32, 32), torch.arange(8)
    partner, rows = images.roll(1, 0), torch.arange(8)  # each image is mixed with the one before it
    mix = batch_mix(8, 0.2, 1.0, switch_prob=switch_prob)
    kinds = set()
    for _ in range(12):
        mixed, targets = mix(images, labels)
        own, theirs = targets[rows, labels], targets[rows, labels.roll(1)]
        if (own == 1).all():
            continue  # nothing mixed in (an empty box, or MixUp's lambda 1): either could have made it
        from_partner = (mixed == partner).all(1)  # per pixel
        if ((mixed == images).all(1) | from_partner).all():  # CutMix: one box of the partner's pixels
            box = from_partner[0]
            h, w = box.any(1).nonzero()[:, 0], box.any(0).nonzero()[:, 0]
            assert box[h.min():h.max() + 1, w.min():w.max() + 1].all() and box.sum() == len(h) * len(w)
            assert (from_partner == box).all()  # the same box in every image
            torch.testing.assert_close(theirs, box.float().mean().expand(8))  # each label weighs its area
            kinds.add("cutmix")
        else:  # MixUp: every pixel lam * its own + (1 - lam) * the partner's, lam its label's weight
            lam = own[:, None, None, None]
            torch.testing.assert_close(mixed, lam * images + (1 - lam) * partner)
            kinds.add("mixup")
    assert kinds == {1.0: {"cutmix"}, 0.0: {"mixup"}, 0.5: {"cutmix", "mixup"}}[switch_prob]
    assert batch_mix(8, 0.0, 0.0) is None


def test_training_with_mixing_feeds_soft_targets_to_the_loss_and_dominant_labels_to_accuracy(tiny_data, tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=32, arch_kwargs={"width": 8},
                            mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1)
    seen = {"targets": [], "acc_targets": []}
    mix, update = model.batch_mix, model.train_acc1.update

    class SpyMix(torch.nn.Module):
        def forward(self, images, labels):
            images, targets = mix(images, labels)
            seen["targets"].append(targets)
            return images, targets

    def spy_update(preds, target):
        seen["acc_targets"].append(target)
        return update(preds, target)

    model.batch_mix, model.train_acc1.update = SpyMix(), spy_update
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=32, num_workers=0, image_size=32)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, dm)
    assert len(seen["targets"]) == 2
    for soft, hard in zip(seen["targets"], seen["acc_targets"], strict=False):
        assert soft.shape == (32, 10) and hard.shape == (32,) and hard.dtype == torch.int64
        torch.testing.assert_close(soft.sum(-1), torch.ones(32))
        assert torch.equal(hard, soft.argmax(-1))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


# -- EMA ----------------------------------------------------------------------------------
class _EMAProbe(pl.Callback):
    """Keeps its own EMA of the live weights and snapshots what validation sees."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.expected: dict[str, torch.Tensor] | None = None
        self.live: dict[str, torch.Tensor] = {}
        self.validated: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if v.is_floating_point()}
        if self.expected is None:
            self.expected = state
        else:
            for k, v in state.items():
                self.expected[k].mul_(self.decay).add_(v, alpha=1 - self.decay)
        self.live = state

    def on_validation_epoch_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_ema_weights_differ_from_live_weights_and_are_validated(tiny_data, tmp_path):
    torch.manual_seed(0)
    decay = 0.5
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=32, num_workers=0, image_size=32)
    model = ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=32, arch_kwargs={"width": 8})
    probe = _EMAProbe(decay)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[EMAWeightAveraging(decay=decay), probe])
    trainer.fit(model, dm)
    key = "backbone.features.0.weight" if "backbone.features.0.weight" in probe.live else next(
        k for k in probe.live if k.endswith("weight"))
    assert not torch.allclose(probe.expected[key], probe.live[key])  # the EMA is not the live model
    for k, v in probe.expected.items():  # validation ran on the EMA, not on the live weights
        torch.testing.assert_close(probe.validated[k].float(), v, rtol=1e-4, atol=1e-5)
    ckpt_path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(ckpt_path)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    torch.testing.assert_close(ckpt["state_dict"][key], probe.expected[key], rtol=1e-4, atol=1e-5)


# -- test-time flips, BlurPool ------------------------------------------------------------
def test_eval_logits_average_the_mirror_image():
    torch.manual_seed(0)
    plain = ImageClassifier("conv11", num_classes=10, image_size=32, arch_kwargs={"width": 8}).eval()
    flips = ImageClassifier("conv11", num_classes=10, image_size=32, arch_kwargs={"width": 8}, test_time_flip=True)
    flips.load_state_dict(plain.state_dict())
    flips.eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval_logits(x), plain(x))
        torch.testing.assert_close(flips.eval_logits(x), (plain(x) + plain(x.flip(-1))) / 2)
        torch.testing.assert_close(flips.eval_logits(x), flips.eval_logits(x.flip(-1)), rtol=1e-4, atol=1e-5)


def test_blurpool_blurs_every_strided_conv_and_keeps_state_dict_keys():
    torch.manual_seed(0)
    plain = create_model("resnet50", num_classes=10, image_size=64)
    blur = create_model("resnet50", num_classes=10, image_size=64, blurpool=True)
    blurred = [n for n, m in blur.named_modules() if isinstance(m, BlurConv2d)]
    assert sorted(blurred) == sorted(f"layer{i}.0.{c}" for i in (2, 3, 4) for c in ("conv2", "downsample.0"))
    assert plain.state_dict().keys() == blur.state_dict().keys()
    blur.load_state_dict(plain.state_dict())
    conv = copy.deepcopy(blur.layer2[0].conv2)
    x = torch.zeros(1, conv.in_channels, 8, 8)
    x[..., 4, 4] = 1.0  # an impulse: the blur spreads it before the strided conv samples it
    binomial = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16  # [1,2,1] x [1,2,1] / 16
    blurred = torch.nn.functional.conv2d(x, binomial.expand(conv.in_channels, 1, 3, 3), padding=1,
                                         groups=conv.in_channels)
    assert blurred[0, 0, 3:6, 3:6].tolist() == binomial.tolist()  # the impulse, spread
    ref = torch.nn.functional.conv2d(blurred, conv.weight, stride=2, padding=1)
    torch.testing.assert_close(conv(x), ref)


def test_the_recipe_line_says_where_each_value_came_from(tiny_data, tmp_path):
    best = tmp_path / "best.yaml"  # what a sweep writes: the tuned values, the optimiser left to the recipe
    best.write_text("model:\n  lr: 0.538428\n  weight_decay: 1.36401e-05\n")
    args = quick_args(tiny_data, tmp_path / "logs")
    line = ClassifierCLI(args=["--config", str(best), *args], run=False).model.recipe_line()
    assert line.startswith("--model.arch conv11: SGD from the recipe (tuned for conv11 on the built-in data: "
                           "models/recipes.py); lr 0.538428 per 256 images, weight decay 1.36401e-05 from "
                           f"{best}."), line
    line = ClassifierCLI(args=["--config", str(best), *args, "--model.optimizer", "adamw", "--model.lr", "0.01"],
                         run=False).model.recipe_line()
    assert "AdamW, lr 0.01 per 256 images from the command line; weight decay 1.36401e-05 from" in line, line
    line = ClassifierCLI(args=args, run=False).model.recipe_line()
    assert ("SGD, lr 0.4 per 256 images, scaled linearly with the global batch, weight decay 0.0005 from the recipe "
            "(tuned for conv11") in line, line
