"""`python -m bench train`: strategies, precisions and speed flags as real fits, against a hand-written loop.

The suite's four entry points (bench/__main__.py's table calls them): `add_parser` and `run` (command.py),
`to_markdown` and `chart` (report.py).
"""
from bench.train.command import add_parser, run
from bench.train.report import chart, to_markdown

__all__ = ["add_parser", "chart", "run", "to_markdown"]
