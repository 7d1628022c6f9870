"""`--trainer.strategy ddp`: Lightning's DDP with a short collective timeout, DDP's bucket options and gradient
compression (comm_hook) reachable from YAML."""
from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fabric.utilities.distributed import _destroy_dist_connection
from lightning_fabric.utilities.rank_zero import rank_prefixed_message
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DDPStrategy as _LightningDDP
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightning_app.errors import UserError
from lightning_app.lr_schedule import total_steps
from lightning_app.strategies import comm_hooks, launched_ranks, peers
from lightning_app.strategies.dp import DP_COMPILE_MESSAGE, DataParallelStrategy

log = logging.getLogger("pytorch_lightning")  # Lightning's handler prints its INFO lines
DEFAULT_DDP_TIMEOUT_S = 300.0  # torch's default is 30 min: far too long to notice a dead peer
POWERSGD_START_FRACTION = 0.3  # powersgd_start_iter null: plain all-reduce for this share of the fit's steps
# bucket_cap_mb null with PowerSGD: torch's hook drains the GPU once per bucket (powerSGD_hook.py, decompress:
# torch.cuda.synchronize), so fewer, larger buckets mean fewer drains; ResNet-50's 94 MB of float32 gradients fit
# in one after DDP's 1 MiB first bucket. Its all-reduce is small after compression, so little overlap is lost.
POWERSGD_BUCKET_CAP_MB = 100.0


def check_compile(strategy: Any) -> None:
    """Refuse `compile` with a strategy that would break it.

    - dp: refused (DP_COMPILE_MESSAGE).
    - ddp: nothing lost. The backbone compiles lazily at its first call, inside DistributedDataParallel.forward,
      where DDP marks itself active (`_inside_ddp_forward`, torch/nn/parallel/distributed.py); dynamo then wraps
      the backend in DDPOptimizer (torch/_dynamo/convert_frame.py, get_optimize_ddp_mode), which splits the graph
      at DDP's bucket boundaries (torch/_dynamo/backends/distributed.py), so the all-reduce still overlaps the
      backward. DDPOptimizer asserts that DDP's bucket is at least its 1 MiB first bucket
      (dist._DEFAULT_FIRST_BUCKET_BYTES): bucket_cap_mb below 1 is refused.
    """
    if isinstance(strategy, DataParallelStrategy):
        raise UserError(DP_COMPILE_MESSAGE)
    cap = getattr(strategy, "bucket_cap_mb", None)
    if cap is not None and cap < 1:
        raise UserError(COMPILE_BUCKET_MESSAGE.format(cap=cap))


COMPILE_BUCKET_MESSAGE = (
    "--trainer.strategy.bucket_cap_mb {cap} cannot be combined with --model.compile true: torch.compile splits the "
    "backbone's graph at DDP's gradient buckets (DDPOptimizer, torch/_dynamo/backends/distributed.py), and it "
    "asserts that a bucket holds at least its 1 MiB first bucket. Set --trainer.strategy.bucket_cap_mb to 1 or "
    "more (torch's default is 25), or --model.compile false.")


def elastic_attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's shared agent store, a client of it with a prefix of this restart's own; else None.

    torchrun's agent serves one TCPStore for every rendezvous round (TORCHELASTIC_USE_AGENT_STORE; it is rebuilt
    only when `_bootstrap_store_info is None`, torch/distributed/elastic/rendezvous/dynamic_rendezvous.py), and
    torch's env:// rendezvous adds no prefix per attempt (torch/distributed/rendezvous.py, `_create_c10d_store`).
    A restarted group would read the process group's keys of the attempt that died (distributed_c10d.py,
    `default_pg/0/...`): the dead peers' addresses, then a connection refused, and a peer left waiting until the
    collective timeout. `scripts/torchrun.sh` avoids the shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); this
    covers a plain `torchrun --max-restarts N` on one node. On several nodes the restart counts can differ (each
    agent counts its own restarts; a node whose workers were alive restarts on a membership change without counting,
    torch/distributed/elastic/agent/server/api.py), so no prefix would pair them: that is refused in one paragraph.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    if nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        raise UserError(
            f"torchrun --max-restarts on {nodes} nodes shares its agent's store across restarts, and a restarted group "
            "would read the dead attempt's connection details (then wait until the collective timeout). Start torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (scripts/torchrun.sh sets it), or use the "
            "script.")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/fic/attempt_{attempt}", agent)


