"""Where the pictures go: every tracker of the run that takes images, each in its own way.

- TensorBoard: add_image / add_text under the tag (images/confusion_matrix, ...), as always;
- MLflow: MlflowClient.log_image(key=tag, step=step), the image artifacts MLflow's UI shows by key and step
  (mlflow/tracking/client.py, log_image: artifacts/images/<key>+step+<step>+...png), and the Markdown table as a
  text artifact <tag>/step_<step>.md;
- W&B: WandbLogger.log_image (pytorch_lightning/loggers/wandb.py), keyed by tag, at the trainer step.
A sink is made on rank 0's training thread (where each logger starts its run) and used on the drawing thread.
"""
from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger


class TensorBoardSink:
    def __init__(self, logger: TensorBoardLogger) -> None:
        self.writer = logger.experiment

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def text(self, tag: str, markdown: str, step: int) -> None:
        self.writer.add_text(tag, markdown, step)

    def flush(self) -> None:
        self.writer.flush()


class MLflowSink:
    def __init__(self, logger: MLFlowLogger) -> None:
        self.client, self.run_id = logger.experiment, logger.run_id

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.client.log_image(self.run_id, image, key=tag, step=step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        self.client.log_text(self.run_id, markdown, f"{tag}/step_{step:06d}.md")

    def flush(self) -> None:
        pass  # every call above has written its file


class WandbSink:
    def __init__(self, logger: WandbLogger) -> None:
        self.logger = logger
        logger.experiment  # noqa: B018 - W&B starts its run here, not on the drawing thread

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.logger.log_image(key=tag, images=[image], step=step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        pass  # W&B shows no Markdown beside its images; the table is in TensorBoard and MLflow

    def flush(self) -> None:
        pass


def picture_sinks(trainer: pl.Trainer) -> list:
    """One sink per tracker of this run that takes pictures (rank 0 only: the others have none)."""
    if trainer.global_rank != 0:
        return []
    sinks: list = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            sinks.append(TensorBoardSink(logger))
        elif isinstance(logger, MLFlowLogger):
            sinks.append(MLflowSink(logger))
        elif isinstance(logger, WandbLogger):
            sinks.append(WandbSink(logger))
    return sinks
