"""The training core: the LightningModule, the CLI, callbacks, strategies and benchmarks."""
from lightning_app.module import ImageClassifier

__all__ = ["ImageClassifier"]
