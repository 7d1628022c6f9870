"""`python -m bench memory`: the pinned, shared and host memory each rank and node of a config holds.

The suite's four entry points (bench/__main__.py's table calls them): `add_parser` and `run` (command.py),
`to_markdown` and `chart` (report.py).
"""
from bench.memory.command import add_parser, run
from bench.memory.report import chart, to_markdown

__all__ = ["add_parser", "chart", "run", "to_markdown"]
