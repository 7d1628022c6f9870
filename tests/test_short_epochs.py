"""A small tree's short epochs: BatchNorm's running statistics keep up with the weights (lightning_app/callbacks/
norm_window.py), so the quickstart's command trains ResNet-18 on a few hundred images (issue 54 item 4)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_app.callbacks.norm_window import FORGOTTEN, fit_to_epoch
from tests.helpers.cli import run_main
from tests.helpers.event_files import scalars
from tests.helpers.trees import make_photo_like_tree


def test_after_one_short_epoch_the_initial_statistics_are_forgotten():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    x = torch.randn(8, 4, 6, 6) * 5 + 20  # the same batch 5 times: the statistics of each are the same
    assert fit_to_epoch(nn.Sequential(bn), 5) == pytest.approx(1 - FORGOTTEN ** (1 / 5))
    with torch.no_grad():
        for _ in range(5):
            bn(x)
    var = x.var(dim=(0, 2, 3))  # unbiased, as BatchNorm keeps it
    # what is left of the initial mean 0 and variance 1: at most FORGOTTEN (it was 0.9^5 = 59% at momentum 0.1)
    assert torch.allclose(bn.running_mean, x.mean(dim=(0, 2, 3)), rtol=1.5 * FORGOTTEN)
    assert torch.allclose(bn.running_var, var, rtol=1.5 * FORGOTTEN)


def test_a_long_epoch_keeps_the_layers_own_momentum():
    net = nn.Sequential(nn.BatchNorm2d(4, momentum=0.05), nn.BatchNorm2d(4, momentum=None))
    assert fit_to_epoch(net, 5000) is None
    assert (net[0].momentum, net[1].momentum) == (0.05, None)
    assert fit_to_epoch(net, 5) is not None and fit_to_epoch(net, 5000) is None and net[0].momentum == 0.05


@pytest.mark.slow
def test_resnet18_from_the_quickstarts_command_learns_a_few_hundred_images(tmp_path):
    """10 classes of 32 training images at batch 64: 5 steps an epoch, 3 epochs. Before, the weights learnt (66% on
    the validation images with batch statistics) but the validation ran on running statistics still 21% the initial
    0 and 1 and the rest from older weights: val/acc1 0.24, 0.17, 0.24 (val/loss 5.3)."""
    tree = make_photo_like_tree(tmp_path / "photos")
    run = run_main(["fit", "--config", "configs/ddp_amp.yaml", "--model.arch", "resnet18",
                    "--data.data_dir", str(tree), "--data.batch_size", "64", "--data.num_workers", "0",
                    "--trainer.max_epochs", "3", "--trainer.default_root_dir", str(tmp_path / "runs"),
                    "--trainer.enable_progress_bar", "false", "--model.pictures", "[]",
                    "--trainer.log_every_n_steps", "1"], env={"OMP_NUM_THREADS": "2"}, timeout=900)
    losses = [v for _, v in scalars(tmp_path / "runs" / "version_0", "train/loss")]
    assert len(losses) == 15 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses
    accuracy = [v for _, v in scalars(tmp_path / "runs" / "version_0", "val/acc1")]
    # chance is 10%, one standard deviation of it on 300 images 1.7 points: 35% is 15 of them above
    assert len(accuracy) == 3 and accuracy[-1] > 0.35, accuracy
    out = run.stdout + run.stderr
    assert "BatchNorm: momentum 0.60 for the running statistics, so that an epoch of 5 batches" in out, out[-3000:]
