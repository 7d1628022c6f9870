"""Pictures in TensorBoard: what the model confuses, gets wrong, and sees.

After each validation epoch (rank 0 logs; not during the sanity check):
  images/confusion_matrix   torchmetrics' confusion-matrix plot with the class names (summed over all ranks)
  images/mistakes           the most confidently misclassified val images, each titled true / predicted
Once per fit:
  images/train_batch        the first training batch after augmentation, as the model sees it

Cheap: the confusion matrix is an N x N count updated from the logits validation already
computed (validation_step returns them); the mistakes keep at most `max_images` images on
rank 0's shard; the training batch is drawn once. Switch with `--model.pictures`
(a list of confusion_matrix, mistakes, train_batch; [] for none).
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_app.errors import UserError

KINDS = ("confusion_matrix", "mistakes", "train_batch")


def picture_callbacks(hparams) -> list[pl.Callback]:
    kinds = hparams.get("pictures", KINDS)
    kinds = [] if kinds in (None, False) else list(KINDS if kinds is True else kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise UserError(f"model.pictures: unknown {unknown}; choose from {list(KINDS)} ([] for none).")
    return [TensorBoardPictures(kinds)] if kinds else []


def tensorboard(trainer: pl.Trainer):
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """A batch as the loaders make it (uint8) or as the model gets it (normalised float) -> uint8 NCHW on the CPU."""
    images = images.detach()
    if images.dtype == torch.uint8:
        return images.cpu()
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255
    return (images.float() * std + mean).clamp_(0, 255).round_().to(torch.uint8).cpu()


def titled_grid(images: torch.Tensor, titles: list[str], columns: int = 4):
    """A matplotlib figure of uint8 NCHW images, each with its title (TensorBoard images have no captions)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = len(images)
    columns = min(columns, n)
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(2.2 * columns, 2.5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, title in zip(axes.flat, images, titles):
        ax.imshow(image.permute(1, 2, 0).numpy())
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


class TensorBoardPictures(pl.Callback):
    def __init__(self, kinds=KINDS, max_images: int = 16) -> None:
        self.kinds = set(kinds)
        self.max_images = max_images
        self._train_batch_logged = False
        self._confusion = None
        self._mistakes: list[tuple[float, torch.Tensor, int, int]] = []

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
        writer = tensorboard(trainer)
        if trainer.global_rank != 0 or writer is None:
            return
        images, labels = batch[0][: self.max_images], batch[1][: self.max_images]
        names = self._names(pl_module)
        titles = [names[int(y)] if 0 <= int(y) < len(names) else str(int(y)) for y in labels]
        writer.add_figure("images/train_batch", titled_grid(to_uint8(images), titles), trainer.global_step)

    # -- every validation epoch: confusion matrix and worst mistakes ------------------------
    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._mistakes = []
        if "confusion_matrix" in self.kinds and not trainer.sanity_checking:
            from torchmetrics.classification import MulticlassConfusionMatrix

            self._confusion = MulticlassConfusionMatrix(pl_module.backbone_num_classes()).to(pl_module.device)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or not isinstance(outputs, torch.Tensor):
            return  # validation_step returns its logits
        logits, labels = outputs.detach(), batch[1]
        if self._confusion is not None:
            self._confusion.update(logits, labels)
        if "mistakes" in self.kinds and trainer.global_rank == 0:
            conf, pred = logits.float().softmax(-1).max(-1)
            # the most confident wrong ones, chosen on the device: one small copy to the host per batch
            score = torch.where(pred != labels, conf, torch.full_like(conf, -1.0))
            top, idx = score.topk(min(self.max_images, len(score)))
            top, idx, true, guess = (t.cpu() for t in (top, idx, labels[idx], pred[idx]))
            keep = top >= 0
            if keep.any():
                pictures = to_uint8(batch[0][idx[keep].to(batch[0].device)])
                for j, (c, t, p) in enumerate(zip(top[keep].tolist(), true[keep].tolist(), guess[keep].tolist())):
                    self._mistakes.append((c, pictures[j], t, p))
                self._mistakes = sorted(self._mistakes, key=lambda m: -m[0])[: self.max_images]

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        writer = tensorboard(trainer)
        names = self._names(pl_module)
        if self._confusion is not None:
            matrix = self._confusion  # compute() sums the counts of all ranks (a collective: every rank calls it)
            matrix.compute()
            if trainer.global_rank == 0 and writer is not None:
                fig, _ = matrix.plot(labels=names)
                fig.set_size_inches(max(5, 0.5 * len(names)), max(5, 0.5 * len(names)))
                writer.add_figure("images/confusion_matrix", fig, trainer.global_step)
            self._confusion = None
        if self._mistakes and trainer.global_rank == 0 and writer is not None:
            images = torch.stack([m[1] for m in self._mistakes])
            titles = [f"true {names[t]}\npred {names[p]} ({c:.2f})" for c, _, t, p in self._mistakes]
            writer.add_figure("images/mistakes", titled_grid(images, titles), trainer.global_step)
        self._mistakes = []
