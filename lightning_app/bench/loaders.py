"""`bench loaders`: images/s and MB/s of every data backend's real train pipeline, cold and warm,
with the bottleneck named.

Each backend is a row. A backend whose module is not importable, or that cannot run here
(DALI GPU without CUDA), stays in the table as skipped with the reason; one that fails is
listed as failed with the error. Packing (LMDB) and downscaling happen before the clock.
"""
from __future__ import annotations

import inspect
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from datamodules.base import BUILTIN_ROOT, REPO_ROOT
from datamodules.index import load_indexes
from lightning_app.bench import ceilings
from lightning_app.bench.report import repo_relative

NEAR = 0.8  # a rate at >= 80% of a ceiling is bound by it
BACKENDS = ("imagefolder", "lmdb", "downscaled", "dali-cpu", "dali-gpu")
LABELS = {"imagefolder": "ImageFolder", "lmdb": "LMDB", "downscaled": "Downscaled",
          "dali-cpu": "DALI CPU", "dali-gpu": "DALI GPU (mixed)"}
# Decode-only ceilings are measured with every decoder the backends use, on every image set:
# "pil" = datamodules.images.decode_rgb; "torchvision" = datamodules.decode.decode (libjpeg-turbo
# through torchvision.io for plain JPEGs, PIL for the rest: the shared sample path's decoder).
DECODERS = ("pil", "torchvision")

COLUMNS = {
    "backend": "the DataModule whose train_dataloader() is timed (same tree, same batch, image size, workers)",
    "images/s cold | warm": "training images per second through the whole pipeline (read, decode, augment, "
                            "batch, copy to the device) as uint8 batches on the device; the model step's "
                            "normalisation there is timed on its own (notes); cold: the "
                            "backend's files evicted from the page cache first (method in the notes); warm: the "
                            "next epochs (--warm-epochs), files in RAM",
    "MB/s cold | warm": "megabytes (1e6) of encoded image bytes the backend reads per second (images/s x mean "
                        "stored size)",
    "% IO ceiling": "cold MB/s as a share of the cold raw read rate of the backend's own files",
    "% decode ceiling cold | warm": "images/s as a share of the FASTEST full-image decoder's decode-only rate on "
                                    "all cores for the same images (warm cache), so a faster decoder alone cannot "
                                    "raise it (CPU-decoding rows)",
    "% PIL ceiling cold | warm": "images/s as a share of PIL's decode-only rate on all cores for the original "
                                 "images (warm cache): what the template's targets are stated in",
    "bottleneck cold | warm": f"IO if MB/s >= {NEAR:.0%} of the IO ceiling; CPU decode if images/s >= {NEAR:.0%} "
                              "of the decode ceiling; GPU for GPU-decoding rows otherwise; else the work around "
                              "decoding (crop, resize, batching, transfer)",
}


class Skip(Exception):
    """A backend that cannot run here; the message is the reason shown in the table."""


@dataclass
class Settings:
    root: Path
    work: Path
    batch_size: int = 64
    num_workers: int = 2
    image_size: int = 224
    downscale_size: int = 160
    warm_epochs: int = 2
    rounds: int = 3
    max_batches: int | None = None
    drop_caches: bool = False
    device: str = "cpu"


@dataclass
class Prepared:
    datamodule: Any
    files: list[str]           # what to evict for a cold epoch
    image_bytes: float          # mean stored bytes per train image
    storage: str                # key of the IO ceiling (the files this backend reads)
    images: str                 # key of the decode ceiling (the encoded images it decodes)
    gpu_decode: bool = False
    note: str = ""


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


# ------------------------------------------------------------------------------ bottleneck

def classify(images_s: float, mb_s: float, io_mb_s: float | None, decode_images_s: float | None,
             gpu_decode: bool = False, near: float = NEAR) -> tuple[str, float | None, float | None]:
    """Name the bottleneck of one row from its rates and the ceilings (None = does not apply).

    Returns (bottleneck, share of the IO ceiling, share of the decode ceiling).
    """
    io = mb_s / io_mb_s if io_mb_s else None
    dec = images_s / decode_images_s if (decode_images_s and not gpu_decode) else None
    bound = [(frac, name) for frac, name in ((io, "IO"), (dec, "CPU decode")) if frac is not None and frac >= near]
    if bound:
        return max(bound)[1], io, dec
    if gpu_decode:
        return "GPU", io, dec
    return "around decoding", io, dec


