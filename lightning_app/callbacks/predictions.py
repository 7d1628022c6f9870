"""`predict` writes predictions.csv: path, class, prob, then the top-5 names and probabilities.

A Lightning BasePredictionWriter. Every rank streams its rows (batch by batch, so memory stays
flat) into its own part file, made visible by an atomic rename when its share is done. After a
barrier rank 0 merges the parts into predictions.csv (temp file + os.replace), one row per
image in dataset order, keyed by the dataset index: rows are never duplicated even if a sampler
pads a shard, and a missing index is reported. Lightning predicts with an unpadded
UnrepeatedDistributedSamplerWrapper under DDP (trainer/connectors/data_connector.py,
_get_distributed_sampler), so every index comes exactly once in practice.

Where the other ranks cannot see the folder rank 0 writes into (node-local disks), found before any
inference (prediction_rows.shared_by_every_rank), their rows go to rank 0 as objects every few
batches and rank 0 writes every part file itself: the merge reads only rank 0's disk.

The file goes to `trainer.log_dir`: each predict has its own folder, `<run>/predict_K`
(lightning_app/runs/plan.py), or `trainer.default_root_dir` when there is no logger. One line says
what is predicted and where the file goes. File names are written as the filesystem gives them: a
name that is not UTF-8 keeps its bytes (Python's surrogateescape), so every image gets its row.
"""
from __future__ import annotations

import contextlib
import csv
import glob
import os
import warnings

import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.callbacks.prediction_rows import GATHER_EVERY, RowGather, shared_by_every_rank
from lightning_app.runs.folders import PREDICTIONS_CSV

FILENAME = PREDICTIONS_CSV  # the name lives in runs/, which finds an evaluation's result by it
TOP_K = 5
TEXT = {"encoding": "utf-8", "errors": "surrogateescape", "newline": ""}  # any file name round-trips


def columns(k: int) -> list[str]:
    return ["path", "class", "prob"] + [f"top{j}_{c}" for j in range(1, k + 1) for c in ("class", "prob")]


def _dataset(trainer: pl.Trainer):
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return getattr(loader, "dataset", None)


def _path(dataset, i: int) -> str:
    if hasattr(dataset, "display_path"):
        return dataset.display_path(i)
    if hasattr(dataset, "path"):
        return str(dataset.path(i))
    if hasattr(dataset, "index") and hasattr(dataset.index, "path"):
        return str(dataset.index.path(i))
    return str(i)


def _what(dataset, trainer) -> str:
    """What is predicted, in a few words: the folder given, or the split the data module falls back to."""
    count = f"{len(dataset)} images" if hasattr(dataset, "__len__") else "the images"
    if hasattr(dataset, "given_root"):
        return f"{count} under {dataset.given_root}"
    root = getattr(trainer.datamodule, "root", None) or getattr(trainer.datamodule, "data_dir", None)
    return f"{count} of the val split of {root} (no --data.predict_dir given)"


