"""`python -m bench gpu`: every GPU path of the template, checked and timed.

The suite's four entry points (bench/__main__.py's table calls them): `add_parser` and `run` (command.py),
`to_markdown` and `chart` (report.py).
"""
from bench.gpu.command import add_parser, run
from bench.gpu.report import chart, to_markdown

__all__ = ["add_parser", "chart", "run", "to_markdown"]
