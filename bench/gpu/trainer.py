"""`bench gpu --groups trainer`: the template's own training step, timed under a Lightning Trainer.

Each row fits `ImageClassifier` (the optimiser of the arch's recipe, as a CLI fit gets it, fused on CUDA; its
warm-up + cosine schedule; each row names the optimiser it times) with a plain
`pl.Trainer` for `warmup + steps` steps and times the last `steps` (synchronised at both ends): images/s,
the host syncs per step in that window (CUDA's sync debug mode warns at every synchronising call; the
window has no logging step) and the peak memory. The synthetic rows feed one uint8 batch that is already on
the device, normalised as every backend's batch is (the step alone: the ceiling). The ImageFolder rows read
JPEGs decoded by the loader workers (--data.decode cpu), by the GPU alone (--data.decode gpu) or by both,
balanced (--data.cpu_decode_share null), each a share of the synthetic row with the same settings, after a
longer warm-up; then LMDB, packed from the same tree, with each decode; then ImageFolder with each decode and
compile, against the synthetic compile row (fixed shares, 0.4 to 0.7, were no faster than cpu on an H200:
bench/results/gpu-check-h200-decode.md, run 3). The balanced row starts from a share of 0 and the workers have
2 batches each packed ahead, so its share lags the balance by about 2 x workers batches: a short row shows the
start, not where it settles (datamodules/sample/balance.py). `--data-rows decode` runs instead the rows the GPU
decode's goal names, in one call: ImageFolder and LMDB, each with `cpu` and `gpu` (the product's default resize),
without compile and then with it.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from bench.gpu.checks import Check, Workload
from datamodules.sample.decode_report import decode_line
from datamodules.sample.transforms import normalize

GROUP = "trainer"
# (row, precision, channels_last, compile)
SYNTHETIC = (("16-mixed", "16-mixed", False, False),
             ("bf16-mixed", "bf16-mixed", False, False),
             ("16-mixed + channels_last", "16-mixed", True, False),
             ("16-mixed + channels_last + compile", "16-mixed", True, True))
# (row, the data module's decode arguments, and for --data.decode gpu how the decode thread resizes: "script", one
# TorchScript call without the GIL, or "eager", Python op by op: datamodules/sample/device_resize.py); each a share
# of the synthetic 16-mixed + channels_last row
GPU = {"decode": "gpu", "cpu_decode_share": 0.0}
IMAGEFOLDER = (("ImageFolder data, decode cpu, 16-mixed + channels_last", {"decode": "cpu"}),
               ("ImageFolder data, decode gpu alone, resize eager, 16-mixed + channels_last",
                {**GPU, "resize": "eager"}),
               ("ImageFolder data, decode gpu alone, resize scripted, 16-mixed + channels_last",
                {**GPU, "resize": "script"}),
               ("ImageFolder data, decode gpu balanced, resize scripted, 16-mixed + channels_last",
                {**GPU, "cpu_decode_share": None, "resize": "script"}))
LMDB = (("LMDB data (packed from the same tree), decode cpu, 16-mixed + channels_last", {"decode": "cpu"}),
        ("LMDB data (packed from the same tree), decode gpu, resize scripted, 16-mixed + channels_last",
         {**GPU, "resize": "script"}))
COMPILED = (("ImageFolder data, decode cpu + compile", {"decode": "cpu"}),
            ("ImageFolder data, decode gpu, resize scripted + compile", {**GPU, "resize": "script"}))
# --data-rows decode: (row, LMDB?, decode arguments, compile); without compile, `cpu` also with every train image
# decoded whole ("region": False, the loader's region_decode: docs/data.md, "Region decode"), beside it
WHOLE = {"decode": "cpu", "region": False}
DECODE_ROWS = tuple((f"{source}, decode {decode}" + (" + compile" if compile else ""), lmdb,
                     {"decode": "cpu"} if decode == "cpu" else dict(WHOLE) if decode == "cpu, whole" else dict(GPU),
                     compile)
                    for compile in (False, True)
                    for source, lmdb in (("ImageFolder data", False), ("LMDB data (packed from the same tree)", True))
                    for decode in (("cpu", "gpu") if compile else ("cpu", "cpu, whole", "gpu")))
DATA_WARMUP = 25  # steps before the data rows' window: workers started, the balance settled
NAMES = [row[0] for row in (*SYNTHETIC, *IMAGEFOLDER, *LMDB, *COMPILED)]
DECODE_NAMES = [row[0] for row in SYNTHETIC if row[0].startswith("16-mixed + channels_last")] + \
    [row[0] for row in DECODE_ROWS]
NUM_CLASSES = 10


class SyntheticData(pl.LightningDataModule):
    """One uint8 batch on the device, `batches` times an epoch, normalised on the device like every backend's."""

    def __init__(self, w: Workload, batches: int) -> None:
        super().__init__()
        self.w, self.batches, self.num_classes = w, batches, NUM_CLASSES

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        size = self.w.image_size
        images = torch.randint(0, 256, (self.w.batch_size, 3, size, size), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, NUM_CLASSES, (self.w.batch_size,), generator=g)
        batch = (images.to(self.w.device), labels.to(self.w.device))
        return DataLoader([batch] * self.batches, batch_size=None)  # each item is a whole batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        return normalize(batch[0]), batch[1]


