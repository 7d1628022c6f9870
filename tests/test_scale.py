"""ImageNet's shape on a CPU: 1000 classes, the ImageNet config with its pictures on, 2 gloo ranks started
as srun starts them (SLURM's variables, each task's CPU mask set by taskset), a 60 s collective timeout.

The run must finish its validation epochs with every picture in the TensorBoard event files (rank 0 draws
a 1000 x 1000 confusion matrix while rank 1 goes on: a slow drawing would trip the 60 s timeout), and each
rank's loader must use its whole per-task CPU set.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.budget.cpus import cpu_share, usable_cpus
from tests.helpers.processes import finish_all, free_port, start_command

CLASSES = 1000
RANKS = 2


@pytest.fixture(scope="module")
def thousand_classes(tmp_path_factory) -> Path:
    """2 train and 1 val image per class, 24 x 20 px noise JPEGs."""
    root = tmp_path_factory.mktemp("imagenet-shape")
    rng = np.random.default_rng(0)
    for split, n in (("train", 2), ("val", 1)):
        for c in range(CLASSES):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.jpg")
    return root


def task_cpus(rank: int) -> list[int]:
    """The CPUs srun would bind task `rank` to: 2 of its own where there are enough, else the 2 there are."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[2 * rank:2 * rank + 2] if len(cpus) >= 2 * RANKS else cpus[:2]


def srun_env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")}
    env.update(SLURM_NTASKS=str(RANKS), SLURM_NTASKS_PER_NODE=str(RANKS), SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242",
               SLURM_STEP_ID="0", SLURM_JOB_NAME="rehearsal", SLURM_CPUS_PER_TASK=str(len(task_cpus(rank))),
               SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def rehearsal(thousand_classes, tmp_path_factory):
    """One 2-epoch fit of configs/imagenet.yaml on the 1000-class tree: (run folder, probe folder, outputs)."""
    out = tmp_path_factory.mktemp("rehearsal")
    args = ["fit", "--config", "configs/imagenet.yaml", "--config", "configs/ddp.yaml",
            "--data.data_dir", str(thousand_classes), "--data.batch_size", "32", "--data.image_size", "64",
            "--data.val_image_size", "32", "--trainer.accelerator", "cpu", "--trainer.devices", str(RANKS),
            "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2", "--trainer.precision", "32-true",
            "--trainer.strategy.init_args.timeout_s", "60", "--trainer.default_root_dir", str(out / "logs"),
            "--trainer.log_every_n_steps", "1", "--trainer.callbacks+=tests.helpers.callbacks.LoaderProbe",
            "--trainer.callbacks.init_args.out_dir", str(out / "probe")]
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed: it sets each task's CPU mask as srun would")
    port = free_port()
    procs = [start_command(["taskset", "-c", ",".join(map(str, task_cpus(rank))), sys.executable, "main.py", *args],
                           srun_env(rank, port), log=out / f"rank{rank}.txt") for rank in range(RANKS)]
    codes, _ = finish_all(procs, timeout=400)
    texts = [(out / f"rank{r}.txt").read_text() for r in range(RANKS)]
    assert codes == [0] * RANKS, "\n\n".join(t[-4000:] for t in texts)
    return out / "logs" / "version_0", out / "probe", texts


@pytest.mark.slow
def test_rehearsal_at_1000_classes_logs_every_picture(rehearsal):
    run, _, texts = rehearsal
    assert texts[0].count("epoch ") >= 2 and "Done: " in texts[0]
    events = EventAccumulator(str(run), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = {tag: events.Images(tag) for tag in events.Tags()["images"]}
    assert {tag: len(v) for tag, v in images.items()} == {
        "images/confusion_matrix": 2, "images/mistakes": 2, "images/train_batch": 1}  # each validation, once per fit
    for matrix in images["images/confusion_matrix"]:
        assert matrix.width * matrix.height <= 4_000_000 and matrix.width >= CLASSES  # a square per class pair
    text = [tag for tag in events.Tags()["tensors"] if tag.startswith("images/most_confused")]
    assert text and len(events.Tensors(text[0])) == 2


@pytest.mark.slow
def test_each_srun_rank_uses_its_whole_per_task_cpu_set(rehearsal):
    _, probe, texts = rehearsal
    for rank in range(RANKS):
        seen = json.loads((probe / f"rank{rank}.json").read_text())
        assert seen["mask"] == task_cpus(rank) and seen["world"] == RANKS
        assert seen["per_task"] and seen["cpus"] == len(task_cpus(rank))
        assert seen["workers"] * seen["decode_threads"] >= len(task_cpus(rank))  # every CPU of the set decodes
    assert "its own per-task CPU set (srun, SLURM_CPUS_PER_TASK=" in texts[0] and "Memory per rank:" in texts[0]


def test_cpu_share_tells_a_per_task_mask_from_a_shared_one():
    srun = {"SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_JOB_NAME": "train", "SLURM_CPUS_PER_TASK": "8"}
    assert cpu_share(8, srun, mask=8, node=64).cpus == 8  # task/affinity: the task's own 8 CPUs
    assert cpu_share(8, srun, mask=64, node=64).cpus == 8  # no task binding: the job's 64 CPUs, shared by 8
    assert cpu_share(8, {**srun, "SLURM_JOB_NAME": "bash", "LOCAL_RANK": "3"}, mask=8, node=64).cpus == 1
    assert cpu_share(8, {"LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "x"}, mask=64, node=128).cpus == 8  # torchrun
    assert cpu_share(8, {**srun, "LOCAL_RANK": "3"}, mask=64, node=64).cpus == 8  # torchrun inside one srun task
    no_cpus_per_task = {k: v for k, v in srun.items() if k != "SLURM_CPUS_PER_TASK"}
    assert cpu_share(8, no_cpus_per_task, mask=16, node=64).cpus == 2
    assert cpu_share(1, {}, mask=12, node=64).cpus == 12
    assert "shared by the 8 ranks on this node (torchrun): 8 per rank" in cpu_share(
        8, {"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, mask=64, node=128).describe()
    assert cpu_share(2).mask == usable_cpus()
