"""`--trainer.strategy ddp`: Lightning's DDP with a short collective timeout, DDP's bucket options and gradient
compression (comm_hook) reachable from YAML."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from pytorch_lightning.strategies import DDPStrategy as _LightningDDP
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightning_app.errors import UserError
from lightning_app.strategies import comm_hooks, peers
from lightning_app.strategies.dp import DP_COMPILE_MESSAGE, DataParallelStrategy

DEFAULT_DDP_TIMEOUT_S = 300.0  # torch's default is 30 min: far too long to notice a dead peer


def check_compile(strategy: Any) -> None:
    """Refuse or warn before `compile` is combined with a strategy that would break or slow it.

    - dp: refused (DP_COMPILE_MESSAGE).
    - ddp with more than one process: warned. The backbone is compiled inside the DDP wrapper, not around it, so
      dynamo's DDPOptimizer (torch/_dynamo/backends/distributed.py, which splits a graph at DDP's bucket
      boundaries) never sees DDP: the compiled backward hands every gradient over at its end, and the
      all-reduce no longer overlaps the backward pass. With SyncBatchNorm, its all-gather inside an
      autograd Function (torch/nn/modules/_functions.py) breaks the graph at every BatchNorm.
    """
    if isinstance(strategy, DataParallelStrategy):
        raise UserError(DP_COMPILE_MESSAGE)
    if isinstance(strategy, _LightningDDP) and strategy.world_size > 1:  # one process: no all-reduce to overlap
        sync = getattr(strategy, "_layer_sync", None) is not None
        rank_zero_warn(
            "model.compile with DDP: the compiled backbone sits inside the DDP wrapper, so the gradient "
            "all-reduce waits for the whole backward instead of overlapping it; compile still speeds up the "
            "forward and backward, but on several GPUs measure both settings."
            + (" With trainer.sync_batchnorm, every SyncBatchNorm also breaks the compiled graph (its "
               "all-gather cannot be traced): prefer sync_batchnorm false or compile false." if sync else "")
        )


class ClusterDDPStrategy(_LightningDDP):
    """Lightning's DDP with a short collective timeout, DDP's bucket options and gradient compression as
    plain init args.

    Args:
        timeout_s: seconds a collective waits for its peers before the run fails (a dead or hung
            peer then ends the run with an error instead of a 30-minute hang). Default 300, or the
            env var FIC_DDP_TIMEOUT_S.
        bucket_cap_mb: gradient bucket size for the all-reduce (torch's default 25).
        gradient_as_bucket_view: gradients are views into the buckets (saves one copy of the grads).
        static_graph: the graph is the same every step (lets DDP skip per-step bookkeeping).
        find_unused_parameters: needed only when some parameters get no gradient in a step.
        comm_hook: gradient compression on the wire: none, fp16 or bf16 (half the bytes), powersgd (a
            low-rank approximation with error feedback; configs/comm/*.yaml).
            See lightning_app/strategies/comm_hooks.py.
        powersgd_rank: rank of PowerSGD's approximation of each weight matrix (1, 2, 4: more is closer).
        powersgd_start_iter: steps of plain all-reduce before PowerSGD starts (>= 2); null = the end of the
            learning-rate warm-up (model.warmup_epochs).
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
        powersgd_rank: int = 2,
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
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        kwargs.setdefault("start_method", "popen")
        super().__init__(timeout=timedelta(seconds=timeout_s), **{**ddp_kwargs, **kwargs})
        self.timeout_s = timeout_s
        self.comm_hook, self.powersgd_rank, self.powersgd_start_iter = comm_hook, powersgd_rank, powersgd_start_iter
        self._powersgd: comm_hooks.PowerSGDHookState | None = None
        self._saved_comm_state: dict | None = None
        ClusterDDPStrategy.last_timeout_s = timeout_s  # for the error message if a peer is lost

    @staticmethod
    def check_settings(timeout_s: float | None = None, comm_hook: str = "none", powersgd_rank: int = 2,
                       powersgd_start_iter: int | None = None, **kwargs: Any) -> None:
        """One paragraph (UserError) for a setting that cannot work; the CLI calls it before instantiating."""
        if timeout_s is not None and timeout_s <= 0:
            raise UserError(f"ClusterDDPStrategy timeout_s must be > 0 seconds, got {timeout_s}.")
        comm_hooks.check_settings(comm_hook, powersgd_rank, powersgd_start_iter, kwargs.get("process_group_backend"))
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise UserError(f"ClusterDDPStrategy: comm_hook {comm_hook!r} and ddp_comm_hook both given; choose one.")

    def setup_distributed(self) -> None:
        ClusterDDPStrategy.last_rank = (self.global_rank, self.world_size)
        super().setup_distributed()
        peers.exchange(self.global_rank, self.world_size)  # who is where, for the message if one is lost

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
            self._powersgd = state
            self._restore_powersgd()
        self.model.register_comm_hook(state, hook)
        what = (f"PowerSGD rank {self.powersgd_rank}" if self.comm_hook == "powersgd"
                else f"{self.comm_hook} compression")
        rank_zero_info(f"DDP gradients: {what} ({self._process_group_backend}).")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self._powersgd is not None and self.powersgd_start_iter is None:
            # the module knows its warm-up once its optimizers exist (ImageClassifier.configure_optimizers)
            warmup = getattr(self.lightning_module, "warmup_steps", None)
            self._powersgd.set_start_iter(max(2, int(warmup or 0)))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank (Trainer.save_checkpoint), so each rank's error feedback can be
        # gathered here; rank 0 writes the file. A weights-only checkpoint has no optimizer state and no hook state.
        if self._powersgd is not None and "optimizer_states" in checkpoint:
            saved = comm_hooks.gather_state(self._powersgd, self.root_device, self.global_rank, self.world_size)
            if saved is not None:
                checkpoint[comm_hooks.CHECKPOINT_KEY] = saved
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved_comm_state = checkpoint.get(comm_hooks.CHECKPOINT_KEY)
        if self._saved_comm_state is not None and self.comm_hook != "powersgd":
            rank_zero_info(f"The checkpoint holds PowerSGD state; comm_hook {self.comm_hook} does not use it.")
        self._restore_powersgd()  # the checkpoint is read before DDP is set up; in case it is not
        return checkpoint

    def _restore_powersgd(self) -> None:
        saved, state = self._saved_comm_state, self._powersgd
        if saved is None or state is None:
            return
        self._saved_comm_state = None
        lost = comm_hooks.restore_state(state, saved, self.global_rank, self.world_size)
        rank_zero_info(f"PowerSGD state restored at its step {state.torch_state.iter}"
                       + (f"; not restored: {', '.join(lost)}." if lost else " (error feedback, warm start)."))
