"""How many CPUs this process may use, and its share of them on the node.

`os.cpu_count()` counts every core of the machine; SLURM (`--cpus-per-task`), taskset, cgroups
cpusets and container runtimes restrict a process to fewer. The affinity mask is what the
scheduler will actually run this process's threads on.

Whether that mask is this rank's alone or shared by every rank on the node depends on who
started the ranks:
- `srun` with one task per GPU and SLURM's task/affinity plugin gives each task its own mask of
  `--cpus-per-task` CPUs: the whole mask is this rank's (dividing it again by the ranks per node
  would leave most of them idle);
- torchrun, Lightning's own launcher (also under `srun --pty bash`), mpirun and a plain shell
  start every rank with the mask they inherited, the same for all: each rank takes its share.
Lightning uses SLURM's variables only for a task that srun started (SLURMEnvironment.detect:
SLURM_NTASKS set and a job name other than bash/interactive); its launcher and torchrun set
LOCAL_RANK in the ranks they start (lightning_fabric/strategies/launchers/subprocess_script.py),
which srun never does.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask), falling back to os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class CpuShare:
    """This rank's CPUs: `cpus` of the `mask` CPUs it may run on, of the node's `node`."""

    cpus: int
    mask: int
    node: int
    ranks_per_node: int
    per_task: bool
    launcher: str

    def describe(self) -> str:
        held = f"its affinity mask holds {self.mask} of the node's {self.node} CPUs"
        if self.ranks_per_node == 1:
            return f"{held}, one training process on this node: all {self.cpus} for it"
        if self.per_task:
            return f"{held}, its own per-task CPU set ({self.launcher}): all {self.cpus} for this rank"
        return (f"{held}, a mask shared by the {self.ranks_per_node} ranks on this node ({self.launcher}): "
                f"{self.cpus} per rank")


def _launcher(env: Mapping[str, str]) -> str:
    if "LOCAL_RANK" in env:
        return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a launcher that set LOCAL_RANK"
    if "SLURM_LOCALID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "srun"
    if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        return "mpirun"
    return "one launcher for all ranks"


def cpu_share(ranks_per_node: int = 1, env: Mapping[str, str] | None = None, mask: int | None = None,
              node: int | None = None) -> CpuShare:
    """This rank's share of the CPUs when `ranks_per_node` training processes run on its node.

    Per-task (the whole mask is this rank's) when srun started this rank as its own task, with
    SLURM_CPUS_PER_TASK set and a mask no larger than that: SLURM bound the task to its CPUs. A mask
    larger than --cpus-per-task (SLURM without task/affinity: every task sees the job's CPUs on the
    node) or any other launcher: shared, divided by the ranks on the node.
    """
    env = os.environ if env is None else env
    mask = usable_cpus() if mask is None else mask
    node = max(mask, os.cpu_count() or mask) if node is None else node
    ranks = max(1, ranks_per_node)
    launcher = _launcher(env)
    per_task = False
    if ranks > 1 and launcher == "srun":
        try:
            per_task_cpus = int(env.get("SLURM_CPUS_PER_TASK", "0"))
        except ValueError:
            per_task_cpus = 0
        if per_task_cpus > 0:
            launcher = f"srun, SLURM_CPUS_PER_TASK={per_task_cpus}"
            per_task = mask <= per_task_cpus
    cpus = mask if per_task or ranks == 1 else max(1, mask // ranks)
    return CpuShare(cpus=cpus, mask=mask, node=node, ranks_per_node=ranks, per_task=per_task, launcher=launcher)


def cpus_per_process(processes_per_node: int = 1) -> int:
    """This process's share of the usable CPUs when `processes_per_node` training processes share the node."""
    return cpu_share(processes_per_node).cpus
