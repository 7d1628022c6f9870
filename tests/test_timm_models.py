"""timm models by name (`--model.arch timm/NAME`, models/timm_zoo.py): a ViT trains at 32 px (built with img_size
from the data) and its ONNX export gives the checkpoint's probabilities; timm's pretrained weights load offline from
a prepared Hugging Face cache or a file, through timm's loader, with the head new for the data's classes; the head
of a distilled model (two classifiers) is what fine-tuning leaves trainable; refusals in one paragraph (a wrong
name, a size the model cannot run, BlurPool where it does not apply); runs of other archs never import timm."""
from __future__ import annotations

import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch

from lightning_app.errors import UserError
from lightning_app.settings import check_settings
from tests.helpers import REPO
from tests.helpers.checkpoints import assert_onnx_export_matches
from tests.helpers.optional import needs_timm

pytestmark = needs_timm
REVISION = "0" * 40


def fit(data_dir, root, arch: str, steps: int = 2, **model_kwargs):
    from datamodules import ImageFolderDataModule
    from lightning_app.module import ImageClassifier

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=4, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch=arch, num_classes=dm.num_classes, image_size=32, global_batch_size=4,
                            pictures=[], warmup_epochs=0, **model_kwargs)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         limit_train_batches=steps, limit_val_batches=1, num_sanity_val_steps=0)
    return trainer, model, dm


