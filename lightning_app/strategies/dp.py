"""`--trainer.strategy dp`: DataParallel, which Lightning 2 removed: one process, each batch split over the GPUs."""
from __future__ import annotations

from typing import Any

import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_app.errors import UserError

# Where ImageClassifier.forward looks for the DataParallel view of its backbone. It lives in the
# module's __dict__, not in _modules, so state_dict keys stay exactly those of a single-device run.
DP_ATTR = "data_parallel_backbone"


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
