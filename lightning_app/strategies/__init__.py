"""Everything `--trainer.strategy` names: `dp` (DataParallel, which Lightning 2 removed: dp.py) and `ddp`
(ClusterDDPStrategy: Lightning's DDP with a short collective timeout, the lost peer named, its bucket options
and gradient compression reachable from YAML: ddp.py, comm_hooks.py, peers.py).

Importing this package registers both names (lightning_app.cli imports it). Ours takes over the name `ddp`
because the template's promise (a dead peer ends the run in minutes with a paragraph naming it, never a
30-minute hang) must hold for the spelling most users type; Lightning's own DDP stays reachable as
`class_path: pytorch_lightning.strategies.DDPStrategy`. STRATEGY_HELP says so in `--help`.
"""
from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from lightning_app.strategies.ddp import ClusterDDPStrategy, check_compile
from lightning_app.strategies.dp import DP_COMPILE_MESSAGE, DataParallelStrategy, DataParallelView

__all__ = ["DP_COMPILE_MESSAGE", "STRATEGY_HELP", "ClusterDDPStrategy", "DataParallelStrategy", "DataParallelView",
           "check_compile", "register"]

STRATEGY_HELP = (
    "In this template `dp` is lightning_app.strategies.dp.DataParallelStrategy (one process, each batch split over "
    "the GPUs) and `ddp` is lightning_app.strategies.ddp.ClusterDDPStrategy: Lightning's DDP with a collective "
    "timeout of 300 s (timeout_s, FIC_DDP_TIMEOUT_S), the lost peer named when one dies, and gradient compression "
    "(comm_hook). Lightning's plain DDP: class_path pytorch_lightning.strategies.DDPStrategy. "
)


def register() -> None:
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="DataParallel: one process, each batch split over the GPUs",
        override=True,
    )
    StrategyRegistry.register(
        "ddp", ClusterDDPStrategy, description="Lightning's DDP with a short collective timeout (FIC_DDP_TIMEOUT_S), "
        "the lost peer named, and comm_hook", override=True,
    )


register()
