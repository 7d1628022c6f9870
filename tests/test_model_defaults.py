"""`--model.arch NAME` alone, on the quickstart's config, trains: each family's recipe (models/recipes.py) where the
config leaves the optimiser, lr and weight decay unset, and conv11's width left behind (issue 42). Before, conv11's
lr 0.4 per 256 made every torchvision and timm model tried diverge (resnet18's train loss 10.98 -> 12.44)."""
from __future__ import annotations

import math

import pytest

from tests.helpers.cli import run_main
from tests.helpers.event_files import scalars

pytest.importorskip("timm")

# (arch, its arch_kwargs, the recipe's words in the start-up line)
ARCHS = [("conv11", [], "SGD, lr 0.4 per 256 images, weight decay 0.0005"),
         ("resnet18", [], "SGD, lr 0.1 per 256 images, weight decay 0.0001"),
         ("timm/resnet10t", [], "SGD, lr 0.1 per 256 images, weight decay 0.0001"),
         ("timm/convnext_atto", [], "ADAMW, lr 0.00025 per 256 images, weight decay 0.05"),
         ("timm/vit_tiny_patch16_224", ["--model.arch_kwargs", "{timm/vit_tiny_patch16_224: {patch_size: 4}}"],
          "ADAMW, lr 0.00025 per 256 images, weight decay 0.05")]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "extra", "said"), ARCHS, ids=[a for a, _, _ in ARCHS])
def test_an_arch_alone_trains_with_its_familys_recipe(learnable_data, tmp_path, arch, extra, said):
    """3 epochs of 1,200 images at 32 px, batch 32, on the default config: the train loss goes down and never
    runs away. (Its accuracy after so little training is near chance for ConvNeXt and the ViT at the recipes'
    small rates: the figures are in the issue's note, not asserted.)"""
    run = run_main(["fit", "--model.arch", arch, *extra, "--data.data_dir", str(learnable_data),
                    "--data.batch_size", "32", "--data.num_workers", "0", "--trainer.max_epochs", "3",
                    "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
                    "--model.pictures", "[]", "--trainer.log_every_n_steps", "5"], env={"OMP_NUM_THREADS": "2"})
    out = run.stdout + run.stderr
    assert f"--model.arch {arch}: {said}" in out, out[-3000:]
    losses = [v for _, v in scalars(tmp_path / "version_0", "train/loss")]
    assert len(losses) >= 6 and all(math.isfinite(v) for v in losses), losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first and max(losses) < 1.5 * losses[0], losses
