"""Benchmarks: `python -m lightning_app.bench loaders` (data backends) and `... train` (strategies, precision)."""
from lightning_app.bench.loader_report import classify

__all__ = ["classify"]
