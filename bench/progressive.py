"""`python -m bench.progressive`, the command the docs and tests name; the code is bench/train/progressive.py."""
import sys

from bench.train.progressive import build_parser, main, output_stem

__all__ = ["build_parser", "main", "output_stem"]

if __name__ == "__main__":
    from datamodules.processes.exits import run_tool

    # a stop signal in one line (130, 143), never a traceback (datamodules/processes/exits.py)
    sys.exit(run_tool("python -m bench.progressive", lambda: main() and 0, on_stop="no result was written"))