def hf_cache(root, tagged: str, state: dict[str, torch.Tensor]):
    """A Hugging Face hub cache holding timm/<tagged>'s model.safetensors, laid out as huggingface_hub writes it
    (models--ORG--NAME/refs/main naming the snapshot; file_download.py, try_to_load_from_cache reads it)."""
    import safetensors.torch

    repo = root / f"models--timm--{tagged}"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    path = repo / "snapshots" / REVISION / "model.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def test_vit_trains_at_32_px_and_its_onnx_export_matches_the_checkpoint(tiny_data, tmp_path):
    """vit_tiny_patch16_224 built with img_size 32 (its position embeddings for a 2x2 grid); arch_kwargs reach
    timm.create_model (drop_path_rate); the export rebuilds it at the same size."""
    trainer, model, dm = fit(tiny_data, tmp_path, "timm/vit_tiny_patch16_224", arch_kwargs={"drop_path_rate": 0.1})
    assert model.backbone.patch_embed.img_size == (32, 32)
    assert model.backbone.blocks[1].drop_path1.drop_prob == pytest.approx(0.1 / 11)  # timm's linear rule, 12 blocks
    before = model.backbone.head.weight.detach().clone()
    trainer.fit(model, dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert model.backbone.head.weight.shape == (10, 192) and model.backbone_num_classes() == 10
    assert not torch.equal(model.backbone.head.weight, before), "the head did not train"
    ckpt = tmp_path / "vit.ckpt"
    trainer.save_checkpoint(ckpt)
    assert_onnx_export_matches(ckpt, tmp_path / "vit.onnx")


def test_pretrained_weights_load_offline_from_the_hf_cache_with_the_head_replaced(tmp_path, monkeypatch):
    """`--model.weights timm` and `timm/NAME.TAG` read resnet10t.c3_in1k's file from a temporary HF cache (offline:
    HF_HUB_OFFLINE, and a cache miss is an error, not a download); a .safetensors path loads the same way. The
    body is the file's, the head fc stays new with 10 classes (timm drops a classifier of another class count)."""
    import timm

    from lightning_app.module import ImageClassifier
    from lightning_app.weights import WeightsError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(1)
    source = timm.create_model("resnet10t").state_dict()  # 1000 classes, as timm's weights
    path = hf_cache(tmp_path / "hub", "resnet10t.c3_in1k", source)
    for weights in ("timm", "timm/resnet10t.c3_in1k", str(path)):
        model = ImageClassifier(arch="timm/resnet10t", num_classes=10, image_size=32, pictures=[],
                                channels_last=True)
        head_before = model.backbone.fc.weight.detach().clone()
        report = model.load_weights(weights)
        assert str(report).endswith("loaded 84 tensors, new 0, ignored 0; head fc replaced (1000 classes there, 10 "
                                    "here)"), report
        body = {k: v for k, v in model.backbone.state_dict().items() if not k.startswith("fc.")}
        assert len(body) == 84  # BatchNorm statistics and counters included
        for key, value in body.items():
            torch.testing.assert_close(value, source[key], rtol=0, atol=0, msg=key)
        assert model.backbone.fc.weight.shape == (10, 512)
        assert torch.equal(model.backbone.fc.weight, head_before)  # left as initialised
        assert model.backbone.conv1[0].weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(WeightsError, match=r"timm/resnet10t\.c3_in1k: not in the Hugging Face cache .*hf download"):
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
        ImageClassifier(arch="timm/resnet10t", num_classes=10, image_size=32, pictures=[]).load_weights("timm")


def test_vit_weights_resample_to_32_px(tmp_path):
    """A file of vit_tiny at 224 px into the 32 px model: timm's filter resamples the position embeddings (14x14 to
    2x2 patches); every other tensor but the head is the file's."""
    import safetensors.torch
    import timm

    from lightning_app.module import ImageClassifier

    source = timm.create_model("vit_tiny_patch16_224").state_dict()
    safetensors.torch.save_file({k: v.contiguous() for k, v in source.items()}, str(tmp_path / "vit.safetensors"))
    model = ImageClassifier(arch="timm/vit_tiny_patch16_224", num_classes=10, image_size=32, pictures=[])
    report = model.load_weights(str(tmp_path / "vit.safetensors"))
    assert report.head_replaced and report.head == "head" and not report.new
    assert model.backbone.pos_embed.shape == (1, 1 + 4, 192) != source["pos_embed"].shape
    torch.testing.assert_close(model.backbone.blocks[0].attn.qkv.weight, source["blocks.0.attn.qkv.weight"])


def test_freeze_backbone_epochs_trains_both_heads_of_a_distilled_vit(tiny_data, tmp_path):
    """deit's distilled model has two classifiers (pretrained_cfg['classifier'] = ('head', 'head_dist')); the last
    Linear would be head_dist alone. In the frozen epoch exactly the two heads move."""
    trainer, model, dm = fit(tiny_data, tmp_path, "timm/deit_tiny_distilled_patch16_224", freeze_backbone_epochs=1)
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    trainer.fit(model, dm)
    moved = sorted(n for n, p in model.backbone.named_parameters() if not torch.equal(p, before[n]))
    assert moved == ["head.bias", "head.weight", "head_dist.bias", "head_dist.weight"], moved[:6]


def test_a_wrong_timm_name_gets_the_closest_timm_names():
    with pytest.raises(UserError) as refused:
        check_settings({"arch": "timm/resnet10"}, {"image_size": 32}, {})
    message = str(refused.value)
    assert "--model.arch 'timm/resnet10' is not a known architecture: the closest names are timm/resnet10t" in message
    close = message.split("the closest names are ")[1].split(". ")[0].split(", ")
    assert all(n.startswith("timm/") for n in close), close  # timm's names only, not torchvision's resnet18
    assert "\n" not in message


def test_sizes_a_timm_model_cannot_run_are_refused_with_one_that_works():
    check_settings({"arch": "timm/vit_tiny_patch16_224"}, {"image_size": 32}, {})  # img_size 32: runs
    with pytest.raises(UserError) as refused:
        check_settings({"arch": "timm/vit_tiny_patch16_224"}, {"image_size": 32, "val_image_size": 64}, {})
    message = str(refused.value)
    assert ("timm/vit_tiny_patch16_224 is built for one input size (img_size 32 px, the train size "
            "--data.image_size) and does not run at 64 px of 32/64 px (train, val): set --data.val_image_size 32"
            in message)
    assert "pass --model.arch_kwargs '{dynamic_img_size: true}'" in message and "\n" not in message
    check_settings({"arch": "timm/vit_tiny_patch16_224", "arch_kwargs": {"dynamic_img_size": True}},
                   {"image_size": 32, "val_image_size": 64}, {})
    with pytest.raises(UserError, match=r"timm/inception_v3 does not run at 32 px; 96 px is the first size"):
        check_settings({"arch": "timm/inception_v3"}, {"image_size": 32}, {})


def test_blurpool_applies_to_a_timm_cnn_and_is_refused_for_a_vit():
    from models import create_model
    from models.blurpool import BlurConv2d

    with pytest.raises(UserError, match="blurpool does not apply to timm/vit_tiny_patch16_224"):
        check_settings({"arch": "timm/vit_tiny_patch16_224", "arch_kwargs": {"blurpool": True}}, {"image_size": 32}, {})
    model = create_model("timm/resnet10t", num_classes=10, image_size=32, blurpool=True)
    assert sum(isinstance(m, BlurConv2d) for m in model.modules()) == 3  # the strided 3x3 of layers 2-4


def test_timm_weights_need_a_timm_arch_and_one_of_its_tags():
    with pytest.raises(UserError, match=r"--model.weights timm are timm's pretrained weights: they need a timm arch"):
        check_settings({"arch": "resnet18", "weights": "timm"}, {"image_size": 32}, {})
    with pytest.raises(UserError, match=r"timm/resnet18.a1_in1k are not timm's pretrained weights of --model.arch "
                                        r"timm/resnet10t: its tags are timm/resnet10t.c3_in1k"):
        check_settings({"arch": "timm/resnet10t", "weights": "timm/resnet18.a1_in1k"}, {"image_size": 32}, {})


def test_a_run_of_another_arch_never_imports_timm():
    """timm's names are registered when one is first looked up (models/registry.py, register_family): importing
    timm costs about 0.6 s, on every run and every test that starts main.py."""
    code = ("import sys; from lightning_app.settings import check_settings; from lightning_app.module import "
            "ImageClassifier; check_settings({'arch': 'resnet18'}, {'image_size': 32}, {}); "
            "ImageClassifier(arch='conv11', pictures=[]); print('timm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
