"""Pictures in TensorBoard (and MLflow, W&B: sinks.py): what the model confuses, gets wrong, and sees.

After each validation epoch (rank 0 logs; not during the sanity check):
  images/confusion_matrix   the confusion matrix of the whole validation set (summed over all ranks):
                            labelled up to 30 classes, a compact heatmap above
                            (lightning_app/callbacks/pictures/drawing.py)
  images/most_confused      the (true, predicted) pairs confused most often, as a table (TEXT tab)
  images/mistakes           the most confidently misclassified val images, each titled true / predicted
Once per fit:
  images/train_batch        the first training batch after augmentation, as the model sees it

They never hold the other ranks: during validation everything stays on the device (no copy to the
host per batch, no host sync); at the epoch's end one all-reduce sums the N x N counts, then rank 0
copies what it draws to the host and hands it to its drawing thread, and goes on training. Switch with
`--model.pictures` (a list of confusion_matrix, mistakes, train_batch; [] for none).
"""
from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch

from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_app.callbacks.pictures.drawing import Drawer, confusion_picture, most_confused, titled_grid
from lightning_app.callbacks.pictures.sinks import picture_sinks
from lightning_app.disk_full import no_space
from lightning_app.errors import UserError

KINDS = ("confusion_matrix", "mistakes", "train_batch")
log = logging.getLogger(__name__)


