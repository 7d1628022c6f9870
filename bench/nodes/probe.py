"""The callback `bench nodes` adds to each node of a run: when every training step ended, and how many bytes
the node's end of the simulated link had sent and received by then (the kernel's counters of the interface
gloo uses, /sys/class/net/$GLOO_SOCKET_IFNAME/statistics/). Written to $BENCH_NODES_OUT/node<NODE_RANK>.json."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytorch_lightning as pl

from bench.progress_bars import report_step, trainer_step

OUT_ENV = "BENCH_NODES_OUT"


def _counter(name: str) -> int:
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/{name}").read_text())
    except (OSError, ValueError, TypeError):
        return 0


class ReportSteps(pl.Callback):
    """Rank 0 says the step its fit reached, for the suite's progress line (bench/progress_bars.py)."""

    changes_training = False  # lightning_app/runs/identity.py leaves it out of a run's training settings

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            report_step(trainer_step(trainer, batch_idx))


class StepProbe(pl.Callback):
    def __init__(self) -> None:
        self.marks: list[tuple[float, int, int]] = []  # (seconds, tx bytes, rx bytes) at the start, then per step
        self.images = 0

    def _mark(self) -> None:
        self.marks.append((time.perf_counter(), _counter("tx_bytes"), _counter("rx_bytes")))

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._mark()
        self.images = int(batch[0].shape[0])
        if trainer.global_rank == 0:
            report_step(trainer_step(trainer, batch_idx))

    def on_train_end(self, trainer, pl_module) -> None:
        out = os.environ.get(OUT_ENV)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            node = os.environ.get("NODE_RANK", str(trainer.global_rank))
            Path(out, f"node{node}.json").write_text(json.dumps(
                {"marks": self.marks, "images_per_process": self.images, "world_size": trainer.world_size}))
