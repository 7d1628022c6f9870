"""The data rows of `bench gpu`: each backend's training throughput, and DALI `mixed` against DALI CPU.

A backend row is throughput, not start-up: its train_dataloader() (workers started, DALI pipelines
built) feeds the ceiling's training step as one stream of batches across epochs, as a fit does with
persistent workers; `warmup` batches run untimed, then `steps` batches are timed between two device
syncs. The built-in data are made large enough for the timed batches to fit in one epoch
(`batches_needed`), so an epoch's restart does not dominate.

The DALI pixel row streams: both pipelines' validation batches are compared pair by pair and only the
running sums and a 256-bin histogram of the differences are kept (not the validation set: ImageNet's is
over 100 GB as floats).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bench.gpu.checks import Check, TrainStep, Workload, cudnn_flags, fastest_precision, make_model, sync
from bench.loaders.backends import BACKENDS, FACTORIES, LABELS
from bench.loaders.prepared import Settings, Skip
from bench.loaders.timing import close, prepare, shutdown, to_device

DALI_TOLERANCE = 2.0  # mean |mixed - cpu| in grey levels: nvJPEG's and libjpeg-turbo's IDCTs differ slightly, and
# CPU decoding resizes on the host with torchvision's geometry where mixed resizes in DALI (1.5 grey levels on CPU:
# tests/test_dali.py)
NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False)"


def batches_needed(w: Workload) -> int:
    return w.warmup + w.steps


def stream(loader) -> Iterator:
    """The loader's batches, epoch after epoch (a fit's persistent workers carry on across epochs)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the loader yields no batch: the dataset is smaller than one batch")


def timed_stream(batches: Iterator, step, w: Workload) -> tuple[int, float]:
    """(images, seconds) of `w.steps` batches through `step(batch) -> images`, after `w.warmup` untimed."""
    for _ in range(w.warmup):
        step(next(batches))
    sync(w.device)
    t0, images = time.perf_counter(), 0
    for _ in range(w.steps):
        images += step(next(batches))
    sync(w.device)
    return images, time.perf_counter() - t0


def train_through(dm, w: Workload) -> float:
    """Training images/s through a backend's train_dataloader(): to the device, on_after_batch_transfer,
    then the ceiling's training step (the fastest precision, channels_last)."""
    device = torch.device(w.device)
    loader = dm.train_dataloader()
    prepare(loader)
    try:
        with cudnn_flags(benchmark=device.type == "cuda"):
            train = TrainStep(make_model(w, num_classes=dm.num_classes), fastest_precision(w), channels_last=True)

            def step(batch) -> int:
                x, y = dm.on_after_batch_transfer(to_device(batch, device), 0)
                train(x, y)
                return int(x.shape[0])

            images, seconds = timed_stream(stream(loader), step, w)
    finally:
        close(loader)  # stop a DataLoader's persistent workers before the next backend
    return images / max(seconds, 1e-9)


DEVICE_DECODE = ("imagefolder", "lmdb", "downscaled")  # the backends --data.decode gpu applies to


def backend_rows(args, w: Workload, root: Path, ceiling: float | None) -> list[Check]:
    """Each backend as its loader workers decode, then (ImageFolder, LMDB, downscaled) as the GPU decodes."""
    wanted = [b.strip() for b in (args.backends or ",".join(BACKENDS)).split(",") if b.strip()]
    work = Path("bench/out/work") / root.name
    work.mkdir(parents=True, exist_ok=True)
    runs = [(name, "cpu") for name in BACKENDS] + [(name, "gpu") for name in DEVICE_DECODE]
    rows = []
    for name, decode in runs:
        row = Check("backend", LABELS[name] + (", decode gpu" if decode == "gpu" else ""))
        rows.append(row)
        if name not in wanted:
            row.status, row.verdict = "skipped", "not selected (--backends)"
            continue
        s = Settings(root=root, work=work, batch_size=w.batch_size, num_workers=args.num_workers,
                     image_size=w.image_size, max_batches=None, device=w.device, decode=decode)
        try:
            prepared = FACTORIES[name](s)
        except Skip as e:
            row.status, row.verdict = "skipped", str(e)
            continue
        except Exception as e:  # noqa: BLE001 - a backend that cannot start is a FAIL row with its error
            row.status, row.verdict = "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            with prepared:  # then stops what the backend started (the S3 row's moto_server)
                try:
                    row.images_s = train_through(prepared.datamodule, w)
                    decoders = getattr(prepared.datamodule, "device_decoders", {})
                    if decoders:
                        row.extra["decoded"] = {split: dict(d.counts) for split, d in decoders.items()}
                finally:
                    shutdown(prepared.datamodule)
        except Exception as e:  # noqa: BLE001
            row.status, row.verdict = "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
            continue
        share = row.images_s / ceiling if ceiling else None
        row.extra["share"] = share
        row.verdict = (f"end-to-end training, {w.steps} batches timed after {w.warmup}, {args.num_workers} workers, "
                       f"--data.decode {decode}" + (f"; {prepared.note}" if prepared.note else ""))
        row.figure = f"{row.images_s:,.0f} img/s" + (f", {share:.0%} of the ceiling" if share else "")
    return rows


