"""Downscaled copies: writer.py (`python -m datamodules.downscale`), datamodule.py (DownscaledDataModule)."""
