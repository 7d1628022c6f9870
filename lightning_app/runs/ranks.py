"""Which process may make a run folder and take its lock, judged from the environment before any launch."""
from __future__ import annotations

import os


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
