"""Host-device syncs per training step, counted on the real training step (CPU).

On a GPU, the host waits for the device whenever it reads a device value (`.item()`, `float()`,
`bool()`: aten `_local_scalar_dense`), runs an op whose output size depends on the data (`torch.unique`,
`nonzero`, `bincount`, boolean masks) or turns a Python number into a device tensor (`torch.tensor(x,
device=...)`: aten `lift_fresh`, then a blocking copy). A `TorchDispatchMode` sees every aten op the
training process runs, so counting those ops per step counts the syncs the step would make on a GPU.
What the loader does to hand over the next batch is left out: its tensors are host memory (the ring
buffer's header, a numpy view of it) and reach the device in Lightning's one copy per batch, which does
not sync from pinned memory. The step runs under the CLI's real trainer, callbacks (throughput, epoch line, pictures,
checkpoints, SIGTERM) and logger; the data come from a real loader worker (another process).
"""
from __future__ import annotations

import collections
import os
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_app.cli import ClassifierCLI
from tests.helpers.cli import quick_args
from tests.helpers.processes import free_port, in_processes

SYNCING = {"aten::_local_scalar_dense", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
           "aten::nonzero", "aten::bincount", "aten::masked_select", "aten::lift_fresh",
           "aten::repeat_interleave"}


LOADER_FILES = ("torch/utils/data/", "datamodules/sample/batches.py")


def _in_loader() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in LOADER_FILES):
            return True
        frame = frame.f_back
    return False


def _syncs(func, args) -> bool:
    name = func._schema.name
    if name == "aten::index":  # a boolean mask as index: its output size needs the mask's count
        indices = args[1] if len(args) > 1 else []
        syncing = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)
    else:
        syncing = name in SYNCING
    return syncing and not _in_loader()


class CountSyncs(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, step: int) -> None:
        super().__init__()
        self.counts, self.step = counts, step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _syncs(func, args):
            self.counts[self.step] += 1
        return func(*args, **(kwargs or {}))


class StepSyncs(pl.Callback):
    """Counts the syncing ops of step k from its on_train_batch_start to the next step's: the step, its
    callbacks, Lightning's logging after it, and taking the next batch from the loader."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.logged: list[int] = []
        self._mode: CountSyncs | None = None

    def _stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._stop()
        if trainer._logger_connector.should_update_logs:
            self.logged.append(batch_idx)
        self._mode = CountSyncs(self.counts, batch_idx)
        self._mode.__enter__()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._stop()


CUDA_16_MIXED = ["--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.precision", "16-mixed"]
# updated after every step (torch's AveragedModel.update_parameters read its count from the device twice an update)
EMA = ["--trainer.callbacks+=lightning_app.callbacks.ema.DelayedStartEMA", "--trainer.callbacks.decay", "0.9"]


def _count(args: list[str]) -> tuple[dict[int, int], list[int]]:
    """(syncing ops per training step, the steps that log) of a fit with the CLI's real trainer."""
    cli = ClassifierCLI(args=args[1:], run=False)
    counter = StepSyncs()
    cli.trainer.callbacks.append(counter)
    cli.trainer.fit(cli.model, cli.datamodule)
    return dict(counter.counts), counter.logged


def _args(data, root, steps: int, *extra: str) -> list[str]:
    return ["fit", *quick_args(data, root, batch=16, width=4), "--data.num_workers", "1",
            "--data.image_size", "32", "--trainer.limit_train_batches", str(steps), "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "3",
            "--trainer.enable_progress_bar", "true", *extra]


def _assert_quiet(counts: dict[int, int], logged: list[int], steps: int) -> None:
    assert logged == [2, 5]  # log_every_n_steps 3: global steps 3 and 6
    # step 0 does the fit's one-time work (it draws the augmented training batch); the last one ends the epoch
    quiet = [k for k in range(1, steps - 1) if k not in logged]
    assert {k: counts.get(k, 0) for k in quiet} == dict.fromkeys(quiet, 0)
    assert all(counts.get(k, 0) > 0 for k in logged)  # the counter sees the syncs logging makes


@pytest.mark.slow
@pytest.mark.parametrize("device", [
    [],
    ["--data.decode", "gpu"],
    pytest.param(CUDA_16_MIXED, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                 reason="needs CUDA: 16-mixed's GradScaler (fused SGD skips its found_inf .item())")]),
    pytest.param([*CUDA_16_MIXED, "--data.decode", "gpu"], marks=[pytest.mark.gpu, pytest.mark.skipif(
                 not torch.cuda.is_available(), reason="needs CUDA: nvJPEG and 16-mixed's GradScaler")]),
    EMA,
    pytest.param([*CUDA_16_MIXED, *EMA], marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                 reason="needs CUDA: the EMA update's count read from a CUDA buffer is what syncs there")]),
], ids=["cpu", "cpu-decode-gpu", "cuda-16-mixed", "cuda-16-mixed-decode-gpu", "cpu-ema", "cuda-16-mixed-ema"])
def test_no_host_sync_on_steps_that_do_not_log(tiny_data, tmp_path, device):
    steps = 8
    _assert_quiet(*_count(_args(tiny_data, tmp_path, steps, *device)), steps)


def _one_of_two(rank: int, port: int, args: list[str]) -> tuple[dict[int, int], list[int]]:
    # what Lightning's launcher gives a process it starts (LightningEnvironment: LOCAL_RANK set = launched outside)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    return _count(args)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--checkpoint.train_time_interval", "0:00:00.001"]],
                         ids=["ddp", "ddp-time-saves"])
def test_no_host_sync_on_steps_that_do_not_log_with_two_ddp_processes(tiny_data, tmp_path, extra):
    # what a multi-GPU step adds: the stop-signal agreement (callbacks/stop_signals.py) and the decision of a
    # time-interval save (ResumableCheckpoint) only on logging steps; no per-batch broadcast of either
    # (Lightning's: loops/training_epoch_loop.py, callbacks/model_checkpoint.py)
    steps = 8
    args = _args(tiny_data, tmp_path, steps, "--trainer.strategy", "ddp", "--trainer.devices", "2", *extra)
    for counts, logged in in_processes(_one_of_two, 2, free_port(), args, timeout=300):
        _assert_quiet(counts, logged, steps)