# ------------------------------------------------------------------------------ backends

def _kwargs(cls, s: Settings, **extra) -> dict:
    """The shared DESIGN.md init args plus whichever of ``extra`` the class accepts."""
    params = inspect.signature(cls.__init__).parameters
    kw = {"data_dir": str(s.root), "batch_size": s.batch_size, "num_workers": s.num_workers,
          "image_size": s.image_size}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw.update({k: v for k, v in extra.items() if k in params or takes_any})
    return {k: v for k, v in kw.items() if k in params or takes_any}


def _mean_size(paths: list[str]) -> float:
    return sum(os.path.getsize(p) for p in paths) / max(1, len(paths))


def _train_files(dm) -> list[str]:
    index = dm.indexes["train"]
    return [index.path(i) for i in range(len(index))]


def _imagefolder(s: Settings) -> Prepared:
    from datamodules import ImageFolderDataModule

    dm = ImageFolderDataModule(**_kwargs(ImageFolderDataModule, s))
    dm.setup("fit")
    files = _train_files(dm)
    return Prepared(dm, files, _mean_size(files), "tree", "original")


def _run_tool(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-600:]}")


def _lmdb(s: Settings) -> Prepared:
    try:
        import datamodules.lmdb  # noqa: F401
        from datamodules import LMDBDataModule
    except ImportError as e:
        raise Skip(f"LMDB backend not importable ({e})") from None
    dst = s.work / "train.lmdb"
    if not (dst / "data.mdb").exists():
        _run_tool(["datamodules.lmdb", "--src", str(s.root), "--dst", str(dst)], "packing the LMDB")
    params = inspect.signature(LMDBDataModule.__init__).parameters
    path_arg = next((p for p in ("lmdb_path", "lmdb", "path", "db_path") if p in params), None)
    kw = _kwargs(LMDBDataModule, s, **({path_arg: str(dst)} if path_arg else {}))
    if path_arg is None:
        kw["data_dir"] = str(dst)
    dm = LMDBDataModule(**kw)
    dm.setup("fit")
    from datamodules.lmdb import LMDBReader

    reader = LMDBReader(str(dst))
    n = reader.count("train")
    size = sum(len(reader.get("train", i)[0]) for i in range(n)) / max(1, n)
    return Prepared(dm, ceilings.files_under(str(dst)), size, "lmdb", "original",
                    note=f"packed once before timing into {dst.name}")


def _downscaled(s: Settings) -> Prepared:
    try:
        import datamodules.downscale  # noqa: F401
        from datamodules import DownscaledDataModule
    except ImportError as e:
        raise Skip(f"Downscaled backend not importable ({e})") from None
    dst = s.work / f"downscaled-{s.downscale_size}"
    params = inspect.signature(DownscaledDataModule.__init__).parameters
    if not (dst / "train").is_dir():
        # `python -m datamodules.downscale`, as a user makes the copy; the DataModule then finds it complete.
        _run_tool(["datamodules.downscale", "--src", str(s.root), "--dst", str(dst),
                   "--max-size", str(s.downscale_size)],
                  "downscaling")
    extra = {"max_size": s.downscale_size}
    for name in ("downscaled_dir", "dst", "cache_dir", "out_dir"):
        if name in params:
            extra[name] = str(dst)
    kw = _kwargs(DownscaledDataModule, s, **extra)
    if not any(k in params for k in ("downscaled_dir", "dst", "cache_dir", "out_dir")):
        kw["data_dir"] = str(dst)  # the downscaled copy is itself an ImageFolder tree
    dm = DownscaledDataModule(**kw)
    dm.setup("fit")
    files = _train_files(dm) if getattr(dm, "indexes", None) else ceilings.files_under(str(dst / "train"))
    return Prepared(dm, files, _mean_size(files), "downscaled", "downscaled",
                    note=f"shorter side <= {s.downscale_size} px, made once before timing")


