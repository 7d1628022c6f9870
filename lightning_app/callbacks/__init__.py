"""Everything handed to `Trainer(callbacks=...)`, one concept per file.

On by default (lightning_app/cli.py): throughput, progress, checkpoints, reseed, memory_probe. From the model's
settings (ImageClassifier.configure_callbacks): freeze, pictures, predictions, hparams. From a config:
progressive_resizing, ema.
"""
