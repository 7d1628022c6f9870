"""How many CPUs this process may use, and its share of them on the node.

`os.cpu_count()` counts every core of the machine; SLURM (`--cpus-per-task`), taskset, cgroups
cpusets and container runtimes restrict a process to fewer. The affinity mask is what the
scheduler will actually run this process's threads on.
"""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask), falling back to os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpus_per_process(processes_per_node: int = 1) -> int:
    """This process's share of the usable CPUs when `processes_per_node` training processes share them."""
    return max(1, usable_cpus() // max(1, processes_per_node))
