"""How big a rank's loaders are: its CPUs (who bound them) and the memory its batches in flight hold.

Mixed into ImageDataModule, which supplies `trainer`, `num_workers`, `batch_size`, the image sizes,
`budget`, `pins_memory` and `datasets`. The sizing itself is `datamodules.budget.cpus` and `datamodules.budget.memory`;
`python -m bench memory` calls the same `memory_plan` for a layout it is told.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from datamodules.budget.cpus import CpuShare, cpu_share
from datamodules.budget.memory import Budget, MemoryPlan, plan_memory
from datamodules.processes.start import DEFAULT_START


@dataclass(frozen=True)
class Layout:
    """Where a rank runs: `world` training processes in all, `ranks_per_node` on its node, `cpus` its CPUs,
    `cuda` whether batches go to a GPU (pinned), `fit` whether a train loader runs beside validation."""

    world: int
    ranks_per_node: int
    cpus: int
    cuda: bool
    fit: bool = True


class LoaderSizing:
    """CPUs, workers and the memory plan of one training process (see the module doc)."""

    _plan_shown = False

    def workers(self) -> int:
        """num_workers, with "auto" resolved: this process's CPUs (`cpus()`), before the memory budget.

        One worker process per CPU: decoding is CPU work, and separate processes keep the Python
        parts of every sample off one GIL. Inside a worker, sample.SAMPLE_THREADS threads overlap
        file reads so a cold cache does not leave a CPU idle, and decode side by side only when the
        worker has more than one CPU to itself (`SampleDataset.decode_threads`). The memory plan may
        run fewer (`memory_plan()`).
        """
        if self.num_workers != "auto":
            return int(self.num_workers)
        return self.cpus()

    def ranks_per_node(self) -> int:
        """Training processes on this node: devices under DDP, but one under dp (world_size 1, N devices)."""
        trainer = self.trainer
        return max(1, trainer.world_size // max(1, trainer.num_nodes)) if trainer is not None else 1

    def cpu_share(self) -> CpuShare:
        """This process's CPUs: its whole per-task mask under srun, else its share (datamodules/budget/cpus.py)."""
        return cpu_share(self.ranks_per_node())

    def cpus(self) -> int:
        return self.cpu_share().cpus

    def resident_bytes(self) -> int:
        """Bytes this process holds in shared memory for all its workers: a dataset held in RAM (an in-memory copy),
        and under forkserver or spawn the Indexes' arrays and the labels (datamodules/index.py, `shared_arrays`)."""
        held = sum(int(getattr(getattr(d, "source", None), "nbytes", 0) or 0) for d in self.datasets.values())
        if getattr(self, "worker_start", "fork") != "fork":
            held += sum(index.names.nbytes + index.name_ends.nbytes + index.label_array.nbytes + 8 * len(index)
                        for index in getattr(self, "indexes", {}).values())
        return held

    def layout(self, fit: bool | None = None) -> Layout:
        trainer = self.trainer
        if fit is None:
            fit = trainer is None or trainer.state.fn in (None, "fit")
        on_cuda = trainer.strategy.root_device.type == "cuda" if trainer is not None else torch.cuda.is_available()
        return Layout(world=self.world_size, ranks_per_node=self.ranks_per_node(), cpus=self.cpus(), cuda=on_cuda,
                      fit=fit)

    def memory_plan(self, fit: bool | None = None) -> MemoryPlan:
        """This process's loaders sized to the budget: train (during a fit) and val, at their largest sizes."""
        sizes = [self.train_size, *self.scheduled_train_sizes]
        return self.plan_for(self.hparams, self.layout(fit), sizes, self.resident_bytes())

    @classmethod
    def plan_for(cls, args: Mapping[str, Any], layout: Layout, train_sizes: Sequence[int] = (),
                 resident: int = 0) -> MemoryPlan:
        """The memory plan of a DataModule with init args `args` (defaults filled in) on `layout`.

        `train_sizes`: sizes a schedule adds to `image_size`; `resident`: bytes of a dataset held in RAM.
        Used by the DataModule itself and by `python -m bench memory` (no instance, no data needed).
        """
        image = int(args["image_size"])
        workers = layout.cpus if args.get("num_workers", "auto") == "auto" else int(args["num_workers"])
        budget = Budget.of(args)
        return plan_memory(batch=max(1, int(args["batch_size"]) // layout.world),
                           train_size=max([image, *train_sizes]) if layout.fit else None,
                           val_size=int(args.get("val_image_size") or image), workers=workers,
                           pin=layout.cuda and bool(args.get("pin_memory", True)), budget=budget, resident=resident,
                           worker_start=args.get("worker_start", DEFAULT_START))

    def describe_worker_start(self) -> str:
        """How its loader workers start (--data.worker_start, datamodules/processes/start.py), for the start-up line."""
        return f"workers start by {self.worker_start}"

    def _show_plan(self, plan: MemoryPlan) -> None:
        """The start-up line, once: CPUs (and who bound them), then memory per rank against its budget."""
        if self._plan_shown:
            return
        self._plan_shown = True
        share = self.cpu_share()
        cpus = f"{share.cpus} CPU{'' if share.cpus == 1 else 's'}"
        rank_zero_info(f"Data: {type(self).__name__}, {self.describe_worker_start()}, {cpus} per rank: "
                       f"{share.describe()}. "
                       + plan.describe())
        over = plan.over_budget()
        if over:
            rank_zero_warn("the loaders of each rank need more memory than data.*_budget_gib allow "
                           f"({'; '.join(over)}); "
                           "lower data.batch_size or data.num_workers, or raise the budget.")
