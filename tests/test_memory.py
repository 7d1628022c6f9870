"""Memory per rank: every shipped recipe at 8 ranks stays within its budget (python -m bench memory, the
DataModules' own sizing), and a real loader worker frees the ring buffers of an old train size."""
from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import pytorch_lightning as pl

from bench.memory import to_markdown
from bench.memory.plan import parse_config, plan_of
from datamodules import ImageFolderDataModule
from datamodules.budget.memory import GIB
from datamodules.budget.sizing import Layout
from datamodules.sample.batches import ring_buffer_bytes
from lightning_app.callbacks.progressive_resizing import ProgressiveResizing
from lightning_app.module import ImageClassifier
from tests.helpers import REPO

RECIPES = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", [*RECIPES, "configs/imagenet.yaml"])
def test_every_recipe_at_8_ranks_fits_2_gib_pinned_and_4_gib_shared_per_rank(recipe):
    config = parse_config([recipe, "configs/ddp_amp.yaml"], [])
    for cpus in (4, 8, 16, 32, 64, 128):  # per rank: a small node to a 1024-thread one
        _, plan = plan_of(config, Layout(world=8, ranks_per_node=8, cpus=cpus, cuda=True))
        assert plan.pinned <= 2 * GIB and plan.shm <= 4 * GIB and plan.host <= 8 * GIB, (cpus, plan.describe())
        assert all(p.workers >= 1 and p.prefetch >= 1 for p in plan.loaders), plan.describe()
        assert {p.split for p in plan.loaders} == {"train", "val"}
    if "ffcv" in recipe:  # the largest train size of the ramp is the one budgeted
        assert plan.loader("train").size == 192 and plan.loader("val").size == 256


def test_bench_memory_table_gives_each_rank_and_node():
    result = {"layout": vars(Layout(8, 8, 16, True)), "nodes": 1, "rows": []}
    config = parse_config(["configs/recipes/ffcv_resnet50_16ep.yaml"], ["--", "--data.batch_size", "2048"])
    _, plan = plan_of(config, Layout(8, 8, 16, True))
    result["rows"].append({"configs": ["ffcv_resnet50_16ep.yaml"], "datamodule": "ImageFolderDataModule",
                           "loaders": [p.describe() for p in plan.loaders], "pinned": plan.pinned, "shm": plan.shm,
                           "host": plan.host, "budget": vars(plan.budget), "over_budget": plan.over_budget()})
    assert plan.loader("train").batch == 256  # the flags after `--` are applied: 2048 / 8 ranks
    row = to_markdown(result).splitlines()[-3]
    assert f"{plan.pinned / GIB:.2f} / 2" in row and f"{plan.pinned * 8 / GIB:.1f}" in row


# -- old ring buffers after a size change ---------------------------------------------------

def _shared_mappings(pid: int) -> list[int]:
    """Sizes of the torch shared-memory segments process `pid` has mapped (/dev/shm/torch_*, unlinked)."""
    sizes = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "torch_" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(end - start)
    return sizes


class RingProbe(pl.Callback):
    """At each train epoch's end: the ring buffers the loader workers hold, by train size."""

    def __init__(self, batch: int, sizes: list[int]) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        self.ring = {s: -(-ring_buffer_bytes(batch, s) // page) * page for s in sizes}
        assert len(set(self.ring.values())) == len(sizes)  # each size's buffers are told apart by their length
        self.seen: list[tuple[int, dict[int, int]]] = []
        self.inherited: collections.Counter = collections.Counter()

    def setup(self, trainer, pl_module, stage: str) -> None:
        # a forked worker inherits every shared mapping this process holds (another test's batches among them)
        self.inherited = collections.Counter(_shared_mappings(os.getpid()))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # this fit's train workers only: another test's idle workers (children of this process too) hold their own
        workers = getattr(getattr(trainer.train_dataloader, "_iterator", None), "_workers", [])
        assert workers, "the train loader's persistent workers were not found"
        mapped = [n for worker in workers
                  for n in (collections.Counter(_shared_mappings(worker.pid)) - self.inherited).elements()]
        self.seen.append((trainer.datamodule.train_size, {s: mapped.count(n) for s, n in self.ring.items()}))


@pytest.mark.slow
def test_old_ring_buffers_are_freed_after_each_size_change(tiny_data, tmp_path):
    schedule = ProgressiveResizing(start_size=16, end_size=32, start_epoch=0, end_epoch=2, step=8)  # 16, 24, 32
    probe = RingProbe(batch=16, sizes=[16, 24, 32])
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=1, image_size=32,
                               val_image_size=20, persistent_workers=True)
    model = ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=16, arch_kwargs={"width": 4},
                            pictures=[])
    trainer = pl.Trainer(max_epochs=4, limit_train_batches=6, limit_val_batches=0, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[schedule, probe])
    trainer.fit(model, dm)
    assert dm.scheduled_train_sizes == [16, 24, 32]
    assert [size for size, _ in probe.seen] == [16, 24, 32, 32]
    slots = dm.memory_plan(fit=True).loader("train").ring_slots
    for size, held in probe.seen:
        assert 1 <= held[size] <= slots, probe.seen  # this size's ring, within its slots
        assert all(n == 0 for s, n in held.items() if s != size), probe.seen  # no buffer of another size is left