def _dali(s: Settings, gpu: bool) -> Prepared:
    if gpu and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (nvJPEG decoding on the device)")
    try:
        import nvidia.dali  # noqa: F401

        from datamodules import DALIDataModule
    except ImportError as e:
        raise Skip(f"DALI backend not importable ({e})") from None
    params = inspect.signature(DALIDataModule.__init__).parameters
    name = next((p for p in ("decoder_device", "device", "decoder", "dali_device") if p in params), None)
    if name is None:
        raise Skip("DALIDataModule has no decoder device argument this benchmark knows")
    value = "cpu"
    if gpu:  # DALIDataModule(dali_device="gpu") decodes with DALI's "mixed" (nvJPEG) operators
        value = "gpu" if name == "dali_device" else "mixed"
    dm = DALIDataModule(**_kwargs(DALIDataModule, s, **{name: value}))
    dm.setup("fit")
    note = f"{name}={value!r}"
    if s.max_batches and getattr(dm, "indexes", None):
        # DALI cannot stop mid-epoch: a loader left after --max-batches is rebuilt on the next iter(), and that
        # rebuild would be timed in every epoch. Give it an epoch of exactly max_batches batches instead
        # (a seeded sample of the train images, every class mixed).
        from datamodules.index import Index

        index = dm.indexes["train"]
        keep = min(len(index), s.max_batches * s.batch_size)
        picked = sorted(torch.randperm(len(index), generator=torch.Generator().manual_seed(0))[:keep].tolist())
        dm.indexes["train"] = Index(index.root, index.split, index.classes, [index.samples[i] for i in picked])
        note += f"; epoch = a sample of {keep} train images (--max-batches: DALI cannot stop mid-epoch)"
    files = _train_files(dm) if getattr(dm, "indexes", None) else []
    return Prepared(dm, files, _mean_size(files), "tree", "original", gpu_decode=gpu, note=note)


FACTORIES: dict[str, Callable[[Settings], Prepared]] = {
    "imagefolder": _imagefolder,
    "lmdb": _lmdb,
    "downscaled": _downscaled,
    "dali-cpu": lambda s: _dali(s, gpu=False),
    "dali-gpu": lambda s: _dali(s, gpu=True),
}


# ------------------------------------------------------------------------------ timing

def _to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
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


