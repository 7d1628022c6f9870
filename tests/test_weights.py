"""--model.weights: sources, head replacement, reports, refusing pickled code; fine-tuning beats scratch, and the
documented fine-tune command runs as written."""
from __future__ import annotations

import os
import pathlib
import shlex
import shutil

import pytest
import pytorch_lightning as pl
import torch
from torchvision.models import resnet50 as tv_resnet50

from lightning_app.module import ImageClassifier
from lightning_app.weights import (
    UnsafeFileError,
    WeightsError,
    head_name,
    load_weights,
    safe_load,
    torchvision_cache_path,
)
from tests.helpers import REPO
from tests.helpers.checkpoints import evil_file
from tests.helpers.cli import run_main


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    path, marker = evil_file(tmp_path)
    with pytest.raises(UnsafeFileError) as info:
        safe_load(path)
    message = str(info.value)
    assert str(path) in message and "pickle" in message and "run any code" in message
    assert "weights_only=False" in message and "torch.save" in message  # how to convert it
    model = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 4})
    with pytest.raises(UnsafeFileError):
        model.load_weights(str(path))
    assert not marker.exists()


def test_crafted_pickle_via_ckpt_path_is_refused_by_the_cli(tmp_path):
    path, marker = evil_file(tmp_path)
    proc = run_main(["predict", "--ckpt_path", str(path), "--data.predict_dir", str(tmp_path),
                     "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / "logs")], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--ckpt_path" in proc.stderr and "needs full pickle" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_not_a_torch_file(tmp_path):
    bad = tmp_path / "notes.pt"
    bad.write_text("hello")
    with pytest.raises(WeightsError, match="notes.pt"):
        safe_load(bad)


@pytest.fixture(scope="module")
def tv_state_dict_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tv") / "resnet50.pth"
    torch.save(tv_resnet50(weights=None).state_dict(), path)
    return path


def test_torchvision_state_dict_loads_and_head_is_replaced(tv_state_dict_file):
    source = torch.load(tv_state_dict_file, weights_only=True)
    model = ImageClassifier(arch="resnet50", num_classes=5, image_size=64)
    report = model.load_weights(str(tv_state_dict_file))
    assert report.head_replaced and report.head_classes == (1000, 5)
    assert report.new == [] and report.ignored == []  # the head is reported once, as replaced
    assert len(report.loaded) == len(source) - 2
    assert torch.equal(model.backbone.layer3[2].conv2.weight, source["layer3.2.conv2.weight"])
    assert str(report).endswith("new 0, ignored 0; head fc replaced (1000 classes there, 5 here)"), str(report)


def test_shape_mismatch_outside_the_head_names_the_layer(tv_state_dict_file):
    model = ImageClassifier(arch="resnet50", num_classes=1000, image_size=32)  # 3x3 stem: conv1 differs
    with pytest.raises(WeightsError, match=r"layer conv1\.weight .*\(64, 3, 7, 7\).*\(64, 3, 3, 3\)"):
        model.load_weights(str(tv_state_dict_file))


def test_torchvision_name_not_cached_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached, url = torchvision_cache_path("ResNet50_Weights.IMAGENET1K_V2")
    assert cached == tmp_path / "torch" / "hub" / "checkpoints" / os.path.basename(url)
    model = ImageClassifier(arch="resnet50", num_classes=4, image_size=64)
    with pytest.raises(WeightsError) as info:
        model.load_weights("ResNet50_Weights.IMAGENET1K_V2")
    assert str(cached) in str(info.value) and url in str(info.value) and "nothing is downloaded" in str(info.value)


def test_torchvision_name_from_the_hub_cache(tmp_path, monkeypatch, tv_state_dict_file):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached, _ = torchvision_cache_path("ResNet50_Weights.IMAGENET1K_V2")
    cached.parent.mkdir(parents=True)
    shutil.copy(tv_state_dict_file, cached)
    model = ImageClassifier(arch="resnet50", num_classes=4, image_size=64)
    report = model.load_weights("ResNet50_Weights.IMAGENET1K_V2")
    assert report.kind == "torchvision weights" and report.head_replaced and len(report.loaded) > 300


def test_unknown_torchvision_name():
    with pytest.raises(WeightsError, match="not a torchvision weights name"):
        torchvision_cache_path("ResNet50_Weights.NOPE")


def test_our_checkpoint_same_classes_loads_everything(tmp_path):
    src = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 4})
    path = tmp_path / "ours.ckpt"
    torch.save({"state_dict": src.state_dict(), "hyper_parameters": dict(src.hparams)}, path)
    dst = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 4})
    report = load_weights(dst.backbone, str(path))
    assert report.kind == "checkpoint" and not report.new and not report.ignored and not report.head_replaced
    for (name, a), b in zip(src.backbone.state_dict().items(), dst.backbone.state_dict().values(), strict=False):
        assert torch.equal(a, b), name


