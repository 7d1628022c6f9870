"""Benchmarks: `python -m bench loaders` (data backends) and `... train` (strategies, precision)."""
from bench.loaders.report import classify

__all__ = ["classify"]