class DiffStats:
    """Mean and 99th percentile of |a - b| in grey levels, from running sums and a 0..255 histogram."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0
        self.hist = np.zeros(256, dtype=np.int64)

    def add(self, diff: torch.Tensor) -> None:
        self.total += float(diff.sum())
        self.count += diff.numel()
        self.hist += torch.histc(diff.float().clamp(0, 255), bins=256, min=0, max=256).long().cpu().numpy()

    @property
    def mean(self) -> float:
        return self.total / max(1, self.count)

    def quantile(self, q: float) -> float:
        cumulative = np.cumsum(self.hist)
        return float(np.searchsorted(cumulative, q * cumulative[-1])) if cumulative[-1] else 0.0


def dali_rows(args, w: Workload, root: Path) -> list[Check]:
    """DALI mixed: validation pixels against DALI CPU, then images/s with and without the hardware decoder."""
    names = ["DALI mixed vs CPU pixels", "DALI mixed, hw_decoder_load 0.65", "DALI mixed, hw_decoder_load 0"]
    if w.device != "cuda":
        return [Check("DALI mixed", n, "skipped", NO_CUDA) for n in names]
    try:
        from datamodules.dali.datamodule import DALIDataModule, require_dali

        require_dali()
    except Exception as e:  # noqa: BLE001 - DataError with the install hint
        return [Check("DALI mixed", n, "skipped", str(e).splitlines()[0]) for n in names]
    from datamodules.sample.transforms import IMAGENET_STD

    common = {"data_dir": str(root), "batch_size": w.batch_size, "image_size": w.image_size,
              "val_image_size": w.image_size}
    mods = {d: DALIDataModule(dali_device=d, **common) for d in ("gpu", "cpu")}
    std = torch.tensor(IMAGENET_STD, device="cuda").view(1, 3, 1, 1) * 255
    stats, same_labels, images = DiffStats(), True, 0
    for dm in mods.values():
        dm.setup("fit")
    try:  # the same validation order on both: pair by pair, nothing kept but the statistics
        for (xg, yg), (xc, yc) in zip(mods["gpu"].val_dataloader(), mods["cpu"].val_dataloader(), strict=False):
            xg, yg = mods["gpu"].on_after_batch_transfer((xg.cuda(), yg.cuda()), 0)
            xc, yc = mods["cpu"].on_after_batch_transfer((xc.cuda(), yc.cuda()), 0)
            stats.add(((xg.float() - xc.float()) * std).abs())
            same_labels = same_labels and torch.equal(yg, yc)
            images += len(yg)
    finally:
        for dm in mods.values():
            dm.teardown()
    ok = same_labels and images > 0 and stats.mean <= DALI_TOLERANCE
    rows = [Check("DALI mixed", names[0], "ok" if ok else "FAIL",
                  f"{images} val images: mean |mixed - cpu| {stats.mean:.2f} grey levels (tolerance {DALI_TOLERANCE}), "
                  f"99th percentile {stats.quantile(0.99):.0f}; labels equal: {same_labels}",
                  figure=f"{stats.mean:.2f} grey levels")]
    for name, load in zip(names[1:], (0.65, 0.0), strict=False):
        dm = DALIDataModule(dali_device="gpu", hw_decoder_load=load, **common)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.prepare()
        try:
            count, seconds = timed_stream(stream(loader), lambda batch: int(batch[0].shape[0]), w)
        finally:
            dm.teardown()
        ips = count / max(seconds, 1e-9)
        rows.append(Check("DALI mixed", name, "ok", f"train pipeline only (decode, crop, flip, normalise), "
                          f"{w.steps} batches timed after {w.warmup}, {dm.pipeline_threads()} threads; "
                          "load = the share of JPEGs given to the hardware decoder (A100/H100/H200; ignored where "
                          "there is none)", ips,
                          f"{ips:,.0f} img/s"))
    hw, sw = rows[1].images_s, rows[2].images_s
    rows[1].figure += f", {hw / sw:.2f}x software-only" if sw else ""
    return rows