def time_epoch(dm, loader, device: torch.device, max_batches: int | None, desc: str) -> tuple[int, float]:
    """One epoch of ``loader`` (the backend's train_dataloader(), made once as Lightning does) as training
    iterates it, up to the batch on the device. Returns (images, seconds).

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
    t0 = time.perf_counter()
    with tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True) as bar:
        for i, batch in enumerate(loader):
            batch = _to_device(batch, device)
            images += _count(batch)
            bar.update(1)
            if max_batches and i + 1 >= max_batches:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images, time.perf_counter() - t0


def normalize_cost(batch_size: int, image_size: int, device: torch.device, repeats: int = 7) -> dict:
    """Milliseconds the device-side normalisation (datamodules.transforms.normalize) takes per batch."""
    from datamodules.transforms import normalize

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


def _prepare(loader) -> None:
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

    _prepare(loader)
    if isinstance(loader, DataLoader) and loader.persistent_workers:
        time_epoch(dm, loader, device, max_batches, f"{label} start")


def _shutdown(dm) -> None:
    # Free the persistent workers (and DALI pipelines) before the next backend is timed.
    for name in ("teardown",):
        try:
            getattr(dm, name)("fit")
        except Exception:  # noqa: BLE001, S110 - best effort
            pass


def _close(loader) -> None:
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
        evict_how = ceilings.evict_pages(p.files, settings.drop_caches)
        out = {"cold": time_epoch(p.datamodule, loader, device, settings.max_batches, f"{label} cold")}
        images, seconds = 0, 0.0
        for _ in range(max(1, settings.warm_epochs)):
            n, dt = time_epoch(p.datamodule, loader, device, settings.max_batches, f"{label} warm")
            images, seconds = images + n, seconds + dt
        out["warm"] = (images, seconds)
        return out, evict_how
    finally:
        _close(loader)
        _shutdown(p.datamodule)


def run(settings: Settings, backends: list[str], measure_ceilings: bool = True,
        ceiling_images: int = 2000) -> dict[str, Any]:
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
        storages.setdefault(p.storage, p.files)
        if p.storage != "lmdb":
            image_sets.setdefault(p.images, p.files)

    timings: dict[str, list[dict]] = {label: [] for label, p in outcome.items() if isinstance(p, Prepared)}
    decode_jobs = [(k, d, c) for k, files in image_sets.items() if files for d in DECODERS for c in ("warm", "cold")]
    decode_rounds: dict[tuple[str, str, str], list[dict]] = {job: [] for job in decode_jobs}
    for _ in tqdm(range(max(1, settings.rounds)), desc="rounds", unit="round", leave=False):
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
            rounds = [(n, dt, n / max(dt, 1e-9)) for n, dt in (t[cache] for t in timings[label])]
            images, seconds, ips = sorted(rounds, key=lambda r: r[2])[len(rounds) // 2]  # the median round
            rows.append(Row(label, cache, images=images, seconds=seconds, images_s=ips,
                            mb_s=ips * p.image_bytes / 1e6, note=p.note,
                            extra={"storage": p.storage, "images_key": p.images, "gpu_decode": p.gpu_decode,
                                   "rounds_images_s": [round(r[2], 1) for r in rounds]}))

    # ceilings: io[storage] (cold reads); decode[images][decoder][cache] (all cores, every decoder, cold and warm)
    ceil: dict[str, dict] = {"io": {}, "decode": {}}
    if measure_ceilings:
        for key, files in tqdm(list(storages.items()), desc="IO ceilings", leave=False):
            ceil["io"][key] = ceilings.read_rate(files, drop_caches=settings.drop_caches).as_dict()
        for (key, decoder, cache), rates in decode_rounds.items():
            rate = dict(sorted(rates, key=lambda r: r["images_s"])[len(rates) // 2])  # the median round
            rate["rounds_images_s"] = [round(r["images_s"], 1) for r in rates]
            ceil["decode"].setdefault(key, {}).setdefault(decoder, {})[cache] = rate
        ceil["stages_us"] = ceilings.stage_times(tree[:: max(1, len(tree) // 100)][:100], settings.image_size)
        ceil["normalize"] = normalize_cost(settings.batch_size, settings.image_size, device)
        if isinstance(outcome.get(LABELS["dali-cpu"]), Prepared):
            from lightning_app.bench.dali_stages import dali_stage_rates

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
            "settings": {k: str(v) for k, v in settings.__dict__.items()}}


# ------------------------------------------------------------------------------ output

def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "" if x is None else format(x, spec)


def fastest_decode(ceil: dict[str, Any], images: str) -> float | None:
    """The fastest full-image decoder's warm decode-only rate for an image set (None if not measured)."""
    rates = [v["warm"]["images_s"] for v in ceil["decode"].get(images, {}).values() if "warm" in v]
    return max(rates) if rates else None


def _pair(by_cache: dict[str, dict], key: str, spec: str = ",.0f", scale: float = 1.0) -> str:
    vals = [by_cache.get(c, {}).get(key) for c in ("cold", "warm")]
    return " | ".join("" if v is None else format(v * scale, spec) for v in vals)