def test_nothing_matching_is_an_error(tmp_path):
    torch.save({"encoder.layer.weight": torch.zeros(1)}, tmp_path / "other.pt")
    model = ImageClassifier(arch="conv11", num_classes=3, image_size=32, arch_kwargs={"width": 4})
    with pytest.raises(WeightsError, match="none of its 1 tensors"):
        load_weights(model.backbone, str(tmp_path / "other.pt"))


def test_head_and_body_split():
    model = ImageClassifier(arch="vgg11", num_classes=3, image_size=32)
    assert head_name(model.backbone) == "classifier.1"
    body = model.backbone_body_modules()
    assert model.backbone.classifier[1] not in body and model.backbone.features[0] in body


# -- fine-tuning beats training from scratch at the same budget ------------------------------------

def _subset(src: pathlib.Path, dst: pathlib.Path, classes: list[str]) -> pathlib.Path:
    for split in ("train", "val"):
        for c in classes:
            shutil.copytree(src / split / c, dst / split / c)
    return dst


def _fit(data_dir, epochs, root, seed=0, **model_kw) -> tuple[float, ImageClassifier, pl.Trainer]:
    from datamodules import ImageFolderDataModule

    pl.seed_everything(seed, workers=True)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=32, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, min_scale=0.35, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=32,
                            arch_kwargs={"width": 16}, lr=0.4, weight_decay=5e-4, pictures=[], **model_kw)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, dm)
    return float(trainer.callback_metrics["val/acc1"]), model, trainer


@pytest.mark.slow
def test_finetune_from_another_class_set_beats_scratch(learnable_data, tmp_path):
    from datamodules.builtin.tree import CLASSES

    a = _subset(learnable_data, tmp_path / "a", list(CLASSES[:6]))  # pretrain: 6 classes
    b = _subset(learnable_data, tmp_path / "b", list(CLASSES[6:]))  # target: the 4 others
    _, _, trainer = _fit(a, 4, tmp_path)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    scratch, _, _ = _fit(b, 2, tmp_path)
    tuned, model, _ = _fit(b, 2, tmp_path, weights=str(ckpt), freeze_backbone_epochs=1, backbone_lr_scale=0.3)
    assert model.class_names == list(CLASSES[6:])
    print(f"val/acc1 on 4 new classes after 2 epochs: from scratch {scratch:.3f}, fine-tuned {tuned:.3f}")
    assert tuned > scratch + 0.05, (scratch, tuned)


