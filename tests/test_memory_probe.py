"""Before the first step of a fit, a probe estimates one step's memory (lightning_app/callbacks/memory_probe.py)."""
from __future__ import annotations

import math
import re
import shlex

import pytorch_lightning as pl
import torch

from lightning_app.callbacks.memory_probe import StepEstimate, fitting_batch, host_memory_available, probe, verdict
from lightning_app.cli import ClassifierCLI
from lightning_app.module import ImageClassifier
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main


def test_verdict_stops_only_when_clearly_over_and_the_suggested_batch_fits():
    assert verdict(need=31e9, free=20e9) == "stop"
    assert verdict(need=25e9, free=20e9) == "warn"  # unsure: warned, never blocked
    assert verdict(need=10e9, free=20e9) == "ok"
    estimate = StepEstimate(per_image=50e6, fixed=0.3e9, batch=1024)
    fits = fitting_batch(estimate, free=20e9, copies=1)
    assert fits % 8 == 0 and verdict(estimate.bytes_for(fits), 20e9) == "ok"
    assert fitting_batch(estimate, free=20e9, copies=4) == 4 * fits  # global: every process holds its share


def test_probe_leaves_the_model_and_the_random_state_as_it_found_them():
    model = ImageClassifier(arch="conv11", num_classes=10, image_size=32, arch_kwargs={"width": 8}, pictures=[])
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)  # the probe runs under autocast
    buffers = {k: b.clone() for k, b in model.backbone.named_buffers()}
    rng = torch.get_rng_state()
    model.eval()
    small = probe(model, trainer, size=16, batch=256)
    large = probe(model, trainer, size=32, batch=256)
    assert not model.backbone.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, buffers[k]) for k, b in model.backbone.named_buffers())  # BatchNorm stats kept
    assert 3.6 < large.per_image / small.per_image < 4.4  # activations grow with the pixels
    assert small.total == small.fixed + 256 * small.per_image


def test_a_step_clearly_too_large_stops_before_it_starts_with_a_batch_that_fits(tiny_data, tmp_path):
    # an image size whose step needs about 4x the free memory: 240 images (the whole tiny train split)
    free = host_memory_available()
    model = ImageClassifier(arch="conv11", num_classes=10, image_size=64, arch_kwargs={"width": 8}, pictures=[])
    at_64 = probe(model, pl.Trainer(accelerator="cpu", logger=False), size=64, batch=240).per_image
    size = 8 * math.ceil(64 * math.sqrt(4 * free / 240 / at_64) / 8)
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, batch=240), "--data.image_size", str(size),
                     "--trainer.log_every_n_steps", "1"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--data.batch_size 240 needs about" in err and f"conv11 at {size} px" in err
    fits = int(re.search(r"--data\.batch_size (\d+) fits", err).group(1))
    assert 1 <= fits < 240 / 4
    assert not list(tmp_path.glob("version_*"))  # nothing was written


def documented_smoke_test() -> list[str]:
    text = (REPO / "docs" / "training.md").read_text()
    block = text[text.index("A smoke test of a recipe on a CPU"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_the_documented_recipe_smoke_test_fits_a_24_gb_machine(tiny_data):
    command = documented_smoke_test()
    assert command[:3] == ["python", "main.py", "fit"]
    # the documented settings, on the tiny data instead of generating the medium preset (same model and sizes)
    cli = ClassifierCLI(args=[*command[3:], "--data.data_dir", str(tiny_data)], run=False)
    size, batch = cli.datamodule.train_size, cli.datamodule.batch_size
    assert cli.model.hparams.arch == "resnet50" and size == 176
    estimate = probe(cli.model, cli.trainer, size=size, batch=batch)
    assert estimate.total < 0.4 * 24e9, estimate  # the recipe's own batch of 1024 needs about 55 GB
