"""The ranks Lightning's launcher starts on a node die with the rank that started them.

Lightning's subprocess launcher (pytorch_lightning/strategies/launchers/subprocess_script.py,
`_call_children_scripts`) starts local ranks 1.. as children of rank 0, and watches them from rank 0
(`_ChildProcessObserver`: a child that fails gets every process SIGKILLed, "to avoid zombies"). Nothing watches
the other way: a rank 0 that dies unannounced (SIGKILL, the kernel's OOM killer, or a stop signal that arrives
before its handlers exist, as a sweep's trial may meet SLURM's warning signal while it starts) leaves its children
waiting for it in the rendezvous or a collective until the timeout (300 s), holding their GPUs and their ports.

So rank 0 names itself in the environment the launcher copies into each child, and each child asks the kernel
for SIGKILL when rank 0's launching thread ends (prctl PR_SET_PDEATHSIG, man 2 prctl): the signal Lightning's
observer sends for the same reason (a rank blocked in a collective never runs a Python handler).
"""
from __future__ import annotations

import os

LAUNCHER_ENV = "FIC_LAUNCHING_RANK_PID"


def name_the_launching_rank() -> None:
    """In rank 0, before the launcher starts the other local ranks: they inherit this process's pid."""
    os.environ[LAUNCHER_ENV] = str(os.getpid())


def die_with_the_launching_rank() -> None:
    """In a local rank the launcher started: SIGKILL when rank 0 ends; if it has ended already, end now. A name
    inherited through another launcher (torchrun, srun, a test runner that made a strategy in-process) whose
    process still runs is not this rank's parent: ignored."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if not launcher.isdigit() or local_rank in ("", "0"):
        return
    pid = int(launcher)
    if os.getppid() == pid:
        from datamodules.processes.exits import die_with_parent

        die_with_parent()
        if os.getppid() == pid:
            return
    elif _running(pid):
        return
    # rank 0 ended before die_with_parent took hold (this process was handed to another parent): no signal will come
    os.write(2, f"[rank: {local_rank}] the rank 0 process that started this one (pid {pid}) has ended; this rank "
                "ends too (rank 0's own output says why).\n".encode())
    os._exit(1)


def _running(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie: a parent that has exited but is not yet reaped), proc(5)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
