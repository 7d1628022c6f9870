"""DDP gradient compression as one setting, `comm_hook: none | fp16 | bf16 | powersgd`, and a PowerSGD
state that survives a checkpoint.

The hooks are torch's (torch/distributed/algorithms/ddp_comm_hooks/): `default_hooks.fp16_compress_hook`
and `bf16_compress_hook` all-reduce the gradient buckets in 16 bits (half the bytes); `powerSGD_hook`
sends a rank-r approximation of every weight matrix (P = M Q, Q = M^T P) plus the small tensors
uncompressed, and keeps what the approximation missed as a per-process error fed back into the next
step. All three run on gloo (CPU) and NCCL (GPU): gloo's all-reduce handles Half and BFloat16
(GENERATE_ALL_TYPES in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) and the 2-process tests run
each hook on gloo. MPI has no 16-bit type (mpiDatatype in ProcessGroupMPI.cpp), and DDP refuses the
bf16 hook unless torch was built with CUDA and NCCL >= 2.10, whatever the backend
(DistributedDataParallel._check_comm_hook): both are refused here in one paragraph.

Pair fp16 with 16-mixed and bf16 with anything else: without a loss scale, float16 on the wire flushes
gradients below its smallest subnormal to zero (precision_warning says so at setup).

PowerSGD (powersgd_state.py) keeps its state per gradient bucket, moved with DDP's bucket layout, finite and
in unscaled units across GradScaler overflows. torch's hook calls torch.cuda.synchronize once per bucket when
CUDA is available: it pays where the link is slow (between nodes), never on NVLink. The checkpoint holds the
shared state and rank 0's error feedback; every other rank keeps its own in a file beside it (checkpoint_entry,
side_path): no file grows with the world size.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_app.errors import UserError
from lightning_app.strategies.powersgd_state import PowerSGDHookState, pq_layout, resumable_powersgd_hook

CommHook = Literal["none", "fp16", "bf16", "powersgd"]
HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
CHECKPOINT_KEY = "ddp_comm_hook_state"
__all__ = ["CHECKPOINT_KEY", "HOOKS", "PowerSGDHookState", "build", "check_settings", "checkpoint_entry",
           "pq_layout", "precision_warning", "restore_entry", "resumable_powersgd_hook", "side_path"]


def check_settings(hook: str, rank: int, start_iter: int | None, backend: str | None) -> None:
    """One paragraph for a setting or a backend that cannot do the hook."""
    if hook not in HOOKS:
        raise UserError(f"--trainer.strategy.comm_hook {hook!r} is not a hook; choose one of {', '.join(HOOKS)}.")
    if hook == "powersgd":
        if rank < 1:
            raise UserError(f"--trainer.strategy.powersgd_rank must be >= 1 (the rank of each gradient's "
                            f"approximation; 1, 2 or 4 are usual), got {rank}.")
        if start_iter is not None and start_iter < 2:
            raise UserError(
                f"--trainer.strategy.powersgd_start_iter must be >= 2, got {start_iter}: DDP rebuilds its gradient "
                "buckets after the first step, and PowerSGD's error feedback and warm start may only begin after "
                "that (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, PowerSGDState). Leave it null "
                "to start at the end of the learning-rate warm-up.")
    if hook in ("fp16", "bf16") and backend == "mpi":
        raise UserError(
            f"comm_hook {hook} cannot run on the MPI backend: torch's MPI process group has no 16-bit types "
            "(mpiDatatype in torch/csrc/distributed/c10d/ProcessGroupMPI.cpp). Use gloo (CPU) or NCCL (GPU) "
            "through --trainer.strategy.process_group_backend, or comm_hook powersgd, which sends 32-bit floats.")
    if hook == "bf16" and not _bf16_hook_allowed():
        raise UserError(
            "comm_hook bf16 needs a torch built with CUDA and NCCL >= 2.10, even on gloo: DDP checks that before it "
            "accepts the hook (DistributedDataParallel._check_comm_hook in torch/nn/parallel/distributed.py), and "
            f"this torch ({torch.__version__}) has none. Use comm_hook fp16 (the same bytes on the wire) or powersgd.")


def _bf16_hook_allowed() -> bool:
    try:
        return bool(torch.version.cuda) and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except (RuntimeError, AttributeError):
        return False


def build(hook: str, rank: int, start_iter: int | None) -> tuple[Callable | None, Any]:
    """(hook function, its state) for DDP's register_comm_hook; (None, None) for `none`."""
    if hook == "fp16":
        return default_hooks.fp16_compress_hook, None  # state None: the whole world
    if hook == "bf16":
        return default_hooks.bf16_compress_hook, None
    if hook == "powersgd":
        state = PowerSGDHookState(rank, start_iter)
        return resumable_powersgd_hook, state
    return None, None


def side_path(checkpoint: str | os.PathLike, rank: int) -> str:
    """Where rank `rank` (>= 1) keeps its PowerSGD error feedback for `checkpoint`: a file beside it, on the disk of
    the node that rank runs on (docs/clusters.md, "Node-local disks")."""
    return f"{os.fspath(checkpoint)}.powersgd-rank{rank}"


def checkpoint_entry(state: PowerSGDHookState, rank: int, world: int) -> dict[str, Any]:
    """This rank's PowerSGD entry: for rank 0, the checkpoint's (the shared state: step counter, random generator,
    warm-start Q, all-reduced hence the same on every rank; and rank 0's error feedback); for the others, their
    own error feedback, for a file of their own beside the checkpoint (side_path). Every file holds one rank's
    error, so none grows with the world size, and saving needs no collective."""
    saved = {**state.export(), "world": world}
    return saved if rank == 0 else {"iter": saved["iter"], "world": world, "error": saved["error"]}


def restore_entry(state: PowerSGDHookState, saved: dict[str, Any], rank: int, world: int,
                  own: dict[str, Any] | None) -> list[str]:
    """Load the checkpoint's PowerSGD entry (`own`: this rank's side file, for rank >= 1) into `state`; returns what
    could not be restored. Error feedback saved under another world size restarts at zero (rank 0's excepted)."""
    lost, error = [], saved.get("error")
    if rank != 0:
        fits = own is not None and own.get("world") == world == saved.get("world") and own["iter"] == saved["iter"]
        error = own["error"] if fits else None
        if not fits and saved.get("world") == world:
            lost.append(f"rank {rank}'s error feedback (its file beside the checkpoint, *.powersgd-rank{rank}, is "
                        "missing or from another save; it restarts at zero)")
    return lost + state.load(saved, error)


def precision_warning(hook: str, precision: str, scaled: bool) -> str | None:
    """One line where the hook and the precision do not pair: fp16 on the wire needs a loss scale to keep small
    gradients above float16's smallest subnormal (about 6e-8); below it they arrive as zero."""
    if hook == "fp16" and not scaled:
        return (f"comm_hook fp16 with precision {precision} (no loss scaling): gradients below about 6e-8 are sent "
                "as zero. Use --trainer.strategy.comm_hook bf16 (CUDA + NCCL) or --trainer.precision 16-mixed.")
    return None