class _WatchTheBackbone(pl.Callback):
    """The backbone after each epoch, and its first step once unfrozen (what SGD got and what it did)."""

    def __init__(self, unfrozen_at: int, param: str) -> None:
        self.unfrozen_at, self.param = unfrozen_at, param
        self.after_epoch: dict[int, dict[str, torch.Tensor]] = {}
        self.step: dict | None = None

    def _param(self, pl_module) -> torch.nn.Parameter:
        return dict(pl_module.backbone.named_parameters())[self.param]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        p = self._param(pl_module)
        if trainer.current_epoch == self.unfrozen_at and self.step is None and p.grad is not None:
            group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
            self.step = {"before": p.detach().clone(), "grad": p.grad.clone(), "lr": group["lr"],
                         "head_lr": optimizer.param_groups[0]["lr"], "group": group}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.step is not None and "after" not in self.step:
            self.step["after"] = self._param(pl_module).detach().clone()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.after_epoch[trainer.current_epoch] = {k: v.clone() for k, v in pl_module.backbone.state_dict().items()}


def test_frozen_backbone_then_lower_backbone_lr(tiny_data, tmp_path):
    from datamodules import ImageFolderDataModule

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=40, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=10, image_size=32, global_batch_size=40,
                            arch_kwargs={"width": 4},
                            freeze_backbone_epochs=1, backbone_lr_scale=0.1, pictures=[], warmup_epochs=0)
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    watch = _WatchTheBackbone(unfrozen_at=1, param="features.0.weight")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[watch],
                         enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2,
                         limit_val_batches=0)
    trainer.fit(model, dm)
    frozen, unfrozen = watch.after_epoch[0], watch.after_epoch[1]
    assert torch.equal(frozen["features.0.weight"], before["features.0.weight"])  # frozen conv
    assert torch.equal(frozen["features.1.running_mean"], before["features.1.running_mean"])  # frozen BN statistics
    assert not torch.equal(frozen["fc.weight"], before["fc.weight"])  # the head trained
    assert not torch.equal(unfrozen["features.0.weight"], frozen["features.0.weight"]), "not unfrozen at epoch 1"
    assert not torch.equal(unfrozen["features.1.running_mean"], frozen["features.1.running_mean"])
    # its first step went at a tenth of the head's rate: SGD's first step with momentum is lr * d,
    # d = grad + weight_decay * w (times 1 + momentum with Nesterov), torch/optim/sgd.py
    step = watch.step
    assert step is not None, "the backbone got no gradient after the unfreeze"
    assert step["lr"] == pytest.approx(0.1 * step["head_lr"]) and step["head_lr"] > 0
    group = step["group"]
    d = step["grad"] + group["weight_decay"] * step["before"]
    if group["nesterov"]:
        d = d * (1 + group["momentum"])
    torch.testing.assert_close(step["after"], step["before"] - 0.1 * step["head_lr"] * d)
    groups = trainer.optimizers[0].param_groups
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in model.parameters()}


def documented_fine_tune() -> list[str]:
    text = (REPO / "docs" / "after-training.md").read_text()
    block = text[text.index("## Fine-tune"):].split("```bash\n", 1)[1].split("```", 1)[0]
    command = " ".join(line for line in block.replace("\\\n", " ").splitlines() if not line.startswith("#"))
    return shlex.split(command)


@pytest.mark.slow
def test_the_documented_fine_tune_command_runs(imagenet_weights_in_cache, tiny_data, tmp_path):
    args = documented_fine_tune()
    assert args[:3] == ["python", "main.py", "fit"]
    args = [str(tiny_data) if a == "/data/my_classes" else a for a in args[2:]]
    # the documented flags, then what keeps the test small (one CPU step, no validation, fp32: bf16 is slow on CPUs)
    proc = run_main([*args, "--trainer.devices", "1", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
                     "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "0",
                     "--trainer.precision", "32-true",
                     "--data.batch_size", "2", "--data.num_workers", "0", "--model.pictures", "[]",
                     "--trainer.default_root_dir", str(tmp_path / "logs")], env={"TORCH_HOME": str(tmp_path / "torch")})
    report = next(line for line in proc.stdout.splitlines() if line.startswith("model.weights"))
    assert "(torchvision weights): loaded 318 tensors, new 0, ignored 0; head fc replaced (1000 classes there, " \
           "10 here)" in report, report
