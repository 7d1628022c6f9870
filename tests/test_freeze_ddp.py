"""--model.freeze_backbone_epochs under DDP: every rank trains the same network (lightning_app/callbacks/freeze.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_app.weights import head_name
from tests.helpers.cli import quick_args, run_main


class ParameterSnapshots(pl.Callback):
    """Saves every parameter of the model, per rank, when training starts and after each train epoch.

    Added to a real run with --trainer.callbacks+=tests.test_freeze_ddp.ParameterSnapshots."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        params = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        head = f"backbone.{head_name(pl_module.backbone)}."
        torch.save({"params": params, "head": head}, self.out_dir / f"rank{trainer.global_rank}_{when}.pt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, "start")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module, f"epoch{trainer.current_epoch}")


def _fit(data: Path, root: Path, epochs: int, out: Path, *extra: str) -> None:
    """2 gloo processes (configs/ddp.yaml) fine-tune with the first epoch frozen, saving parameters into `out`."""
    run_main(["fit", "--config", "configs/ddp.yaml", *quick_args(data, root, epochs=epochs, batch=40),
              "--trainer.devices", "2", "--trainer.limit_val_batches", "0", "--model.pictures", "[]",
              "--model.freeze_backbone_epochs", "1", "--trainer.callbacks+=tests.test_freeze_ddp.ParameterSnapshots",
              f"--trainer.callbacks.out_dir={out}", *extra], env={"OMP_NUM_THREADS": "1"})


def _snapshot(out: Path, rank: int, when: str) -> tuple[dict[str, torch.Tensor], str]:
    saved = torch.load(out / f"rank{rank}_{when}.pt", weights_only=True)
    return saved["params"], saved["head"]


@pytest.mark.slow
def test_two_processes_fine_tune_one_network_with_a_frozen_first_epoch(tiny_data, tmp_path):
    out = tmp_path / "params"
    _fit(tiny_data, tmp_path, 3, out)
    final = [_snapshot(out, rank, "epoch2")[0] for rank in (0, 1)]
    differ = [name for name, p in final[0].items() if not torch.equal(p, final[1][name])]
    assert not differ, f"the ranks hold different parameters after 3 epochs: {differ}"

    start, head = _snapshot(out, 0, "start")
    frozen, unfrozen = _snapshot(out, 0, "epoch0")[0], final[0]
    body = [name for name in start if not name.startswith(head)]
    assert body and len(body) < len(start)
    moved = [name for name in body if not torch.equal(frozen[name], start[name])]
    assert not moved, f"the frozen epoch changed the backbone: {moved}"
    assert all(not torch.equal(frozen[name], start[name]) for name in start if name.startswith(head)), "head idle"
    assert all(not torch.equal(unfrozen[name], frozen[name]) for name in body), "the backbone never trained"


@pytest.mark.slow
def test_a_run_resumed_after_the_frozen_epoch_unfreezes_on_both_processes(tiny_data, tmp_path):
    _fit(tiny_data, tmp_path, 1, tmp_path / "first")
    _fit(tiny_data, tmp_path, 2, tmp_path / "resumed", "--ckpt_path", str(tmp_path / "version_0/checkpoints/last.ckpt"))
    saved, head = _snapshot(tmp_path / "first", 0, "epoch0")
    final = [_snapshot(tmp_path / "resumed", rank, "epoch1")[0] for rank in (0, 1)]
    differ = [name for name, p in final[0].items() if not torch.equal(p, final[1][name])]
    assert not differ, f"the ranks hold different parameters after the resumed epoch: {differ}"
    body = [name for name in saved if not name.startswith(head)]
    assert all(not torch.equal(final[0][name], saved[name]) for name in body), "not unfrozen after the resume"


class BackwardThroughTheBody(pl.Callback):
    """Counts, per epoch, the gradients autograd computes for the backbone's body (hooks on its parameters)."""

    def __init__(self) -> None:
        self.per_epoch: dict[int, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = head_name(pl_module.backbone)
        for name, p in pl_module.backbone.named_parameters():
            if not name.startswith(head + "."):
                p.register_hook(lambda grad, t=trainer: self._count(t) or grad)

    def _count(self, trainer: pl.Trainer) -> None:
        self.per_epoch[trainer.current_epoch] = self.per_epoch.get(trainer.current_epoch, 0) + 1


def test_one_process_does_no_backward_through_the_frozen_body(tiny_data, tmp_path):
    from lightning_app.cli import ClassifierCLI

    cli = ClassifierCLI(args=[*quick_args(tiny_data, tmp_path, epochs=2, batch=40), "--model.pictures", "[]",
                              "--model.freeze_backbone_epochs", "1", "--trainer.limit_train_batches", "2",
                              "--trainer.limit_val_batches", "0"], run=False)
    counter = BackwardThroughTheBody()
    cli.trainer.callbacks.append(counter)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert counter.per_epoch.get(0, 0) == 0  # frozen: the backward pass ends at the head
    assert counter.per_epoch.get(1, 0) > 0