class StepClock(pl.Callback):
    """Times optimizer steps warmup .. warmup + steps, with their host syncs and the peak memory."""

    def __init__(self, warmup: int, steps: int, cuda: bool = True) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self.seconds: float | None = None
        self.syncs = 0
        self.peak_bytes = 0
        self.optimizer = ""  # the optimiser the fit steps, in words (optimization.described)
        self._caught: list | None = None
        self._catcher: warnings.catch_warnings | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step != self.warmup or self._catcher is not None:
            return
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if trainer.global_step != self.warmup + self.steps or self._catcher is None or self.seconds is not None:
            return
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
        self._catcher.__exit__(None, None, None)
        if self.cuda:  # on a CPU nothing waits for a device: no syncs to count, no device memory
            self.syncs = sum("synchroniz" in str(w.message) for w in self._caught or [])
            self.peak_bytes = torch.cuda.max_memory_allocated()


def fit_rate(w: Workload, datamodule: pl.LightningDataModule, precision: str, channels_last: bool,
             compile: bool, callbacks: list[pl.Callback] | None = None) -> StepClock:
    """A fit of warmup + steps steps of ImageClassifier on `datamodule` (with `callbacks` too); its clock."""
    from lightning_app.module import ImageClassifier
    from lightning_app.optimization import described

    pl.seed_everything(0, verbose=False)
    model = ImageClassifier(arch=w.arch, num_classes=NUM_CLASSES, image_size=w.image_size,
                            global_batch_size=w.batch_size, channels_last=channels_last, compile=compile,
                            pictures=[], warmup_epochs=0.0)
    clock = StepClock(w.warmup, w.steps, cuda=w.device == "cuda")
    trainer = pl.Trainer(accelerator="gpu" if w.device == "cuda" else "cpu", devices=1, precision=precision,
                         max_steps=w.warmup + w.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         log_every_n_steps=10**6, benchmark=True, callbacks=[clock, *(callbacks or [])])
    clock.optimizer = described(model.hparams)
    trainer.fit(model, datamodule=datamodule)
    if clock.seconds is None:
        raise RuntimeError(f"the fit ended after {trainer.global_step} steps, before the timed window closed")
    return clock


def _check(name: str, w: Workload, clock: StepClock, verdict: str) -> Check:
    images_s = w.batch_size * w.steps / clock.seconds
    return Check(GROUP, name, "ok", f"{verdict}; {clock.optimizer}", images_s, f"{images_s:,.0f} img/s",
                 {"optimizer": clock.optimizer, "syncs_per_step": clock.syncs / w.steps,
                  "peak_memory_gib": clock.peak_bytes / 2**30, "batch_size": w.batch_size, "image_size": w.image_size,
                  "steps": w.steps, "warmup": w.warmup})


def trainer_rows(w: Workload, root: Path, num_workers: int, ceiling_only: bool = False,
                 decode_rows: bool = False, keep: Callable[[Check], None] | None = None) -> list[Check]:
    """`_rows`, each row also handed to `keep` as it ends (bench/gpu/command.py saves the rows so far)."""
    _keep[:] = [keep] if keep is not None else []
    try:
        return _rows(w, root, num_workers, ceiling_only, decode_rows)
    finally:
        _keep.clear()


_keep: list[Callable[[Check], None]] = []


