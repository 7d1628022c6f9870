"""Everything handed to `Trainer(callbacks=...)`, one concept per file.

On by default, listed in configs/callbacks/default.yaml: checkpoints (the stop-signal save), finite_loss, reseed,
norm_window, memory_probe, throughput, hparams; checkpoints' ResumableCheckpoint under `checkpoint:` in
configs/default.yaml. Added where a setting asks (lightning_app/cli.py): progress (trainer.enable_progress_bar),
saved_config; from the model's settings (ImageClassifier.configure_callbacks): freeze, pictures, predictions (predict
only). From a config: progressive_resizing, ema. required.py: the one a config may not drop.
"""
