"""Callbacks that tests add with --trainer.callbacks+=tests.helpers.callbacks.X to observe a real run or to inject
real faults, and readers of what they write."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytorch_lightning as pl
import torch


class SampleRecorder(pl.Callback):
    """Writes, per rank and epoch, which samples the train loader delivered, batch by batch, and their labels.

    It reads them from the batches themselves: the train dataset's labels carry each sample's index
    (index * classes + label, through the sampler, the workers and the batch), and at each batch start
    the recorder takes the index out and leaves the label, before the step sees it. It also writes the
    epoch the loader's sampler was at, the seed the run set, and a digest of each batch's pixels (as the step
    gets them: cropped, flipped, normalised).
    """

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.batches: list[list[int]] = []
        self.labels: list[list[int]] = []
        self.digests: list[str] = []
        self.sampler_epoch: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:  # after the DataModule's setup
        if stage == "fit":
            dataset = trainer.datamodule.datasets["train"]
            self.classes = trainer.datamodule.num_classes
            dataset.labels = torch.arange(len(dataset.labels)) * self.classes + dataset.labels

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.batches, self.labels, self.digests = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        labels = batch[1]
        self.batches.append(torch.div(labels, self.classes, rounding_mode="floor").tolist())
        labels.remainder_(self.classes)  # in place: the step trains on the labels alone
        self.labels.append(labels.tolist())
        self.digests.append(hashlib.sha1(batch[0].detach().cpu().contiguous().numpy().tobytes()).hexdigest())
        self.sampler_epoch = getattr(trainer.train_dataloader.sampler, "epoch", None)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}_epoch{trainer.current_epoch}.json")
        with open(path, "w") as f:
            json.dump({"batches": self.batches, "labels": self.labels, "digests": self.digests,
                       "indices": [i for batch in self.batches for i in batch], "steps": len(self.batches),
                       "sampler_epoch": self.sampler_epoch, "seed": os.environ.get("PL_GLOBAL_SEED"),
                       "world_size": trainer.world_size, "num_nodes": trainer.num_nodes}, f)


def recorded_samples(out: Path) -> dict[tuple[int, int], dict]:
    """What SampleRecorder wrote to `out`: (rank, epoch) -> record."""
    runs = {}
    for f in out.glob("rank*_epoch*.json"):
        rank, epoch = f.stem.replace("rank", "").split("_epoch")
        runs[int(rank), int(epoch)] = json.loads(f.read_text())
    return runs


class ReplicaBatches(pl.Callback):
    """Records, per training step, what each copy of the backbone ran on: (device, images, autocast dtype).

    A forward pre-hook on the backbone: nn.DataParallel's replicas share their module's hooks (their
    __dict__ is a copy of it, torch/nn/parallel/replicate.py), so it fires in every replica's thread.
    """

    def on_fit_start(self, trainer, pl_module) -> None:
        self.steps: list[list[tuple[str, int, str | None]]] = []

        def replica(module, args) -> None:
            if module.training and self.steps:
                x = args[0]
                amp = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
                self.steps[-1].append((str(x.device), int(x.shape[0]), str(amp) if amp else None))

        self._hook = pl_module.backbone.register_forward_pre_hook(replica)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.steps.append([])

    def on_fit_end(self, trainer, pl_module) -> None:
        self._hook.remove()


class WhatRan(pl.Callback):
    """Writes `out_dir/rank{R}.json`: what the training steps actually ran with, observed, not configured.

    The logits' dtypes (a forward hook on the LightningModule: outside a compiled backbone), the device,
    the graphs torch.compile built in this process, the backbone's memory format, cudnn.benchmark, the
    float32 matmul precision and whether a gradient scaler was in use.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.logits: set[str] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        def logits(module, args, output) -> None:
            # (N, classes) only: under DDP, Lightning also calls the module with forward redirected to
            # training_step (pytorch_lightning/strategies/strategy.py, _ForwardRedirection): the loss
            if module.training and isinstance(output, torch.Tensor) and output.ndim == 2:
                self.logits.add(str(output.dtype))

        self._hook = pl_module.register_forward_hook(logits)

    def on_train_end(self, trainer, pl_module) -> None:
        from torch._dynamo.utils import counters

        self._hook.remove()
        convs = [p for p in pl_module.backbone.parameters() if p.ndim == 4]
        record = {
            "logits": sorted(self.logits), "device": str(pl_module.device), "world_size": trainer.world_size,
            "compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "channels_last": all(p.is_contiguous(memory_format=torch.channels_last) for p in convs),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_precision": torch.get_float32_matmul_precision(),
            "grad_scaler": getattr(trainer.precision_plugin, "scaler", None) is not None,
            "global_step": trainer.global_step,
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


class GradientProbe(pl.Callback):
    """Writes, per rank, what the all-reduced gradients of the first `steps` steps look like: the DDP comm hook
    torch registered, whether every gradient is exactly representable in float16 / bfloat16 (what a 16-bit
    all-reduce leaves), and the largest matrix rank of a weight gradient (what PowerSGD leaves)."""

    def __init__(self, out_dir: str, steps: int = 1000) -> None:
        self.out_dir, self.steps, self.seen = out_dir, steps, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if len(self.seen) >= self.steps:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        matrices = [g.reshape(g.shape[0], -1) for g in grads if g.dim() > 1 and min(g.shape[0], g[0].numel()) > 4]
        self.seen.append({
            "step": trainer.global_step,
            "fp16_exact": all(torch.equal(g, g.half().float()) for g in grads),
            "bf16_exact": all(torch.equal(g, g.bfloat16().float()) for g in grads),
            # rtol: a float32 product P Q^T carries rounding noise far below 1e-4 of its largest singular value
            "max_matrix_rank": max(int(torch.linalg.matrix_rank(m, rtol=1e-4)) for m in matrices) if matrices else 0,
        })

    def on_train_end(self, trainer, pl_module) -> None:
        ddp = trainer.strategy.model
        hook = ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"grads_rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"comm_hook": hook, "steps": self.seen, "world_size": trainer.world_size}, f)


class SizeRecorder(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        images = batch[0]
        self.seen.append((trainer.current_epoch, images.shape[-2], images.shape[-1]))


class RankSizeRecorder(SizeRecorder):
    """SizeRecorder that writes what each rank saw to OUT_DIR/rank<N>.json (for runs in subprocesses)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class LoaderProbe(pl.Callback):
    """Writes, per rank, its CPU mask and what its train loader was built with."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        loader = trainer.train_dataloader
        share = dm.cpu_share()
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"mask": sorted(os.sched_getaffinity(0)), "cpus": share.cpus, "per_task": share.per_task,
                       "describe": share.describe(), "workers": loader.num_workers,
                       "decode_threads": loader.dataset.decode_threads, "world": trainer.world_size}, f)


