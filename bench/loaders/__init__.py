"""`python -m bench loaders`: every data backend's train pipeline timed, cold and warm, against the machine's ceilings.

The suite's four entry points (bench/__main__.py's table calls them): `add_parser` and `run` (command.py),
`to_markdown` and `chart` (report.py).
"""
from bench.loaders.command import add_parser, run
from bench.loaders.report import chart, to_markdown

__all__ = ["add_parser", "chart", "run", "to_markdown"]
