"""This process as its launcher started it: its rank before any launch, its SLURM job, its torchrun worker group, the
sweep trial it runs, its command line and the time. run.json and the run's lock record these; `--ckpt_path last`
on a requeue or a restart goes by them (runs/resolve.py).
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass


def _int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def launch_rank() -> int | None:
    """This process's global rank if the environment says it, 0 when nothing does; None when it is a
    rank > 0 whose number the environment does not give.

    The order is Lightning's (lightning_fabric/utilities/rank_zero.py, _get_rank: "SLURM_PROCID can be set
    even if SLURM is not managing the multiprocessing, therefore LOCAL_RANK needs to be checked first"):
    - RANK: torchrun, or any launcher that sets the global rank;
    - LOCAL_RANK with NODE_RANK/GROUP_RANK: Lightning's subprocess launcher starts local ranks 1.. with these
      (pytorch_lightning/strategies/launchers/subprocess_script.py), also inside `srun --pty bash`, whose
      inherited SLURM_PROCID=0 is the shell's, not the child's;
    - a NODE_RANK/GROUP_RANK above 0: a node started by hand;
    - SLURM_PROCID, then the MPI ranks: the task's rank when SLURM or MPI starts every process.
    """
    rank = _int("RANK")
    if rank is not None:
        return rank
    node = _int("NODE_RANK") if _int("NODE_RANK") is not None else _int("GROUP_RANK")
    local = _int("LOCAL_RANK")
    if local is not None:
        return local if not node else None
    if node:
        return None
    for name in ("SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "JSM_NAMESPACE_RANK"):
        rank = _int(name)
        if rank is not None:
            return rank
    return 0


def is_launch_rank_zero() -> bool:
    """True in exactly the one process that will be global rank 0, whoever launched it."""
    return launch_rank() == 0


# -- SLURM ---------------------------------------------------------------------------------
def slurm_job() -> dict:
    """This process's SLURM job, or {} outside SLURM."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return {}
    job = {"job_id": env["SLURM_JOB_ID"], "restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0)}
    if env.get("SLURM_ARRAY_JOB_ID"):
        job |= {"array_job_id": env["SLURM_ARRAY_JOB_ID"], "array_task_id": env.get("SLURM_ARRAY_TASK_ID", "")}
    return job


def job_key(job: dict) -> str | None:
    """What identifies a job across requeues: `ARRAYJOB_TASK` for an array task (as Lightning's own requeue
    names it, trainer/connectors/signal_connector.py), else the job id."""
    if not job:
        return None
    if job.get("array_job_id"):
        return f"{job['array_job_id']}_{job.get('array_task_id', '')}"
    return str(job["job_id"])


def is_requeued(job: dict) -> bool:
    return bool(job) and int(job.get("restart_count", 0)) > 0


def command_line() -> str:
    """This process's command, with every argument that carries a credential written as <redacted>: one that
    names a credential key (datamodules/credentials.py, is_secret) and the value of --data.storage_options."""
    from datamodules.credentials import REDACTED, is_secret

    words, hide_next = [], False
    for arg in sys.argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            words.append(REDACTED)
            hide_next = False
        elif "storage_options" in flag and arg.startswith("--"):
            words.append(f"{flag}={REDACTED}" if eq else arg)
            hide_next = not eq
        elif any(is_secret(w) for w in re.findall(r"[A-Za-z_]+", arg)):
            words.append(REDACTED)
        else:
            words.append(arg)
    return " ".join(words)


# -- torchrun --------------------------------------------------------------------------------
# torchrun's agent sets these in every worker (torch/distributed/elastic/agent/server/local_elastic_agent.py,
# _start_workers): the rendezvous run id (--rdzv-id), how often the group was restarted, and the node count.
NO_RUN_ID = ("", "none")  # torchrun's --rdzv-id default "none" (torch/distributed/run.py): shared by every job


def elastic_run() -> dict:
    """This process's torchrun worker group, or {} outside torchrun. `agent`: host and pid of the torchrun agent
    that started it (the worker's parent: the agent Popens its workers and outlives their restarts,
    torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return {}
    return {"run_id": env["TORCHELASTIC_RUN_ID"], "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            "max_restarts": int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0),
            "nodes": int(env.get("GROUP_WORLD_SIZE") or 1), "agent": f"{socket.gethostname()}:{os.getppid()}"}


def elastic_key(run: dict) -> str | None:
    """What identifies a torchrun job across its restarts: its rendezvous run id. Without one (--rdzv-id left at
    "none") the agent on a single node, which every restart shares; on several nodes nothing (None)."""
    if not run:
        return None
    if run.get("run_id") not in NO_RUN_ID:
        return f"rdzv {run['run_id']}"
    return f"agent {run['agent']}" if run.get("nodes") == 1 and run.get("agent") else None


def is_elastic_restart(run: dict) -> bool:
    return bool(run) and int(run.get("restart_count", 0)) > 0


# -- sweeps ----------------------------------------------------------------------------------
# lightning_app/sweep/runner.py sets these in each trial's process: its run.json names the sweep and the trial.
SWEEP_DIR_ENV, SWEEP_TRIAL_ENV = "FIC_SWEEP_DIR", "FIC_SWEEP_TRIAL"


def sweep_trial() -> dict:
    """{"folder": the sweep folder, "trial": its number} when this process runs a sweep's trial, else {}."""
    folder, trial = os.environ.get(SWEEP_DIR_ENV), os.environ.get(SWEEP_TRIAL_ENV)
    return {"folder": folder, "trial": int(trial)} if folder and trial and trial.isdigit() else {}


# -- time ----------------------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# -- all of it, read once ------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """This process as plain values, read once before a run is planned (runs/plan.py): resolving `--ckpt_path`,
    the run's lock and its run.json use these instead of reading the environment again."""
    rank_zero: bool  # is_launch_rank_zero(): the one process that makes the run folder and takes its lock
    slurm: dict  # slurm_job()
    slurm_key: str | None  # job_key(slurm)
    requeued: bool  # is_requeued(slurm)
    elastic: dict  # elastic_run()
    elastic_key: str | None  # elastic_key(elastic)
    elastic_restart: bool  # is_elastic_restart(elastic)
    sweep: dict  # sweep_trial()
    host: str
    pid: int
    command: str  # command_line(): credentials redacted
    started: str  # now()


def this_process() -> Launch:
    slurm, elastic = slurm_job(), elastic_run()
    return Launch(is_launch_rank_zero(), slurm, job_key(slurm), is_requeued(slurm), elastic, elastic_key(elastic),
                  is_elastic_restart(elastic), sweep_trial(), socket.gethostname(), os.getpid(), command_line(), now())