class ValCounter(pl.Callback):
    """Writes, per rank, how many validation samples it saw in each validation run (rank<r>.json: a list)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.runs, self.seen = out_dir, [], 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.seen += len(batch[1])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self.runs.append(self.seen)
        self.seen = 0
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.runs, f)


class FlushLogs(pl.Callback):
    """Flushes the TensorBoard event file after every training batch: what its 120 s timer does in a long
    epoch, so events logged after the last checkpoint are on disk when the process is killed."""

    changes_training = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        for logger in trainer.loggers:
            logger.save()


# -- real faults ---------------------------------------------------------------------------------

class SignalAt(pl.Callback):
    """Sends a real signal to this process (with `group`, to its whole process group, as `kill -TERM -PGID`,
    `timeout` or a container stop do) when a training batch of `epoch`/`batch` starts.

    batch 0 of an epoch is an epoch boundary: the checkpoint saved at the end of the previous
    epoch is the newest. Only the process with global rank `rank` (all if -1) sends.
    """

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int = 0, sig: str = "SIGKILL", rank: int = -1, group: bool = False) -> None:
        self.epoch, self.batch, self.sig, self.rank, self.group = epoch, batch, sig, rank, group

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch) and self.rank in (-1, trainer.global_rank):
            whom = "its process group" if self.group else "itself"
            print(f"SignalAt: sending {self.sig} to {whom} at epoch {self.epoch} batch {self.batch}", flush=True)
            if self.group:  # every process of the group (the ranks Lightning started, every loader worker), sent
                # as a shell's `kill -TERM -- -PGID` sends it: from a process that is no worker's parent (torch's
                # worker handler exits quietly on a SIGTERM from its parent, torch/csrc/DataLoader.cpp)
                subprocess.run(["kill", f"-{self.sig.removeprefix('SIG')}", "--", f"-{os.getpgid(0)}"], check=False)
            else:
                os.kill(os.getpid(), getattr(signal, self.sig))


class KillLoaderWorkerAt(pl.Callback):
    """SIGKILLs train loader worker 0 of the process with global rank `rank` (all if -1) when training batch `batch`
    of `epoch` starts (batch -1: when the validation after that epoch's training starts, between two epochs of the
    persistent workers; -2: validation loader worker 0, when that validation ends), as the kernel's OOM killer
    would; prints its pid."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int, rank: int = -1) -> None:
        self.epoch, self.batch, self.rank = epoch, batch, rank

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.batch == -2 and trainer.current_epoch == self.epoch and not trainer.sanity_checking:
            self._kill(trainer, trainer.val_dataloaders)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            self._kill(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.batch == -1 and trainer.current_epoch == self.epoch and not trainer.sanity_checking:
            self._kill(trainer)

    def _kill(self, trainer, loader=None) -> None:
        if self.rank in (-1, trainer.global_rank):
            pid = (loader or trainer.train_dataloader)._iterator._workers[0].pid
            print(f"KillLoaderWorkerAt: SIGKILL to loader worker pid {pid} of rank {trainer.global_rank}", flush=True)
            os.kill(pid, signal.SIGKILL)
            if loader is not None:  # at a validation's end the fit may end first: wait until the worker has died
                while _state(pid) not in ("Z", None):
                    time.sleep(0.01)


class KillValWorkersUnreported(pl.Callback):
    """SIGKILLs every validation loader worker of the process with global rank `rank` (all if -1) when validation
    batch `batch` of `epoch` starts, with this process's fork server frozen (SIGSTOP) until they are dead and for
    half a second more: the deaths are reported late, as on a loaded node, while the next batches, queued, still
    have their storage in the dead workers."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int, rank: int = -1) -> None:
        self.epoch, self.batch, self.rank = epoch, batch, rank

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if ((trainer.current_epoch, batch_idx) != (self.epoch, self.batch) or trainer.sanity_checking
                or self.rank not in (-1, trainer.global_rank)):
            return
        import threading
        from multiprocessing import forkserver

        server = forkserver._forkserver._forkserver_pid
        workers = [w.pid for w in trainer.val_dataloaders._iterator._workers]
        print(f"KillValWorkersUnreported: SIGKILL to validation workers {workers} of rank {trainer.global_rank}",
              flush=True)
        os.kill(server, signal.SIGSTOP)
        try:
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            for pid in workers:
                while _state(pid) not in ("Z", None):
                    time.sleep(0.01)
        finally:
            threading.Timer(0.5, os.kill, (server, signal.SIGCONT)).start()


def _state(pid: int) -> str | None:
    """A process's state letter (/proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


class NanBatchAt(pl.Callback):
    """Turns the images of training batch `batch` of `epoch` into NaN (after the normalisation on the device) on the
    process with global rank `rank` (all if -1): that step's loss is NaN there, as a real divergence makes it."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int, rank: int = -1) -> None:
        self.epoch, self.batch, self.rank = epoch, batch, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch) and self.rank in (-1, trainer.global_rank):
            batch[0].fill_(float("nan"))


class FlushAndKillAt(pl.Callback):
    """SIGKILLs this process when training batch `batch` of `epoch` starts, once its loggers have written everything
    to disk (TensorBoard flushes every 120 s and at each save: what a long run has on disk when it is killed)."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            for logger in trainer.loggers:
                logger.save()
            os.kill(os.getpid(), signal.SIGKILL)


class KeepCheckpointAt(pl.Callback):
    """Copies last.ckpt to `path` as the step after `step` starts, i.e. as the step save of `step` left it (a
    checkpoint callback runs after every other callback, so at `step`'s own batch end it has not saved yet)."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            shutil.copy(os.path.join(trainer.checkpoint_callback.dirpath, "last.ckpt"), self.path)


class SignalDuringValidation(pl.Callback):
    """Sends a real signal to this process when validation batch `batch` starts (not in the sanity check): in the
    validation of `epoch` (any if -1), on the process with global rank `rank` (all if -1); and again when batch
    `again` starts (-1: never), as a second Ctrl-C."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, batch: int = 1, sig: str = "SIGTERM", epoch: int = -1, rank: int = -1, again: int = -1) -> None:
        self.batch, self.sig, self.epoch, self.rank, self.again = batch, sig, epoch, rank, again

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if (batch_idx in (self.batch, self.again) and not trainer.sanity_checking and
                self.epoch in (-1, trainer.current_epoch) and self.rank in (-1, trainer.global_rank)):
            print(f"SignalDuringValidation: sending {self.sig} at validation batch {batch_idx}", flush=True)
            os.kill(os.getpid(), getattr(signal, self.sig))


class LossRecorder(pl.Callback):
    """Writes `out_dir/rank{R}.json`: every training step's loss, and how the train loader starts its workers."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module) -> None:
        context = getattr(trainer.train_dataloader, "multiprocessing_context", None)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"losses": self.losses, "start": context.get_start_method() if context else None}, f)


class SignalDuringTest(SignalDuringValidation):
    """SignalDuringValidation for the `test` subcommand's batches."""

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)


class SignalDuringPredict(SignalDuringValidation):
    """SignalDuringValidation for the `predict` subcommand's batches. A predict stops at the batch after a signal,
    so a second Ctrl-C comes in the same batch: `again` equal to `batch` sends the signal twice."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.again == self.batch:
            self.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
