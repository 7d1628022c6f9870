"""`bench loaders`: images/s and MB/s of every data backend's real train pipeline, cold and warm,
with the bottleneck named.

Each backend is a row. A backend whose module is not importable, or that cannot run here
(DALI GPU without CUDA), stays in the table as skipped with the reason; one that fails is
listed as failed with the error. Packing (LMDB) and downscaling happen before the clock.

The backends are made ready in `backends.py`; the table and chart are written by `report.py`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import tqdm  # tqdm.tqdm looked up per bar: bench/progress_bars.py puts a quiet one in its place

from bench.loaders import ceilings, paired
from bench.loaders.backends import BACKENDS, FACTORIES, LABELS
from bench.loaders.cpu_time import CpuClock, worker_pids
from bench.loaders.prepared import Prepared, Settings, Skip
from bench.loaders.report import classify, fastest_decode
from datamodules.index import load_indexes

# Decode-only ceilings are measured with every decoder the backends use, on every image set:
# "pil" = datamodules.sample.images.decode_rgb; "torchvision" = datamodules.sample.decode.decode (libjpeg-turbo
# through torchvision.io for plain JPEGs, PIL for the rest: the shared sample path's decoder).
DECODERS = ("pil", "torchvision")


@dataclass
class Row:
    backend: str
    cache: str
    status: str = "ok"          # ok | skipped | failed
    reason: str = ""
    images_s: float | None = None
    mb_s: float | None = None
    io_frac: float | None = None
    decode_frac: float | None = None
    pil_frac: float | None = None
    bottleneck: str | None = None
    images: int = 0
    seconds: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ timing

def to_device(batch: Any, device: torch.device) -> Any:
    """The tensors of a batch (nested in lists, tuples and dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _count(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim == 4 else 0
    if isinstance(batch, (list, tuple)):
        return next((n for n in map(_count, batch) if n), 0) if not all(isinstance(b, dict) for b in batch) \
            else sum(_count(b) for b in batch)
    if isinstance(batch, dict):
        return next((n for n in map(_count, batch.values()) if n), 0)
    return 0


def time_epoch(dm, loader, device: torch.device, max_batches: int | None, desc: str
               ) -> tuple[int, float, float | None]:
    """One epoch of ``loader`` (the backend's train_dataloader(), made once as Lightning does) as training
    iterates it, up to the batch on the device. Returns (images, seconds, CPU seconds of this process and the
    loader's persistent workers, or None where they are not known: cpu_time.py).

    The DataModule's on_after_batch_transfer (uint8 -> normalised float) is the first operation of the
    model step, on the training device: on a GPU it is nearly free, and on a CPU-only machine it would
    charge the loader with work the decode-only ceilings do not contain. `normalize_cost` times it apart.
    """
    try:
        total = len(loader)
    except TypeError:
        total = None
    if max_batches:
        total = min(total, max_batches) if total else max_batches
    images = 0
    cpu = CpuClock(worker_pids(loader))
    t0 = time.perf_counter()
    with tqdm.tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True) as bar:
        for i, batch in enumerate(loader):
            batch = to_device(batch, device)
            images += _count(batch)
            bar.update(1)
            if max_batches and i + 1 >= max_batches:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images, time.perf_counter() - t0, cpu.seconds()


def normalize_cost(batch_size: int, image_size: int, device: torch.device, repeats: int = 7) -> dict:
    """Milliseconds the device-side normalisation (datamodules.sample.transforms.normalize) takes per batch."""
    from datamodules.sample.transforms import normalize

    images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, device=device)
    images = images.contiguous(memory_format=torch.channels_last)  # what the sample path delivers
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        normalize(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    ms = 1000 * statistics.median(times[1:])
    return {"ms_per_batch": ms, "images_s": batch_size / ms * 1000, "threads": torch.get_num_threads()}


def prepare(loader: Any) -> None:
    """Build a DALI loader's pipeline (threads started, nvJPEG buffers allocated) before any clock.

    A DALI loader cannot be stopped mid-epoch and reset cleanly, so it is built, not run.
    """
    if callable(getattr(loader, "prepare", None)):
        loader.prepare()


def _warm_up(dm, loader, device: torch.device, max_batches: int | None, label: str) -> None:
    """Start the workers with one whole untimed epoch, so cold and warm differ only in the cache.

    A whole epoch, not one batch: an abandoned epoch's prefetched batches (prefetch_factor per
    worker) are still built, and discarded, at the start of the next one, which would charge the
    cold epoch with them.
    """
    from torch.utils.data import DataLoader

    prepare(loader)
    if isinstance(loader, DataLoader) and loader.persistent_workers:
        time_epoch(dm, loader, device, max_batches, f"{label} start")


def shutdown(dm: Any) -> None:
    """Free the persistent workers (and DALI pipelines) before the next backend is timed."""
    for name in ("teardown",):
        try:
            getattr(dm, name)("fit")
        except Exception:  # noqa: BLE001, S110 - best effort
            pass


def close(loader: Any) -> None:
    """Stop a torch DataLoader's persistent workers now rather than whenever it is garbage-collected."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _time_round(p: Prepared, settings: Settings, device: torch.device, label: str) -> tuple[dict, str]:
    """One round of one backend: a fresh train_dataloader(), a cold epoch, then the warm epochs.
    Returns ({cache: (images, seconds)}, how the cache was evicted)."""
    loader = p.datamodule.train_dataloader()
    try:
        _warm_up(p.datamodule, loader, device, settings.max_batches, label)
        evict_how = p.evict() if p.evict else ceilings.evict_pages(p.files, settings.drop_caches)
        out = {"cold": time_epoch(p.datamodule, loader, device, settings.max_batches, f"{label} cold")}
        images, seconds, cpu = 0, 0.0, 0.0
        for _ in range(max(1, settings.warm_epochs)):
            n, dt, cpu_s = time_epoch(p.datamodule, loader, device, settings.max_batches, f"{label} warm")
            images, seconds = images + n, seconds + dt
            cpu = None if cpu is None or cpu_s is None else cpu + cpu_s
        out["warm"] = (images, seconds, cpu)
        return out, evict_how
    finally:
        close(loader)
        shutdown(p.datamodule)


def measure(settings: Settings, backends: list[str], measure_ceilings: bool = True,
            ceiling_images: int = 2000) -> dict[str, Any]:
    """`_measure`, and then whatever the backends started (the S3 row's local server) is stopped."""
    opened: list[Prepared] = []
    try:
        return _measure(settings, backends, measure_ceilings, ceiling_images, opened)
    finally:
        for p in opened:
            if p.close is not None:
                p.close()


def _region_whole(dm: Any) -> list[int] | None:
    """Train images decoded by region and whole over the whole run (datamodules/sample/region.py), if counted."""
    counts = getattr((getattr(dm, "datasets", None) or {}).get("train"), "decode_counts", None)
    return counts.table.sum(0).tolist() if counts is not None else None


def _measure(settings: Settings, backends: list[str], measure_ceilings: bool, ceiling_images: int,
             opened: list[Prepared]) -> dict[str, Any]:
    """Time every backend in ``BACKENDS`` (those not in ``backends`` become 'not selected' rows).

    Every backend is prepared first (packing, downscaling); then ``settings.rounds`` rounds time
    each backend in turn, and each row is the median round, so a slow spell of the machine
    touches every backend alike instead of one.
    """
    device = torch.device(settings.device)
    index = load_indexes(settings.root)["train"]
    tree = [index.path(i) for i in range(len(index))]
    # The tree's ceilings are always measured: they are the machine's, whichever rows ran.
    storages: dict[str, list[str]] = {"tree": tree}
    image_sets: dict[str, list[str]] = {"original": tree}  # key -> encoded image files
    evict_how = None
    outcome: dict[str, Any] = {}   # label -> Prepared, or the (status, reason) of a backend that cannot run
    for name in BACKENDS:
        label = LABELS[name]
        if name not in backends:
            outcome[label] = ("skipped", "not selected (--backends)")
            continue
        try:
            p = FACTORIES[name](settings)
        except Skip as e:
            outcome[label] = ("skipped", str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a broken backend is a row that says why
            outcome[label] = ("failed", f"{type(e).__name__}: {e}")
            continue
        outcome[label] = p
        opened.append(p)
        storages.setdefault(p.storage, p.io_ceiling or p.files)
        if p.storage != "lmdb":
            image_sets.setdefault(p.images, p.files)

    timings: dict[str, list[dict]] = {label: [] for label, p in outcome.items() if isinstance(p, Prepared)}
    decode_jobs = [(k, d, c) for k, files in image_sets.items() if files for d in DECODERS for c in ("warm", "cold")]
    decode_rounds: dict[tuple[str, str, str], list[dict]] = {job: [] for job in decode_jobs}
    for _ in tqdm.tqdm(range(max(1, settings.rounds)), desc="rounds", unit="round", leave=False):
        # The decode ceilings are timed in every round too, next to the rows they are compared with.
        for key, decoder, cache in decode_jobs if measure_ceilings else []:
            files = image_sets[key]
            sample = files[:: max(1, len(files) // ceiling_images)][:ceiling_images]
            rate = ceilings.decode_rate(sample, decoder=decoder, cold=cache == "cold", drop_caches=settings.drop_caches)
            decode_rounds[(key, decoder, cache)].append(rate.as_dict())
        for label, runs in timings.items():
            p = outcome[label]
            if not isinstance(p, Prepared):
                continue  # failed in an earlier round
            try:
                got, evict_how = _time_round(p, settings, device, label)
                runs.append(got)
            except Exception as e:  # noqa: BLE001
                outcome[label] = ("failed", f"{type(e).__name__}: {e}")

    rows: list[Row] = []
    for label, p in outcome.items():
        if not isinstance(p, Prepared):
            rows += [Row(label, c, p[0], p[1]) for c in ("cold", "warm")]
            continue
        for cache in ("cold", "warm"):
            rounds = [(n, dt, n / max(dt, 1e-9)) for n, dt, _ in (t[cache] for t in timings[label])]
            images, seconds, ips = sorted(rounds, key=lambda r: r[2])[len(rounds) // 2]  # the median round
            rows.append(Row(label, cache, images=images, seconds=seconds, images_s=ips,
                            mb_s=ips * p.image_bytes / 1e6, note=p.note,
                            extra={"storage": p.storage, "images_key": p.images, "gpu_decode": p.gpu_decode,
                                   "rounds_images_s": [round(r[2], 1) for r in rounds],
                                   "rounds_cpu_us": paired.cpu_us(t[cache] for t in timings[label]),
                                   "region_whole": _region_whole(p.datamodule)}))

    # ceilings: io[storage] (cold reads); decode[images][decoder][cache] (all cores, every decoder, cold and warm)
    ceil: dict[str, dict] = {"io": {}, "decode": {}}
    if measure_ceilings:
        for key, files in tqdm.tqdm(list(storages.items()), desc="IO ceilings", leave=False):
            rate = files() if callable(files) else ceilings.read_rate(files, drop_caches=settings.drop_caches)
            ceil["io"][key] = rate.as_dict()
        for (key, decoder, cache), rates in decode_rounds.items():
            rate = dict(sorted(rates, key=lambda r: r["images_s"])[len(rates) // 2])  # the median round
            rate["rounds_images_s"] = [round(r["images_s"], 1) for r in rates]
            ceil["decode"].setdefault(key, {}).setdefault(decoder, {})[cache] = rate
        ceil["stages_us"] = ceilings.stage_times(tree[:: max(1, len(tree) // 100)][:100], settings.image_size,
                                                  settings.min_scale)
        ceil["normalize"] = normalize_cost(settings.batch_size, settings.image_size, device)
        if isinstance(outcome.get(LABELS["dali-cpu"]), Prepared):
            from bench.loaders.dali_stages import dali_stage_rates

            ceil["dali_stages"] = dali_stage_rates(tree, settings.image_size, batch_size=settings.batch_size)
    pil = ceil["decode"].get("original", {}).get("pil", {}).get("warm", {}).get("images_s")
    for r in rows:
        if r.status != "ok":
            continue
        io = ceil["io"].get(r.extra["storage"], {}).get("mb_s") if r.cache == "cold" else None
        dec = fastest_decode(ceil, r.extra["images_key"])
        r.bottleneck, r.io_frac, r.decode_frac = classify(r.images_s, r.mb_s, io, dec, r.extra["gpu_decode"])
        if pil and not r.extra["gpu_decode"] and r.extra["images_key"] == "original":
            r.pil_frac = r.images_s / pil
    return {"rows": [r.__dict__ for r in rows], "ceilings": ceil, "eviction": evict_how or "none",
            "paired": paired.ratios(rows, decode_rounds) if measure_ceilings else [],
            "settings": {k: str(v) for k, v in settings.__dict__.items()}}
