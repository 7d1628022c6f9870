"""Where each trial runs: its own GPUs, its own rendezvous, nothing of the job's launcher.

A trial is `python main.py fit` started by the sweep, so Lightning launches the trial's ranks itself, one per GPU of
its share (`devices: auto`), and the trial must see neither the SLURM task it runs inside nor the job's rendezvous:
- Lightning takes SLURMEnvironment whenever SLURM_NTASKS is set and the job is not named bash/interactive
  (lightning_fabric/plugins/environments/slurm.py, `_is_srun_used`). Its world size is then SLURM_NTASKS (a trial
  given 4 GPUs would train on one, with the whole global batch) and its port 15000 + the job id's last 4 digits,
  the same for every trial of the job, so a second trial at the same time fails to bind it.
- An exported MASTER_PORT collides the same way (lightning_fabric/plugins/environments/lightning.py, `main_port`).
So each trial gets its own free port on 127.0.0.1 and loses the task's and any launcher's rank variables; it keeps
the SLURM job's own (SLURM_JOB_ID, the array's ids: run.json's record of the job, runs/identity.py).
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Mapping

from lightning_app.errors import UserError

# The task, step and rank variables srun sets for the sweep's own task (the job's, SLURM_JOB_ID and the array ids,
# stay), and those of any other launcher (torchrun, mpirun) the sweep itself may run under.
LAUNCHER_PREFIXES = ("SLURM_STEP_", "SLURM_SRUN_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_",
                     "JSM_NAMESPACE_")
LAUNCHER_VARIABLES = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                      "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_GTIDS", "SLURM_TASK_PID",
                      "SLURM_LAUNCH_NODE_IPADDR", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                      "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                      "ROLE_NAME", "ROLE_WORLD_SIZE", "STANDALONE_PORT")


def trial_environment(parent: Mapping[str, str], gpus: str | None, port: int) -> dict[str, str]:
    """The environment of one trial's fit: the sweep's, less every launcher's task and rank variables, with its own
    rendezvous on this host and, when it has a share, only its GPUs."""
    env = {k: v for k, v in parent.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


class Ports:
    """Free TCP ports for the trials running at once, never the same one twice while a trial holds it. The OS picks
    a free port (bind to port 0); it is free again once closed, so a port handed out is remembered until its trial
    ends, and another trial that the OS gave it draws again."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            while True:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = probe.getsockname()[1]
                if port not in self._held:
                    self._held.add(port)
                    return port

    def give_back(self, port: int) -> None:
        with self._lock:
            self._held.discard(port)


def split_gpus(visible: list[str], workers: int, share: bool = False) -> tuple[list[str | None], str | None]:
    """Each worker's GPUs (its trials' CUDA_VISIBLE_DEVICES; None: all this process sees) and a line naming the GPUs
    left unused, or None.

    K workers on G GPUs: worker i gets the i-th block of G // K adjacent GPUs, so every trial trains at the same
    world size and per-rank batch (the trials compare), and a block stays within one half of a box where GPUs are
    numbered by PCI bus (CUDA_DEVICE_ORDER=PCI_BUS_ID, nvidia-smi's order). The G % K left over stay idle. More
    workers than GPUs is refused unless `share` says the trials may share them."""
    if workers < 2 or not visible:
        return [None] * workers, None
    if len(visible) < workers:
        if share:
            return [None] * workers, None
        raise UserError(f"--workers {workers} with {len(visible)} GPU(s) visible ({','.join(visible)}): each trial "
                        f"needs a GPU of its own. Use --workers {len(visible)} (or fewer), or add --share-gpus if "
                        f"the {workers} trials at a time are meant to share them.")
    block = len(visible) // workers
    shares: list[str | None] = [",".join(visible[i * block:(i + 1) * block]) for i in range(workers)]
    rest = visible[workers * block:]
    unused = (f"{len(visible)} GPUs give {workers} workers {block} each; GPU(s) {','.join(rest)} stay unused "
              f"(--workers {_divisors_hint(len(visible), workers)} uses them all)." if rest else None)
    return shares, unused


def split_cpus(cpus: list[int], workers: int) -> list[list[int] | None]:
    """Each worker's CPUs (its trials' affinity mask; None: all of this process's): K workers get K equal blocks of
    the CPUs this process may use, so each trial sizes its loader workers for its own block (datamodules/budget/
    cpus.py reads the mask) instead of every trial planning for all of them."""
    if workers < 2 or len(cpus) < workers:
        return [None] * workers
    block = len(cpus) // workers
    return [sorted(cpus)[i * block:(i + 1) * block] for i in range(workers)]


def pinned(command: list[str], cpus: list[int] | None) -> list[str]:
    """`command` started on `cpus` only (taskset sets the mask before exec; a preexec_fn would run Python in a child
    forked from this threaded process), or as it is where there is no share or no taskset."""
    if cpus is None or not shutil.which("taskset"):
        return command
    return ["taskset", "--cpu-list", ",".join(map(str, cpus)), *command]


def _divisors_hint(gpus: int, workers: int) -> str:
    fits = [k for k in range(1, gpus + 1) if gpus % k == 0]
    below = max(k for k in fits if k < workers)
    above = [k for k in fits if k > workers]
    return f"{below} or {above[0]}" if above else str(below)


def crowded_workers(workers: int, gpus: int, cpus: int | None, share: bool = False) -> str | None:
    """Why --workers K would slow every trial (said once at the start), or None: trials that share GPUs
    (--share-gpus), or, without GPUs, fits that each use every CPU."""
    if workers < 2:
        return None
    if gpus and gpus < workers and share:
        return (f"--workers {workers} --share-gpus with {gpus} GPU(s): the trials share them (each sees all "
                f"{gpus}), so they contend for GPU memory and time; --workers {gpus} gives each trial its own.")
    if not gpus:
        return (f"--workers {workers} without a GPU: each trial's fit uses every CPU here ({cpus or 'all'}), so "
                f"{workers} at a time run each about {workers}x slower and rarely finish sooner in all; "
                "--workers 1 here (more workers pay off with a GPU each, or as separate SLURM tasks).")
    return None


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all of torch's when it is unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
