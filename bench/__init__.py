"""Benchmarks of this template on this machine: `python -m bench {loaders,train,gpu,memory,nodes}`.

One package per suite; what several suites share is at this level (report.py: the machine, tables and
result files; cli.py: the common flags and `BenchError`).
"""
