"""`python -m bench nodes`: DDP comm hooks on two simulated hosts (step times, or val/acc1 with --accuracy).

The suite's four entry points (bench/__main__.py's table calls them): `add_parser` and `run` (command.py),
`to_markdown` and `chart` (report.py), which read either kind of result.
"""
from bench.nodes.command import add_parser, run
from bench.nodes.report import chart, to_markdown

__all__ = ["add_parser", "chart", "run", "to_markdown"]