def _rows(w: Workload, root: Path, num_workers: int, ceiling_only: bool, decode_rows: bool) -> list[Check]:
    """The synthetic rows (`ceiling_only`: the two the data rows are a share of, with and without compile), then
    ImageFolder (decoded by the workers, by the GPU, by both) and LMDB (each decode) as a share of the first, and
    ImageFolder with each decode and compile as a share of the second (`decode_rows`: DECODE_ROWS instead, the
    synthetic rows as with `ceiling_only`). Each row is printed as it ends (a part stopped at its timeout keeps the
    rows it measured in its log)."""
    synthetic, compiled = "16-mixed + channels_last", "16-mixed + channels_last + compile"

    def synthetic_row(name: str, precision: str, channels_last: bool, compile: bool) -> Check:
        clock = fit_rate(w, SyntheticData(w, w.warmup + w.steps), precision, channels_last, compile)
        if w.device == "cuda":
            torch.cuda.empty_cache()
        return _said(_check(name, w, clock, "synthetic batch on the device: the step alone"))

    ceiling_only = ceiling_only or decode_rows
    checks = [synthetic_row(*row) for row in SYNTHETIC if not ceiling_only or row[0] == synthetic]
    ceiling = next(c.images_s for c in checks if c.name == synthetic)
    if decode_rows:
        rows = [_data_row(w, root, num_workers, name, decode, False, ceiling, synthetic, lmdb=lmdb)
                for name, lmdb, decode, compile in DECODE_ROWS if not compile]
        checks += [synthetic_row(*row) for row in SYNTHETIC if row[0] == compiled]
        ceiling = next(c.images_s for c in checks if c.name == compiled)
        rows += [_data_row(w, root, num_workers, name, decode, True, ceiling, compiled, lmdb=lmdb)
                 for name, lmdb, decode, compile in DECODE_ROWS if compile]
        return checks + rows
    rows = [_data_row(w, root, num_workers, name, decode, False, ceiling, synthetic) for name, decode in IMAGEFOLDER]
    rows += [_data_row(w, root, num_workers, name, decode, False, ceiling, synthetic, lmdb=True)
             for name, decode in LMDB]
    if ceiling_only:  # the compile rows last: the longest to start, and the least asked for
        checks += [synthetic_row(*row) for row in SYNTHETIC if row[0] == compiled]
    ceiling = next(c.images_s for c in checks if c.name == compiled)
    rows += [_data_row(w, root, num_workers, name, decode, True, ceiling, compiled) for name, decode in COMPILED]
    return checks + rows


def _said(row: Check) -> Check:
    for keep in _keep:
        keep(row)
    print(f"trainer: {row.name}: {row.figure}; {row.verdict}", flush=True)
    return row


def _data_row(w: Workload, root: Path, num_workers: int, name: str, decode: dict, compile: bool, ceiling: float,
              synthetic: str, lmdb: bool = False) -> Check:
    from datamodules import ImageFolderDataModule, LMDBDataModule

    data_w = replace(w, warmup=max(w.warmup, DATA_WARMUP))
    # LMDBDataModule packs the tree into its cache the first time (in setup, before any timed step)
    module = LMDBDataModule if lmdb else ImageFolderDataModule
    decode = dict(decode)
    resize = decode.pop("resize", None)
    region = decode.pop("region", True)
    data = module(data_dir=str(root), batch_size=w.batch_size, num_workers=num_workers, image_size=w.image_size,
                  pin_memory=True, persistent_workers=True, **decode)
    data.region_decode = region
    before = os.environ.get("FIC_DEVICE_RESIZE")
    if resize is not None:  # else the product's default
        os.environ["FIC_DEVICE_RESIZE"] = resize
    try:
        clock = fit_rate(data_w, data, "16-mixed", True, compile)
    finally:
        if before is None:
            os.environ.pop("FIC_DEVICE_RESIZE", None)
        else:
            os.environ["FIC_DEVICE_RESIZE"] = before
    flags = " ".join(f"--data.{k} {'null' if v is None else v}" for k, v in decode.items())
    flags += f" (resize {resize})" if resize else ""
    flags += "" if region else " (region decode off)"
    row = _check(name, data_w, clock, f"{num_workers} loader workers, {flags}; share of the synthetic {synthetic} row")
    region = getattr(data.datasets.get("train"), "decode_counts", None)  # the train images by region and whole
    if region is not None and region.line():
        row.extra["region_decode"] = region.line()
        row.verdict += f"; {row.extra['region_decode']}"
    counts = {split: dict(d.counts) for split, d in data.device_decoders.items()}
    if counts:
        row.extra["decoded"] = counts
        row.extra["decode_line"] = decode_line(data.device_decoders)
        row.verdict += f"; {row.extra['decode_line']}"
    row.figure += f" ({row.images_s / ceiling:.0%} of the synthetic step)"
    row.extra["share_of_synthetic"] = row.images_s / ceiling
    row.extra["decode_args"] = decode
    del data
    if w.device == "cuda":
        torch.cuda.empty_cache()
    return _said(row)