def picture_callbacks(hparams) -> list[pl.Callback]:
    kinds = hparams.get("pictures", KINDS)
    kinds = [] if kinds in (None, False) else list(KINDS if kinds is True else kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise UserError(f"model.pictures: unknown {unknown}; choose from {list(KINDS)} ([] for none).")
    return [TensorBoardPictures(kinds)] if kinds else []


def to_every(sinks: list, method: str, *args) -> None:
    """`sink.method(*args)` on every sink; one tracker that fails (a full disk, a lost server) costs only its own
    copy of the picture."""
    for sink in sinks:
        try:
            getattr(sink, method)(*args)
        except Exception as error:  # a full disk: one line here, the paragraph when the run stops (disk_full.py)
            full = no_space(error)
            log.warning("a picture could not be written to %s%s", type(sink).__name__,
                        f": {full.strerror}" if full else "", exc_info=full is None)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """A batch as the loaders make it (uint8) or as the model gets it (normalised float) -> uint8 NCHW on the CPU."""
    images = images.detach()
    if images.dtype == torch.uint8:
        return images.cpu()
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255
    return (images.float() * std + mean).clamp_(0, 255).round_().to(torch.uint8).cpu()


def logged_step(trainer) -> int:
    """The step Lightning logs this moment's scalars with (trainer/connectors/logger_connector/logger_connector.py,
    log_metrics: fit_loop.epoch_loop._batches_that_stepped; trainer.global_step is one more at an epoch's end):
    pictures line up with val/acc1, and a resumed run's TensorBoard purge (lightning_app/runs/guard.py) drops
    exactly what a killed attempt logged after its checkpoint."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


class TensorBoardPictures(pl.Callback):
    def __init__(self, kinds=KINDS, max_images: int = 16) -> None:
        self.kinds = set(kinds)
        self.max_images = max_images
        self._train_batch_logged = False
        self._counts: torch.Tensor | None = None
        self._best: tuple[torch.Tensor, ...] | None = None  # (scores, images, true, predicted) on the device
        self.drawer = Drawer()

    def _names(self, pl_module) -> list[str]:
        names = list(getattr(pl_module, "class_names", []) or [])
        n = pl_module.backbone_num_classes() if hasattr(pl_module, "backbone_num_classes") else len(names)
        return names if len(names) == n else [str(i) for i in range(n)]

    # -- once per fit: a training batch after augmentation ----------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self._train_batch_logged = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if "train_batch" not in self.kinds or self._train_batch_logged:
            return
        self._train_batch_logged = True
        sinks = picture_sinks(trainer)
        if not sinks:
            return
        images, labels = to_uint8(batch[0][: self.max_images]).numpy(), batch[1][: self.max_images].tolist()
        names, step = self._names(pl_module), logged_step(trainer)
        titles = [names[y] if isinstance(y, int) and 0 <= y < len(names) else str(y) for y in labels]
        self.drawer.submit(lambda: to_every(sinks, "image", "images/train_batch", titled_grid(images, titles), step))

    # -- every validation epoch: confusion matrix and worst mistakes ------------------------
    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._best = None
        self._counts = None
        if "confusion_matrix" in self.kinds and not trainer.sanity_checking:
            n = pl_module.backbone_num_classes()
            self._counts = torch.zeros(n, n, dtype=torch.int64, device=pl_module.device)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or not isinstance(outputs, torch.Tensor):
            return  # validation_step returns its logits
        logits, labels = outputs.detach(), batch[1]
        predicted = logits.argmax(-1)
        if self._counts is not None:
            # index_put_ with accumulate: no host sync (torchmetrics' confusion matrix counts with
            # torch.bincount, which reads the largest value back to the host on CUDA)
            self._counts.index_put_((labels, predicted), torch.ones_like(labels), accumulate=True)
        if "mistakes" in self.kinds and trainer.global_rank == 0:
            self._keep_mistakes(logits, labels, batch[0])

    def _keep_mistakes(self, logits: torch.Tensor, labels: torch.Tensor, images: torch.Tensor) -> None:
        """The most confident wrong predictions so far, chosen and kept on the device (no host sync)."""
        confidence, predicted = logits.float().softmax(-1).max(-1)
        score = torch.where(predicted != labels, confidence, torch.full_like(confidence, -1.0))
        top, idx = score.topk(min(self.max_images, len(score)))
        found = (top, images[idx].detach(), labels[idx], predicted[idx])
        if self._best is not None and self._best[1].shape[1:] == found[1].shape[1:]:
            merged = [torch.cat(pair) for pair in zip(self._best, found, strict=False)]
            top, idx = merged[0].topk(min(self.max_images, len(merged[0])))
            found = tuple(t[idx] for t in merged)
        self._best = found

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        sinks = picture_sinks(trainer)
        names, step = self._names(pl_module), logged_step(trainer)
        if self._counts is not None:
            counts = trainer.strategy.reduce(self._counts, reduce_op="sum")  # every rank: one all-reduce
            self._counts = None
            if sinks:
                matrix = counts.cpu().numpy()

                def confusion() -> None:
                    to_every(sinks, "image", "images/confusion_matrix", confusion_picture(matrix, names), step)
                    to_every(sinks, "text", "images/most_confused", most_confused(matrix, names), step)

                self.drawer.submit(confusion)
        best, self._best = self._best, None
        if best is not None and sinks:
            scores, images, true, predicted = best
            keep = (scores >= 0).cpu()
            if keep.any():
                pictures = to_uint8(images[keep.to(images.device)]).numpy()
                scores, true, predicted = (t.cpu()[keep].tolist() for t in (scores, true, predicted))
                titles = [f"true {names[t]}\npred {names[p]} ({c:.2f})"
                          for c, t, p in zip(scores, true, predicted, strict=False)]
                self.drawer.submit(lambda: to_every(sinks, "image", "images/mistakes", titled_grid(pictures, titles),
                                                    step))

    # -- every picture written before the logger closes --------------------------------------
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # what was logged before a checkpoint is on disk when the checkpoint is (lightning_app/runs/guard.py): a run
        # killed after this save and resumed from it never validates that epoch again, so its pictures go now
        self.drawer.wait()
        to_every(picture_sinks(trainer), "flush")

    def on_fit_end(self, trainer, pl_module) -> None:
        self.drawer.wait()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # a stopped run (a diverged loss, a stop signal) finalizes its loggers right after this hook
        # (pytorch_lightning/trainer/call.py, _interrupt) and never calls teardown: a picture still being drawn
        # would write into a closed TensorBoard writer
        self.drawer.wait()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.drawer.wait()