class PredictionsCSV(BasePredictionWriter):
    def __init__(self, filename: str = FILENAME, gather_every: int = GATHER_EVERY) -> None:
        super().__init__(write_interval="batch")
        self.filename = filename
        self.gather_every = gather_every
        self.out_dir: str | None = None
        self._rank = 0
        self._files: dict = {}
        self._writers: dict = {}
        self._gather: RowGather | None = None

    def _part(self, rank: int, done: bool) -> str:
        return os.path.join(self.out_dir, f".{self.filename}.rank{rank}" + (".part" if done else ".tmp"))

    def on_predict_start(self, trainer, pl_module) -> None:
        log_dir = trainer.log_dir  # a broadcast from rank 0 under DDP: every rank calls it here
        self.out_dir = log_dir or trainer.default_root_dir
        rank = self._rank = trainer.global_rank
        if rank == 0:  # the other ranks make nothing: on a node-local disk it would be a folder of their own
            os.makedirs(self.out_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(self.out_dir, f".{self.filename}.rank*")):
                os.remove(stale)
        shared = shared_by_every_rank(trainer.strategy, self.out_dir)  # after the clean-up: it has a barrier
        self._gather = None if shared else RowGather(self.gather_every, self._write_rows)
        self._dataset = _dataset(trainer)
        self._from_batch = getattr(self._dataset, "items_carry_index", False)
        self._names = list(getattr(pl_module, "class_names", []) or [])
        self._seen, self._synthetic = 0, False
        writes = [rank] if shared else range(trainer.world_size) if rank == 0 else []  # whose part files
        self._files = {r: open(self._part(r, done=False), "w", **TEXT) for r in writes}  # noqa: SIM115 - closed in on_predict_end
        self._writers = {r: csv.writer(f) for r, f in self._files.items()}
        with_ckpt = f" with {trainer.ckpt_path}" if trainer.ckpt_path else ""
        rank_zero_info(f"predict: {_what(self._dataset, trainer)}{with_ckpt} -> "
                       f"{os.path.join(self.out_dir, self.filename)}")
        if not shared:
            rank_zero_info(f"predict: {self.out_dir} is not shared by every rank (a node-local disk on each node?): "
                           f"the other ranks send rank 0 their rows every {self.gather_every} batches and rank 0 "
                           "writes the file alone.")

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        probs = prediction.detach().float().cpu()
        if self._from_batch:
            indices = [int(i) for i in batch[1]]  # the dataset's own index; -1 - i marks a file that failed to decode
        elif batch_indices:
            indices = [int(i) for i in batch_indices]
        else:  # a loader that is no DataLoader (DALI's val split): number the rows by rank and order seen
            start = (trainer.global_rank << 32) + self._seen
            indices = list(range(start, start + probs.shape[0]))
            self._synthetic = True
        self._seen += probs.shape[0]
        k = min(TOP_K, probs.shape[1])
        top_p, top_i = probs.topk(k, dim=1)
        names = self._names if len(self._names) == probs.shape[1] else [str(c) for c in range(probs.shape[1])]
        rows = []
        for row, index in enumerate(indices):
            if index < 0:
                rows.append([-1 - index, _path(self._dataset, -1 - index), "", "failed to decode"])
                continue
            top = [x for j in range(k) for x in (names[int(top_i[row, j])], f"{float(top_p[row, j]):.6f}")]
            rows.append([index, _path(self._dataset, index), *top[:2], *top])
        if self._gather is not None:
            self._gather.add(rows)
        else:
            self._write_rows(trainer.global_rank, rows)

    def _write_rows(self, rank: int, rows: list) -> None:
        self._writers[rank].writerows(rows)

    def on_predict_end(self, trainer, pl_module) -> None:
        if self._gather is not None:
            self._gather.finish()
        for rank, file in self._files.items():
            file.close()
            os.replace(self._part(rank, done=False), self._part(rank, done=True))
        trainer.strategy.barrier("predictions_csv_merge")
        if trainer.global_rank == 0:
            known = self._dataset is not None and hasattr(self._dataset, "__len__") and not self._synthetic
            # a stream's len() is this rank's share; it says how many items all ranks hold as `total_items`
            total = getattr(self._dataset, "total_items", None) or (len(self._dataset) if known else None)
            self.merge(trainer.world_size, total if known else None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A predict stopped (a stop signal, a lost peer, a full disk): its part files go, and no predictions.csv is
        made; the folder stays without it."""
        for file in self._files.values():
            file.close()
        self.discard_unfinished()

    def discard_unfinished(self) -> None:
        """Removes the part files this process writes and its merge's temp file; rank 0, the one that merges, every
        rank's part files, as it does at start. Only unlinks (the second Ctrl-C calls it from a signal handler,
        maybe inside a write: callbacks/stop_signals.py)."""
        if self.out_dir is None:
            return
        mine = [self._part(rank, done) for rank in self._files for done in (False, True)] + [self._merge_tmp()]
        if self._rank == 0:
            mine += glob.glob(os.path.join(self.out_dir, f".{self.filename}.rank*"))
        for path in mine:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _merge_tmp(self) -> str:
        return os.path.join(self.out_dir, self.filename) + f".tmp{os.getpid()}"

    def merge(self, world_size: int, expected: int | None) -> str:
        rows: dict[int, list[str]] = {}
        failed: dict[int, str] = {}
        for rank in range(world_size):
            with open(self._part(rank, done=True), **TEXT) as f:
                for record in csv.reader(f):
                    index = int(record[0])
                    if record[2] == "":
                        failed[index] = record[1]
                    else:
                        rows.setdefault(index, record[1:])  # a padded duplicate keeps the first copy
        k = max(((len(r) - 3) // 2 for r in rows.values()), default=TOP_K)
        out = os.path.join(self.out_dir, self.filename)
        tmp = self._merge_tmp()
        with open(tmp, "w", **TEXT) as f:
            writer = csv.writer(f)
            writer.writerow(columns(k))
            for index in sorted(rows):
                writer.writerow(rows[index])
        os.replace(tmp, out)
        for rank in range(world_size):
            os.remove(self._part(rank, done=True))
        # files the dataset's check found bad were listed once already, when the dataset was made
        skipped = [(p, "failed to decode") for p in failed.values()]
        if skipped:
            warnings.warn(f"predict: {len(skipped)} file(s) skipped: "
                          + "; ".join(f"{p} ({why})" for p, why in skipped[:20]), stacklevel=2)
        if expected is not None and len(rows) + len(failed) != expected:
            missing = sorted(set(range(expected)) - set(rows) - set(failed))
            warnings.warn(f"predict: {len(missing)} image(s) got no prediction (dataset indices {missing[:10]}).",
                          stacklevel=2)
        rank_zero_info(f"predict: wrote {len(rows)} rows to {out}")
        return out