def to_markdown(result: dict[str, Any]) -> str:
    """One line per backend, cold and warm side by side; then every ceiling, cold and warm."""
    headers = []
    for c in COLUMNS:
        headers += [c.replace("cold | warm", "cold"), c.replace("cold | warm", "warm")] if "cold | warm" in c else [c]
    table = []
    by_backend: dict[str, dict[str, dict]] = {}
    for r in result["rows"]:
        by_backend.setdefault(r["backend"], {})[r["cache"]] = r
    for backend, by_cache in by_backend.items():
        first = next(iter(by_cache.values()))
        if first["status"] != "ok":
            table.append([backend, f"{first['status']}: {first['reason']}"] + [""] * (len(headers) - 2))
            continue
        cells = [backend]
        cells += _pair(by_cache, "images_s").split(" | ")
        cells += _pair(by_cache, "mb_s", ",.1f").split(" | ")
        cells.append(_pair(by_cache, "io_frac", ".0f", 100).split(" | ")[0])
        cells += _pair(by_cache, "decode_frac", ".0f", 100).split(" | ")
        cells += _pair(by_cache, "pil_frac", ".0f", 100).split(" | ")
        cells += [by_cache.get(c, {}).get("bottleneck") or "" for c in ("cold", "warm")]
        table.append(cells)
    from lightning_app.bench.report import markdown_table

    lines = [markdown_table(headers, table), ""]
    c = result["ceilings"]
    for key, v in c["io"].items():
        lines.append(f"- IO ceiling ({key} files): {v['mb_s']:,.1f} MB/s, {v['images_s']:,.0f} files/s ({v['how']})")
    for key, decoders in c["decode"].items():
        for decoder, by_cache in decoders.items():
            cold, warm = by_cache.get("cold"), by_cache.get("warm")
            lines.append(f"- Decode ceiling ({key} images, {decoder}): "
                         f"cold {cold['images_s'] if cold else float('nan'):,.0f} | "
                         f"warm {warm['images_s'] if warm else float('nan'):,.0f} images/s "
                         f"({(warm or cold)['how']}; cold: evicted first; median of the rounds, "
                         f"warm rounds {', '.join(f'{x:,.0f}' for x in (warm or cold).get('rounds_images_s', []))})")
    if c.get("stages_us"):
        lines.append("- Stages of the sample path, one thread, original images, warm (microseconds per image): "
                     + "; ".join(f"{k} {v:,.0f}" for k, v in c["stages_us"].items()))
    if c.get("dali_stages"):
        lines.append("- Stages of DALI CPU's train pipeline, all cores, warm (images/s as each step is added): "
                     + "; ".join(f"{k} {v:,.0f}" for k, v in c["dali_stages"].items()))
    if c.get("normalize"):
        n = c["normalize"]
        lines.append(f"- Not in the rows: the model step's normalisation on the device (uint8 -> float, mean/std), "
                     f"{n['ms_per_batch']:.1f} ms per batch ({n['images_s']:,.0f} images/s, {n['threads']} threads); "
                     "on a GPU it runs there, on a CPU-only machine it is part of the model's compute")
    s = result["settings"]
    lines.append(f"- Cold cache by: {result['eviction']}")
    lines.append(f"- Dataset: {repo_relative(s['root'])} (train split); batch {s['batch_size']}, {s['num_workers']} workers, "
                 f"crop {s['image_size']} px, device {s['device']}; each row the median of {s.get('rounds', '1')} rounds, "
                 f"each round: one untimed epoch, a cold epoch, then warm = {s.get('warm_epochs', '1')} epochs; "
                 "the decode ceilings are timed in every round, beside the rows")
    notes = sorted({f"{r['backend']}: {r['note']}" for r in result["rows"] if r.get("note")})
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    """Cold and warm bars per backend; the original images' decode-only ceilings (every decoder, cold and warm)
    as lines (the downscaled copy's much higher ones are in the table's notes, off this scale)."""
    labels = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    series = {}
    for cache in ("cold", "warm"):
        by = {r["backend"]: r["images_s"] for r in result["rows"] if r["cache"] == cache}
        series[cache] = [by.get(b) for b in labels]
    lines = {}
    for decoder, by_cache in result["ceilings"]["decode"].get("original", {}).items():
        for cache in ("cold", "warm"):
            if cache in by_cache:
                lines[f"{decoder} decode-only ceiling, {cache}"] = by_cache[cache]["images_s"]
    return {"title": "Train pipeline throughput per backend (images/s)", "labels": labels, "series": series,
            "ylabel": "images/s (higher is better)", "lines": lines}


def default_root(preset: str, train_per_class: int | None, val_per_class: int | None) -> Path:
    from datamodules.builtin import ensure_builtin

    return Path(ensure_builtin(preset, root=BUILTIN_ROOT, train_per_class=train_per_class, val_per_class=val_per_class))
