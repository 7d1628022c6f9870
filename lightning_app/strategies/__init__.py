"""Strategy names for `--trainer.strategy`: `dp` (DataParallel, which Lightning 2 removed) and a `ddp`
with a short collective timeout, its bucket options and gradient compression (comm_hook) reachable from YAML.

Importing this module registers both names (lightning_app.cli imports it).
"""
from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from lightning_app.strategies.ddp import ClusterDDPStrategy, check_compile
from lightning_app.strategies.dp import DP_COMPILE_MESSAGE, DataParallelStrategy, DataParallelView

__all__ = ["DP_COMPILE_MESSAGE", "ClusterDDPStrategy", "DataParallelStrategy", "DataParallelView", "check_compile",
           "register"]


def register() -> None:
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="DataParallel: one process, each batch split over the GPUs",
        override=True,
    )
    # Our `ddp` name: Lightning's DDP, plus the short timeout and options above.
    StrategyRegistry.register(
        "ddp", ClusterDDPStrategy, description="DDP with a short collective timeout (FIC_DDP_TIMEOUT_S)", override=True,
    )


register()
