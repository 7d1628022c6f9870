"""EMA with a delayed start: until the average starts, validation, checkpoints and the end of training use
the live weights (those of --model.weights), never the copy made at setup (the random initialisation)."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn
from torch.utils._python_dispatch import TorchDispatchMode

from datamodules import ImageFolderDataModule
from lightning_app.callbacks.ema import DelayedStartEMA
from lightning_app.module import ImageClassifier

KEY = "backbone.features.0.weight"


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.live: dict[str, torch.Tensor] = {}
        self.validated: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.live = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_validation_epoch_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _model(weights=None) -> ImageClassifier:
    return ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=16, arch_kwargs={"width": 4},
                           lr=1e-4, warmup_epochs=0, weights=weights, pictures=[])


@pytest.mark.slow
def test_ema_before_its_start_validates_and_saves_the_weights_being_trained(tiny_data, tmp_path):
    torch.manual_seed(1)
    start = _model().backbone.state_dict()  # the starting weights: not what a fresh model draws
    torch.save(start, tmp_path / "start.pt")
    torch.manual_seed(0)
    model = _model(weights=str(tmp_path / "start.pt"))
    random_init = model.state_dict()[KEY].clone()
    ema, probe = DelayedStartEMA(decay=0.5, update_starting_at_step=1000), Probe()
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[ema, probe])
    trainer.fit(model, dm)

    assert not ema.started()
    assert torch.equal(ema._average_model.module.state_dict()[KEY], random_init)  # the copy made at setup
    torch.testing.assert_close(probe.validated[KEY], start[KEY.removeprefix("backbone.")], atol=1e-3, rtol=0)
    for k, v in probe.live.items():  # validation saw the live weights
        assert torch.equal(probe.validated[k], v), k
    assert torch.equal(model.state_dict()[KEY], probe.live[KEY])  # the end of training kept them
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert torch.equal(ckpt["state_dict"][KEY], probe.live[KEY])  # what validate/predict/export will load
    assert int(ckpt["averaging_state"]["n_averaged"]) == 0  # a resume starts the average as this run would


@pytest.mark.slow
def test_ema_once_started_averages_from_the_weights_being_trained(tiny_data, tmp_path):
    torch.manual_seed(0)
    model = _model()
    updates: list[torch.Tensor] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= 1:  # update_starting_at_step=1: updated after the second step and on
                updates.append(pl_module.state_dict()[KEY].detach().clone())

    ema, probe = DelayedStartEMA(decay=0.5, update_starting_at_step=1), Probe()
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[Record(), ema, probe])
    trainer.fit(model, dm)
    assert ema.started() and len(updates) == 2
    expected = 0.5 * updates[0] + 0.5 * updates[1]  # the first update copied the live weights
    torch.testing.assert_close(probe.validated[KEY], expected)
    assert not torch.equal(probe.validated[KEY], probe.live[KEY])


# -- the update: Lightning's results, no host sync -------------------------------------------------------------

DECAY = 0.9
SYNCING = {"aten::_local_scalar_dense", "aten::lift_fresh", "aten::nonzero"}  # .item()/bool(), tensor(x), masks


class CountSyncs(TorchDispatchMode):
    """Counts the aten ops that wait for the device on a GPU (tests/test_syncs.py says which), on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in SYNCING
        return func(*args, **(kwargs or {}))


def _train_step(model: ImageClassifier, optimizer: torch.optim.Optimizer) -> None:
    """A real step of the backbone: BatchNorm's running statistics and num_batches_tracked move too."""
    loss = model(torch.randn(8, 3, 32, 32)).logsumexp(1).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("use_buffers", [True, False])
def test_ema_update_equals_lightnings_averaged_model_and_reads_nothing_from_the_device(use_buffers):
    """The reference is what Lightning's EMAWeightAveraging runs: torch's AveragedModel with get_ema_avg_fn,
    decay * ema + (1 - decay) * live per tensor, BatchNorm statistics averaged (use_buffers) or copied."""
    torch.manual_seed(0)
    model = _model()
    ema = DelayedStartEMA(decay=DECAY, use_buffers=use_buffers)
    ema.setup(None, model, "fit")
    reference = AveragedModel(model, use_buffers=use_buffers, avg_fn=get_ema_avg_fn(DECAY))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ours, theirs = CountSyncs(), CountSyncs()
    for _ in range(6):
        _train_step(model, optimizer)
        with ours:
            ema.update(model)
        with theirs:
            reference.update_parameters(model)
    assert ours.count == 0  # the count is on the host: nothing read from the device
    assert theirs.count == 2 * 6  # AveragedModel: bool(n_averaged == 0) and n_averaged > 0, each update
    assert ema.updates == 6 and int(ema._average_model.n_averaged) == 6
    got, want = ema._average_model.module.state_dict(), reference.module.state_dict()
    assert got.keys() == want.keys() and any("num_batches_tracked" in k for k in got)
    assert not torch.allclose(got[KEY], model.state_dict()[KEY])  # an average, not a copy of the live weights
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)
        else:
            assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_a_checkpoint_of_lightnings_update_resumes_with_its_count(tiny_data, tmp_path):
    """A checkpoint written by the AveragedModel update (Lightning's EMAWeightAveraging, as this callback was) holds
    n_averaged in averaging_state: resumed, the count is read back, and the next update averages (not copies)."""
    from pytorch_lightning.callbacks import EMAWeightAveraging

    def fit(ema, steps: int, record=None, ckpt: str | None = None) -> pl.Trainer:
        torch.manual_seed(0)
        dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
        trainer = pl.Trainer(max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, accelerator="cpu",
                             logger=False, enable_progress_bar=False, enable_checkpointing=False,
                             default_root_dir=tmp_path, callbacks=[c for c in (record, ema) if c])
        trainer.fit(_model(), dm, ckpt_path=ckpt)
        return trainer

    fit(EMAWeightAveraging(decay=0.5), 2).save_checkpoint(tmp_path / "old.ckpt")
    saved = torch.load(tmp_path / "old.ckpt", map_location="cpu", weights_only=True)
    assert int(saved["averaging_state"]["n_averaged"]) == 2
    live: dict[str, torch.Tensor] = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            live.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    ema = DelayedStartEMA(decay=0.5)
    fit(ema, 3, Record(), str(tmp_path / "old.ckpt"))
    assert ema.updates == 3
    expected = 0.5 * saved["state_dict"][KEY] + 0.5 * live[KEY]
    torch.testing.assert_close(ema._average_model.module.state_dict()[KEY], expected, rtol=1e-6, atol=1e-7)
