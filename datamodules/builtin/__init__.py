"""The built-in dataset: draw.py (classes, presets, rendering), tree.py (`python -m datamodules.builtin`)."""
