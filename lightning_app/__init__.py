"""The training core: the LightningModule, the CLI, callbacks, strategies, runs, predict and export."""
from lightning_app.module import ImageClassifier

__all__ = ["ImageClassifier"]
