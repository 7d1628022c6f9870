"""`python -m bench {loaders,train,gpu,memory,nodes}`: tables (Markdown), JSON and a PNG chart for this machine.

Every suite is a package with the same four entry points, and `SUITES` is the registry of them by name
(as FFCV's ffcv/benchmarks/ registers its benchmarks):
- `add_parser(subparsers, common)` adds the suite's subcommand (`common` adds --out, --machine, --note);
- `run(args)` measures and returns the result (a dict; a `kind` key names its files when a suite writes more
  than one kind, as nodes does with --accuracy), or raises `BenchError`;
- `to_markdown(result)` and `chart(result)` (the keyword arguments of `report.bar_chart`) show it.
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType

from bench import gpu, loaders, memory, nodes, report, train
from bench.cli import BenchError, add_common, data_dir_problem
from bench.progress_bars import no_bars_in_a_log_file
from datamodules.errors import DataError
from datamodules.processes.exits import run_tool
from lightning_app.devices import refuse_unusable_gpu
from lightning_app.errors import UserError, silence_known_noise

SUITES: dict[str, ModuleType] = {"loaders": loaders, "train": train, "gpu": gpu, "memory": memory, "nodes": nodes}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench",
                                 description="Benchmarks of this template on this machine. Results go to "
                                             "OUT/<machine>.md (all sections), plus .json and .png per command.")
    sub = ap.add_subparsers(dest="command", required=True)
    for suite in SUITES.values():
        suite.add_parser(sub, add_common)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    silence_known_noise()
    # bad input in one paragraph (exit 2), a stop signal in one line (130, 143), never a traceback
    return run_tool(f"python -m bench {args.command}", lambda: _run(args), on_stop="no result was written",
                    bad_input=(UserError, DataError, OSError))


def _run(args: argparse.Namespace) -> int:
    suite = SUITES[args.command]
    with no_bars_in_a_log_file():
        try:
            # a GPU this torch cannot use: never a quiet CPU measurement (lightning_app/devices.py)
            refuse_unusable_gpu(getattr(args, "device", None) or "auto",
                                "pass --device cpu (python -m bench loaders)")
            problem = data_dir_problem(getattr(args, "data_dir", None))
            if problem:
                raise BenchError(f"python -m bench {args.command}: {problem}")
            result = suite.run(args)
        except BenchError as error:
            print(error, file=sys.stderr)
            return error.code
        md = suite.to_markdown(result)
        paths = report.write_results(args.out, result.get("kind", args.command), md, result, suite.chart(result),
                                     args.machine, args.note)
        print(md)
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
