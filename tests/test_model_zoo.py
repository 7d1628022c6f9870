"""Models by name: torchvision's classifiers train on the tiny tree at their smallest legal size, with the head built
for its classes; fine-tuning from a torchvision weights enum out of a prepared torch hub cache; refusals in one
paragraph (a ViT at 32 px, an unknown name, BlurPool where it does not apply); ONNX export of a torchvision model."""
from __future__ import annotations

import importlib.util

import pytest
import pytorch_lightning as pl
import torch

from datamodules import ImageFolderDataModule
from lightning_app.errors import UserError
from lightning_app.module import ImageClassifier
from lightning_app.settings import check_settings
from lightning_app.weights import head_name, torchvision_cache_path
from tests.helpers.checkpoints import assert_onnx_export_matches
from tests.helpers.cli import quick_args, run_main

# (arch, its smallest legal input size): one per family, the smallest width torchvision offers
FAMILIES = [
    ("resnet18", 32), ("resnext50_32x4d", 32), ("wide_resnet50_2", 32), ("regnet_y_400mf", 32),
    ("efficientnet_b0", 32), ("efficientnet_v2_s", 32), ("mobilenet_v3_small", 32), ("convnext_tiny", 32),
    ("squeezenet1_1", 32), ("swin_t", 32), ("vit_b_32", 224), ("maxvit_t", 224),
]


def fit(data_dir, root, arch: str, size: int, steps: int = 2, epochs: int = 1, **model_kwargs):
    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=4, num_workers=0, image_size=size,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch=arch, num_classes=dm.num_classes, image_size=size, global_batch_size=4,
                            pictures=[], warmup_epochs=0, **model_kwargs)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         limit_train_batches=steps, limit_val_batches=1, num_sanity_val_steps=0)
    return trainer, model, dm


def head_of(model: ImageClassifier) -> torch.nn.Module:
    return dict(model.backbone.named_modules())[head_name(model.backbone)]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "size"), FAMILIES, ids=[a for a, _ in FAMILIES])
def test_each_torchvision_family_trains_two_steps(arch, size, tiny_data, tmp_path):
    trainer, model, dm = fit(tiny_data, tmp_path, arch, size)
    head = head_of(model)
    before = head.weight.detach().clone()
    trainer.fit(model, dm)
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert 0 <= float(trainer.callback_metrics["val/acc1"]) <= 1
    assert head.weight.shape[0] == 10 and model.backbone_num_classes() == 10  # the head built for the 10 classes
    assert not torch.equal(head.weight, before), "the head did not train"


@pytest.mark.slow
def test_freeze_backbone_epochs_trains_only_the_head_of_swin(tiny_data, tmp_path):
    """The body/head split holds for a transformer: parameters that sit on non-leaf modules (the relative position
    bias tables) stay frozen with the body; only the head moves in the frozen epoch."""
    trainer, model, dm = fit(tiny_data, tmp_path, "swin_t", 32, freeze_backbone_epochs=1)
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    trainer.fit(model, dm)
    head = head_name(model.backbone) + "."
    moved = sorted(n for n, p in model.backbone.named_parameters() if not torch.equal(p, before[n]))
    assert moved == [head + "bias", head + "weight"], moved[:5]


@pytest.mark.slow
def test_fine_tune_resnet18_from_a_weights_enum_in_the_hub_cache(tiny_data, tmp_path, monkeypatch):
    """torchvision's file name under a temporary TORCH_HOME/hub/checkpoints, its real layout (1000 classes): the
    body loads as it is, the head is rebuilt for the tree's 10 classes."""
    from torchvision.models import resnet18

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached, _ = torchvision_cache_path("ResNet18_Weights.IMAGENET1K_V1")
    assert cached.name == "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.manual_seed(1)
    source = resnet18(weights=None).state_dict()
    torch.save(source, cached)
    trainer, model, dm = fit(tiny_data, tmp_path, "resnet18", 32, steps=1, freeze_backbone_epochs=1,
                             weights="ResNet18_Weights.IMAGENET1K_V1")
    report = model.load_weights("ResNet18_Weights.IMAGENET1K_V1")
    assert str(report).startswith("model.weights ResNet18_Weights.IMAGENET1K_V1 (torchvision weights): loaded 120 "
                                  "tensors, new 0, ignored 0; head fc replaced (1000 classes there, 10 here)"), report
    trainer.fit(model, dm)  # setup loads them again, as fit does from the command line
    assert model.backbone.fc.out_features == 10
    torch.testing.assert_close(model.backbone.conv1.weight, source["conv1.weight"], rtol=0, atol=0)  # frozen body


def test_densenet_weights_with_torchvision_old_keys_load_whole(tmp_path, monkeypatch):
    """torchvision's DenseNet files name norm1 'norm.1' (its builder renames them when it loads): every tensor loads."""
    import re

    from torchvision.models import densenet121

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached, _ = torchvision_cache_path("DenseNet121_Weights.IMAGENET1K_V1")
    cached.parent.mkdir(parents=True)
    old_style = {re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.(weight|bias|running_mean|running_var)$",
                        r"\1.\2.\3", k): v for k, v in densenet121(weights=None).state_dict().items()}
    assert "features.denseblock1.denselayer1.norm.1.weight" in old_style
    torch.save(old_style, cached)
    model = ImageClassifier(arch="densenet121", num_classes=10, image_size=32, pictures=[])
    report = model.load_weights("DenseNet121_Weights.IMAGENET1K_V1")
    assert "new 0, ignored 0; head classifier replaced (1000 classes there, 10 here)" in str(report), report


