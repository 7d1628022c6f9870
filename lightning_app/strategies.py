"""Strategy names for `--trainer.strategy`: `dp` (DataParallel, which Lightning 2 removed) and a `ddp`
with a short collective timeout, its bucket options and gradient compression (comm_hook) reachable from YAML.

Importing this module registers both names (lightning_app.cli imports it).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from pytorch_lightning.strategies import DDPStrategy as _LightningDDP
from pytorch_lightning.strategies import SingleDeviceStrategy, StrategyRegistry
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_app import comm_hooks, peers
from lightning_app.errors import UserError

# Where ImageClassifier.forward looks for the DataParallel view of its backbone. It lives in the
# module's __dict__, not in _modules, so state_dict keys stay exactly those of a single-device run.
DP_ATTR = "data_parallel_backbone"
DEFAULT_DDP_TIMEOUT_S = 300.0  # torch's default is 30 min: far too long to notice a dead peer


class _AutocastReplica(nn.Module):
    """Runs the wrapped net under the caller's autocast setting.

    Autocast state is thread-local and DataParallel runs each replica in its own thread, which
    re-enters autocast with the default dtype (float16): bf16-mixed would silently become fp16.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.amp: tuple[bool, torch.dtype] = (False, torch.float16)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        enabled, dtype = self.amp
        with torch.autocast("cuda", dtype=dtype, enabled=enabled):
            return self.net(images)


class DataParallelView:
    """Callable view of a backbone that splits each batch over several CUDA devices."""

    def __init__(self, net: nn.Module, device_ids: list[int]) -> None:
        self.replica = _AutocastReplica(net)
        self.dp = nn.DataParallel(self.replica, device_ids=device_ids, output_device=device_ids[0])
        self.device_ids = device_ids

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        enabled = torch.is_autocast_enabled("cuda")
        self.replica.amp = (enabled, torch.get_autocast_dtype("cuda") if enabled else torch.float16)
        return self.dp(images)


DP_COMPILE_MESSAGE = (
    "model.compile true cannot be combined with --trainer.strategy dp: nn.Module.compile binds the compiled "
    "call to the original backbone object (torch/nn/modules/module.py, Module.compile sets _compiled_call_impl), "
    "and nn.DataParallel's replicas copy that object's __dict__ (torch/nn/parallel/replicate.py), so every GPU "
    "would run the first GPU's weights on its own inputs. Use --trainer.strategy ddp (one process per GPU; "
    "compile works there), or keep dp and set --model.compile false."
)


def is_compiled(module: nn.Module) -> bool:
    """True when `module.compile()` was called on it (in place: the compiled call lives in its __dict__)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def check_compile(strategy: Any) -> None:
    """Refuse or warn before `compile` is combined with a strategy that would break or slow it.

    - dp: refused (DP_COMPILE_MESSAGE).
    - ddp with more than one process: warned. The backbone is compiled inside the DDP wrapper, not around it, so dynamo's
      DDPOptimizer (torch/_dynamo/backends/distributed.py, which splits a graph at DDP's bucket
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


class DataParallelStrategy(SingleDeviceStrategy):
    """One process drives all chosen GPUs; each batch is split across them (nn.DataParallel).

    Everything else is the single-device path: one process, the loss, logging, metrics, AMP and
    checkpoints on the first device, state_dict keys unchanged (a DP checkpoint loads anywhere).
    The LightningModule attribute named by `module_attr` (default "backbone") is replicated; the
    module's forward must call `getattr(self, "data_parallel_backbone", None) or self.backbone`.
    BatchNorm statistics are per GPU chunk; running statistics follow the first GPU's chunk.
    """

    strategy_name = "dp"

    def __init__(self, module_attr: str = "backbone", **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self.module_attr = module_attr
        self._parallel_devices: list[torch.device] = []

    # The accelerator connector fills this from --trainer.accelerator/--trainer.devices.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        self._parallel_devices = [torch.device(d) if not isinstance(d, torch.device) else d for d in devices]

    @property
    def cuda_devices(self) -> list[torch.device]:
        return [d for d in self._parallel_devices if d.type == "cuda"]

    @property
    def root_device(self) -> torch.device:
        cuda = self.cuda_devices
        if cuda:
            return cuda[0]
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        net = getattr(module, self.module_attr, None)
        if isinstance(net, nn.Module) and is_compiled(net):
            # refused on any machine, so a config fails on a laptop before it reaches the GPUs
            raise UserError(DP_COMPILE_MESSAGE)
        cuda = self.cuda_devices
        if len(cuda) < 2:
            why = "no CUDA device" if not cuda else "only one CUDA device chosen"
            rank_zero_warn(f"strategy dp: {why}; training on the single device {self.root_device}.")
            module.__dict__.pop(DP_ATTR, None)
            return
        if not isinstance(net, nn.Module):
            raise AttributeError(  # noqa: TRY004
                f"strategy dp replicates the LightningModule's `{self.module_attr}` attribute, but "
                f"{type(module).__name__} has no such nn.Module; set DataParallelStrategy(module_attr=...)."
            )
        ids = [d.index for d in cuda]
        module.__dict__[DP_ATTR] = DataParallelView(net, ids)
        rank_zero_info(f"strategy dp: each batch is split over {len(ids)} GPUs {ids} in one process.")

    def teardown(self) -> None:
        if self.lightning_module is not None:
            self.lightning_module.__dict__.pop(DP_ATTR, None)
        super().teardown()


class DDPStrategy(_LightningDDP):
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
            low-rank approximation with error feedback; configs/comm/*.yaml). See lightning_app/comm_hooks.py.
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
        DDPStrategy.last_timeout_s = timeout_s  # for the error message if a peer is lost

    @staticmethod
    def check_settings(timeout_s: float | None = None, comm_hook: str = "none", powersgd_rank: int = 2,
                       powersgd_start_iter: int | None = None, **kwargs: Any) -> None:
        """One paragraph (UserError) for a setting that cannot work; the CLI calls it before instantiating."""
        if timeout_s is not None and timeout_s <= 0:
            raise UserError(f"DDPStrategy timeout_s must be > 0 seconds, got {timeout_s}.")
        comm_hooks.check_settings(comm_hook, powersgd_rank, powersgd_start_iter, kwargs.get("process_group_backend"))
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise UserError(f"DDPStrategy: comm_hook {comm_hook!r} and ddp_comm_hook both given; choose one.")

    def setup_distributed(self) -> None:
        DDPStrategy.last_rank = (self.global_rank, self.world_size)
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


def register() -> None:
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="DataParallel: one process, each batch split over the GPUs",
        override=True,
    )
    # Our `ddp` name: Lightning's DDP, plus the short timeout and options above.
    StrategyRegistry.register(
        "ddp", DDPStrategy, description="DDP with a short collective timeout (FIC_DDP_TIMEOUT_S)", override=True,
    )


register()
