"""Before the first step of a fit, a probe estimates one step's memory (lightning_app/callbacks/memory_probe.py)."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_app.callbacks.memory_probe import (
    FREE_ENV,
    StepEstimate,
    fitting_batch,
    host_memory_available,
    probe,
    verdict,
)
from lightning_app.cli import ClassifierCLI
from lightning_app.module import ImageClassifier
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main
from tests.helpers.gloo import gloo_group
from tests.helpers.processes import finish_all, free_port, in_processes, start_main


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



def test_a_progressive_resizing_ramp_is_judged_at_its_largest_size(tiny_data, tmp_path):
    # free memory that one step at the ramp's first size (32 px) fits with room, and its last (64 px, ~4x) does not
    model = ImageClassifier(arch="conv11", num_classes=10, image_size=32, arch_kwargs={"width": 8}, pictures=[])
    at_32 = probe(model, pl.Trainer(accelerator="cpu", logger=False), size=32, batch=240)
    free = int(2 * at_32.total)
    assert verdict(at_32.total, free) == "ok"  # judged at its first size, the run would go on
    config = tmp_path / "ramp.yaml"
    config.write_text(json.dumps({"trainer": {"callbacks+": [
        {"class_path": "lightning_app.callbacks.progressive_resizing.ProgressiveResizing",
         "init_args": {"start_size": 32, "end_size": 64, "start_epoch": 0, "end_epoch": 1}}]}}))
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=2, batch=240), "--data.image_size", "64",
                     "--config", str(config)], env={FREE_ENV: str(free)}, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "conv11 at 64 px (the largest train size of the progressive-resizing schedule 32 -> 64 px)" in err, err
    assert "smaller sizes in the ProgressiveResizing schedule" in err
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


def _two_nodes(data: Path, root: Path, free: tuple[str, str]) -> tuple[list[int], list[str]]:
    """A 2-process fit (two nodes on 127.0.0.1, gloo) whose ranks see `free` bytes free (FIC_MEMORY_PROBE_FREE_BYTES):
    exit statuses and outputs."""
    args = ["fit", *quick_args(data, root, batch=40), "--trainer.strategy", "ddp", "--trainer.devices", "1",
            "--trainer.num_nodes", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]"]
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1", "FIC_DDP_TIMEOUT_S": "60"}
    procs = [start_main(args, {**common, "NODE_RANK": str(rank), FREE_ENV: free[rank]}) for rank in (0, 1)]
    return finish_all(procs, timeout=240)


@pytest.mark.slow
def test_one_rank_short_of_memory_stops_both_with_its_paragraph(tiny_data, tmp_path):
    codes, outs = _two_nodes(tiny_data, tmp_path, free=(str(10**15), "1000"))  # rank 0 ok, rank 1 clearly short
    assert codes == [2, 2], "\n\n".join(out[-3000:] for out in outs)
    said = [line for line in outs[0].splitlines() if "--data.batch_size 40 (20 per process) needs about" in line]
    assert len(said) == 1, outs[0][-3000:]
    assert "free in host memory of rank 1: the step would not fit" in said[0]  # rank 1 measured it, rank 0 says it
    assert not any("Traceback" in out for out in outs)
    assert not list(tmp_path.glob("version_*/checkpoints/*.ckpt"))  # stopped before the first step


@pytest.mark.slow
def test_a_probe_that_fails_on_one_rank_lets_both_continue_and_says_so(tiny_data, tmp_path):
    codes, outs = _two_nodes(tiny_data, tmp_path, free=(str(10**15), "unmeasurable"))
    assert codes == [0, 0], "\n\n".join(out[-3000:] for out in outs)
    said = [line for line in outs[1].splitlines() if line.startswith("Memory probe: no estimate on rank 1 of 2")]
    assert len(said) == 1, outs[1][-3000:]
    assert "counts as no verdict and the run goes on" in said[0]
    assert "Memory probe" not in outs[0]


def _probe_with_sync_batchnorm(rank: int, store: str) -> float:
    with gloo_group(store, rank, 2):
        torch.manual_seed(0)
        model = ImageClassifier(arch="conv11", num_classes=10, image_size=32, arch_kwargs={"width": 8}, pictures=[])
        plain = probe(model, pl.Trainer(accelerator="cpu", logger=False), size=32, batch=8).per_image
        model.backbone = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model.backbone)
        # rank 0 alone: a probe that all-gathered BatchNorm statistics would wait for rank 1 (or, on a CPU, refuse)
        synced = probe(model, pl.Trainer(accelerator="cpu", logger=False), size=32, batch=8).per_image if rank == 0 \
            else plain
        assert all(type(m).forward is torch.nn.SyncBatchNorm.forward and "forward" not in vars(m)
                   for m in model.backbone.modules() if isinstance(m, torch.nn.SyncBatchNorm))
        return synced / plain


def test_the_probe_runs_without_syncbatchnorm_collectives(tmp_path):
    # fresh interpreters (in_processes' default): forked from this process after the probes of the tests above
    # ran in it, the two never finished
    ratios = in_processes(_probe_with_sync_batchnorm, 2, str(tmp_path / "store"), timeout=180)
    assert ratios == [1.0, 1.0]  # the same activations as plain BatchNorm