def test_weights_of_another_arch_are_refused_in_one_paragraph():
    with pytest.raises(UserError) as refused:
        check_settings({"arch": "resnet18", "weights": "ResNet50_Weights.IMAGENET1K_V2"}, {"image_size": 32}, {})
    assert "whose torchvision weights are ResNet18_Weights.IMAGENET1K_V1" in str(refused.value)


@pytest.mark.slow
def test_vit_at_32_px_is_refused_with_the_size_it_needs(tiny_data, tmp_path):
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path / "logs", width=None), "--model.arch", "vit_b_16",
                     "--model.arch_kwargs", "{}", "--data.image_size", "32"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert "--model.arch vit_b_16 takes only 224 px images" in message
    assert "set --data.image_size 224 and --data.val_image_size 224" in message
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("*.ckpt"))


def test_vit_with_progressive_resizing_is_refused_at_setup(tiny_data, tmp_path):
    """The train sizes of a ProgressiveResizing schedule count too: a ViT would stop at the first epoch below 224."""
    from lightning_app.callbacks.progressive_resizing import ProgressiveResizing

    trainer, model, dm = fit(tiny_data, tmp_path, "vit_b_32", 224, epochs=2)
    trainer.callbacks.append(ProgressiveResizing(start_size=160, end_size=224, start_epoch=0, end_epoch=1))
    with pytest.raises(UserError, match=r"vit_b_32 takes only 224 px images .*, not 224/160/224 px \(train, val\)"):
        trainer.fit(model, dm)
    assert trainer.global_step == 0


def test_maxvit_and_alexnet_say_which_sizes_they_take():
    with pytest.raises(UserError, match=r"maxvit_t is built for one input size .* such as 224, 448"):
        check_settings({"arch": "maxvit_t"}, {"image_size": 64}, {})
    with pytest.raises(UserError, match="alexnet needs images of at least 63 px"):
        check_settings({"arch": "alexnet"}, {"image_size": 32}, {})


def test_unknown_arch_gets_the_closest_names():
    """What the CLI's parse-time check (lightning_app.settings.check_settings) answers."""
    with pytest.raises(UserError) as refused:
        check_settings({"arch": "resnet81"}, {"image_size": 32}, {})
    message = str(refused.value)
    assert "--model.arch 'resnet81' is not a known architecture: the closest names are resnet18" in message
    assert "\n" not in message and "vit_h_14" not in message  # one paragraph, not the whole list


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here")
def test_timm_names_without_timm_say_how_to_install_it():
    with pytest.raises(UserError, match="timm is not installed: pip install timm"):
        check_settings({"arch": "timm/resnet18"}, {"image_size": 32}, {})


def test_conv11_width_from_the_default_config_gets_a_hint():
    with pytest.raises(UserError, match=r"cannot build resnet18: .*'width'.* give arch_kwargs by arch"):
        check_settings({"arch": "resnet18", "arch_kwargs": {"width": 16}}, {"image_size": 32}, {})


def test_blurpool_is_refused_where_it_does_not_apply_and_applied_where_it_does():
    with pytest.raises(UserError, match="blurpool does not apply to swin_t"):
        check_settings({"arch": "swin_t", "arch_kwargs": {"blurpool": True}}, {"image_size": 32}, {})
    from models import create_model
    from models.blurpool import BlurConv2d

    model = create_model("resnet18", num_classes=10, image_size=32, blurpool=True)
    assert any(isinstance(m, BlurConv2d) for m in model.modules())


def test_fit_help_lists_the_families(capsys):
    from lightning_app.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family in ("resnext", "wide_resnet", "regnet", "efficientnet(_v2)", "mobilenet_v2/v3", "convnext", "swin",
                   "vit (224 px only)", "maxvit_t", "any timm model as timm/NAME", "timm.list_models()"):
        assert family in text, family


@pytest.mark.slow
def test_onnx_export_of_resnet18_matches_the_checkpoint(tiny_data, tmp_path):
    trainer, model, dm = fit(tiny_data, tmp_path, "resnet18", 32)
    trainer.fit(model, dm)
    ckpt = tmp_path / "resnet18.ckpt"
    trainer.save_checkpoint(ckpt)
    assert_onnx_export_matches(ckpt, tmp_path / "resnet18.onnx")


def test_arch_kwargs_by_arch_apply_only_to_the_chosen_arch():
    """configs/default.yaml gives conv11's width by arch: --model.arch resnet18 alone then builds (issue 42)."""
    from models import own_kwargs

    by_arch = {"conv11": {"width": 16}, "timm/resnet10t": {"drop_rate": 0.1}}
    assert own_kwargs("conv11", by_arch) == {"width": 16} and own_kwargs("resnet18", by_arch) == {}
    assert own_kwargs("timm/resnet10t", by_arch) == {"drop_rate": 0.1}
    assert own_kwargs("resnet18", {"width": 16}) == {"width": 16}  # flat: for whichever arch, as before
    check_settings({"arch": "resnet18", "arch_kwargs": {"conv11": {"width": 16}}}, {"image_size": 32}, {})