class ClusterDDPStrategy(_LightningDDP):
    """Lightning's DDP with a short collective timeout, DDP's bucket options and gradient compression as
    plain init args.

    Args:
        timeout_s: seconds a collective waits for its peers before the run fails (a dead or hung
            peer then ends the run with an error instead of a 30-minute hang). Default 300, or the
            env var FIC_DDP_TIMEOUT_S.
        bucket_cap_mb: gradient bucket size for the all-reduce (null: torch's 25, or 100 with PowerSGD, whose
            hook drains the GPU once per bucket).
        gradient_as_bucket_view: gradients are views into the buckets (saves one copy of the grads).
        static_graph: the graph is the same every step (lets DDP skip per-step bookkeeping).
        find_unused_parameters: needed only when some parameters get no gradient in a step.
        comm_hook: gradient compression on the wire: none, fp16 or bf16 (half the bytes), powersgd (a
            low-rank approximation with error feedback; configs/comm/*.yaml).
            fp16 with 16-mixed, bf16 otherwise (warned). See lightning_app/strategies/comm_hooks.py.
        powersgd_rank: rank of PowerSGD's approximation of each weight matrix (1, 2, 4, 8: more is closer).
        powersgd_start_iter: steps of plain all-reduce before PowerSGD starts (>= 2); null = 30% of the fit's
            optimizer steps, never before the end of the learning-rate warm-up (model.warmup_epochs).
    """

    last_timeout_s: float | None = None
    last_rank: tuple[int, int] | None = None

    def __init__(
        self,
        timeout_s: float | None = None,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        comm_hook: comm_hooks.CommHook = "none",
        powersgd_rank: int = 4,
        powersgd_start_iter: int | None = None,
        **kwargs: Any,
    ) -> None:
        if timeout_s is None:
            timeout_s = float(os.environ.get("FIC_DDP_TIMEOUT_S", DEFAULT_DDP_TIMEOUT_S))
        self.check_settings(timeout_s, comm_hook=comm_hook, powersgd_rank=powersgd_rank,
                            powersgd_start_iter=powersgd_start_iter, **kwargs)
        ddp_kwargs: dict[str, Any] = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        if bucket_cap_mb is None and comm_hook == "powersgd":
            bucket_cap_mb = POWERSGD_BUCKET_CAP_MB
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        kwargs.setdefault("start_method", "popen")
        super().__init__(timeout=timedelta(seconds=timeout_s), **{**ddp_kwargs, **kwargs})
        self.timeout_s = timeout_s
        self.bucket_cap_mb = bucket_cap_mb
        self.comm_hook, self.powersgd_rank, self.powersgd_start_iter = comm_hook, powersgd_rank, powersgd_start_iter
        self._powersgd: comm_hooks.PowerSGDHookState | None = None
        self._saved_comm_state: dict | None = None
        self._own_comm_state: dict | None = None  # this rank's side file (rank >= 1), read with the checkpoint
        ClusterDDPStrategy.last_timeout_s = timeout_s  # for the error message if a peer is lost

    @staticmethod
    def check_settings(timeout_s: float | None = None, comm_hook: str = "none", powersgd_rank: int = 4,
                       powersgd_start_iter: int | None = None, **kwargs: Any) -> None:
        """One paragraph (UserError) for a setting that cannot work; the CLI calls it before instantiating."""
        if timeout_s is not None and timeout_s <= 0:
            raise UserError(f"ClusterDDPStrategy timeout_s must be > 0 seconds, got {timeout_s}.")
        comm_hooks.check_settings(comm_hook, powersgd_rank, powersgd_start_iter, kwargs.get("process_group_backend"))
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise UserError(f"ClusterDDPStrategy: comm_hook {comm_hook!r} and ddp_comm_hook both given; choose one.")

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.cluster_environment is not None and not self.cluster_environment.creates_processes_externally:
            launched_ranks.name_the_launching_rank()  # the ranks it starts die with this one

    def setup_distributed(self) -> None:
        ClusterDDPStrategy.last_rank = (self.global_rank, self.world_size)
        store = None if dist.is_initialized() else elastic_attempt_store(self._timeout)
        if store is None:
            super().setup_distributed()
        else:  # Lightning's DDPStrategy.setup_distributed (pytorch_lightning/strategies/ddp.py), with the store
            reset_seed()
            self.set_world_ranks()
            self._process_group_backend = self._get_process_group_backend()
            device = self.root_device if self.root_device.type != "cpu" else None
            dist.init_process_group(self._process_group_backend, rank=self.global_rank, world_size=self.world_size,
                                    store=store, timeout=self._timeout, device_id=device)
            if self._process_group_backend == "nccl":  # as Lightning's _init_dist_connection does
                atexit.register(_destroy_dist_connection)
        peers.exchange(self.global_rank, self.world_size)  # who is where, for the message if one is lost
        if self.world_size > 1:  # where each rank runs, in its own log: a stalled rank's log names its host and GPU
            print(peers.own_line(self.global_rank, self.world_size), flush=True)
            if self.global_rank == 0:
                print(peers.layout_table(), flush=True)

    # -- gradient compression ------------------------------------------------------------------
    def _register_ddp_hooks(self) -> None:
        if self.comm_hook == "none":
            super()._register_ddp_hooks()
            return
        # Lightning registers hooks only on CUDA (pytorch_lightning/strategies/ddp.py, _register_ddp_hooks: a
        # limit of torch 1.8); torch 2 runs them on gloo too, so ours are registered on every device.
        comm_hooks.check_settings(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter,
                                  self._process_group_backend)
        hook, state = comm_hooks.build(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)
        if isinstance(state, comm_hooks.PowerSGDHookState):
            state.name_parameters(self.model.module)
            state.one_bucket_at_a_time = self._process_group_backend != "nccl"
            state.loss_scale = self._loss_scale
            self._powersgd = state
            self._restore_powersgd()
        scaler = self._scaler()
        warning = comm_hooks.precision_warning(self.comm_hook, str(self.precision_plugin.precision),
                                               scaler is not None and scaler.is_enabled())
        if warning:
            rank_zero_warn(warning)
        self.model.register_comm_hook(state, hook)
        what = (f"PowerSGD rank {self.powersgd_rank}" if self.comm_hook == "powersgd"
                else f"{self.comm_hook} compression")
        rank_zero_info(f"DDP gradients: {what} ({self._process_group_backend}).")

    def _scaler(self) -> Any:
        return getattr(self.precision_plugin, "scaler", None)  # MixedPrecision's GradScaler (16-mixed on CUDA)

    def _loss_scale(self) -> Any:
        # GradScaler keeps its scale as a device tensor, `_scale` (torch/amp/grad_scaler.py; get_scale() would
        # sync with the host); it exists from the first scale() call, so during every backward
        scaler = self._scaler()
        return None if scaler is None or not scaler.is_enabled() else scaler._scale

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self._powersgd is not None and self.powersgd_start_iter is None:
            # torch's advice (PowerSGDState's docstring in powerSGD_hook.py): plain all-reduce for about 10% of the
            # steps and at least the warm-up, more where accuracy needs it; the quickstart needed 30%
            # (bench/results/*nodes-accuracy*). The module knows its warm-up once its optimizers exist
            # (ImageClassifier.configure_optimizers, which counts the steps with the same total_steps).
            warmup = int(getattr(self.lightning_module, "warmup_steps", None) or 0)
            self._powersgd.set_start_iter(max(2, warmup, int(POWERSGD_START_FRACTION * total_steps(trainer))))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank and rank 0 writes the file (Strategy.save_checkpoint, then a barrier in
        # Trainer.save_checkpoint): rank 0's PowerSGD entry goes into it, every other rank writes its own error
        # feedback beside it, so nothing here is a collective. A weights-only checkpoint has no hook state.
        if self._powersgd is not None and "optimizer_states" in checkpoint:
            entry = comm_hooks.checkpoint_entry(self._powersgd, self.global_rank, self.world_size)
            if self.global_rank == 0:
                checkpoint[comm_hooks.CHECKPOINT_KEY] = entry
            else:
                self.checkpoint_io.save_checkpoint({comm_hooks.CHECKPOINT_KEY: entry},
                                                   comm_hooks.side_path(filepath, self.global_rank))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath) -> None:
        # ModelCheckpoint removes an old checkpoint through this on every rank (_remove_checkpoint in
        # pytorch_lightning/callbacks/model_checkpoint.py); rank 0 removes the file (Strategy.remove_checkpoint),
        # each other rank its own side file (TorchCheckpointIO.remove_checkpoint: nothing if it is absent)
        super().remove_checkpoint(filepath)
        if self.global_rank != 0 and self.comm_hook == "powersgd":
            self.checkpoint_io.remove_checkpoint(comm_hooks.side_path(filepath, self.global_rank))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved_comm_state = checkpoint.get(comm_hooks.CHECKPOINT_KEY)
        if self._saved_comm_state is not None and self.comm_hook != "powersgd":
            rank_zero_info(f"The checkpoint holds PowerSGD state; comm_hook {self.comm_hook} does not use it.")
        self._own_comm_state = None
        side = comm_hooks.side_path(checkpoint_path, self.global_rank)
        if self._saved_comm_state is not None and self.global_rank != 0 and get_filesystem(side).exists(side):
            self._own_comm_state = self.checkpoint_io.load_checkpoint(side).get(comm_hooks.CHECKPOINT_KEY)
        self._restore_powersgd()  # the checkpoint is read before DDP is set up; in case it is not
        return checkpoint

    def _restore_powersgd(self) -> None:
        saved, state = self._saved_comm_state, self._powersgd
        if saved is None or state is None:
            return
        self._saved_comm_state = None
        lost = comm_hooks.restore_entry(state, saved, self.global_rank, self.world_size, self._own_comm_state)
        said = (f"PowerSGD state restored at its step {state.torch_state.iter}"
                + (f"; not restored: {', '.join(lost)}." if lost else " (error feedback, warm start).")
                + (f" Saved by {saved['world']} processes, now {self.world_size}: the other ranks' error feedback "
                   "restarts at zero." if saved.get("world", self.world_size) != self.world_size else ""))
        if self.global_rank == 0:
            rank_zero_info(said)
        elif lost:
            log.info(rank_prefixed_message(said, self.global_rank))
