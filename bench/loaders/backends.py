"""`bench loaders`' backends: each DataModule made ready to time (packing and downscaling done first).

A factory returns a `Prepared` backend, or raises `Skip` with the reason its row shows (a module
that is not importable, DALI GPU without CUDA).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench.loaders import ceilings
from bench.loaders.prepared import Prepared, Settings, Skip, datamodule_kwargs
from bench.loaders.streaming import streaming_local, streaming_s3
from datamodules.base import BUILTIN_ROOT, REPO_ROOT

BACKENDS = ("imagefolder", "imagefolder-whole", "lmdb", "lmdb-whole", "downscaled", "dali-cpu", "dali-gpu",
            "streaming-local", "streaming-s3")
LABELS = {"imagefolder": "ImageFolder", "imagefolder-whole": "ImageFolder, whole decode", "lmdb": "LMDB",
          "lmdb-whole": "LMDB, whole decode", "downscaled": "Downscaled",
          "dali-cpu": "DALI CPU", "dali-gpu": "DALI GPU (mixed)", "streaming-local": "Streaming (folder)",
          "streaming-s3": "Streaming (S3)"}


def _mean_size(paths: list[str]) -> float:
    return sum(os.path.getsize(p) for p in paths) / max(1, len(paths))


def _train_files(dm) -> list[str]:
    index = dm.indexes["train"]
    return [index.path(i) for i in range(len(index))]


def _imagefolder(s: Settings) -> Prepared:
    from datamodules import ImageFolderDataModule

    dm = ImageFolderDataModule(**datamodule_kwargs(ImageFolderDataModule, s))
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
    kw = datamodule_kwargs(LMDBDataModule, s, **({path_arg: str(dst)} if path_arg else {}))
    if path_arg is None:
        kw["data_dir"] = str(dst)
    dm = LMDBDataModule(**kw)
    dm.setup("fit")
    from datamodules.lmdb.reader import LMDBReader

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
    kw = datamodule_kwargs(DownscaledDataModule, s, **extra)
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
    dm = DALIDataModule(**datamodule_kwargs(DALIDataModule, s, **{name: value}))
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


def _region_note(p: Prepared) -> Prepared:
    """The row's region decode (datamodules/sample/region.py) in its note: on, with its decoder, or off for want of
    one."""
    from datamodules.sample import region

    on = region.available() and p.datamodule.decode == "cpu"
    words = f"region decode ({region.decoder.name})" if on else \
        "whole decode (no region decoder here)" if p.datamodule.decode == "cpu" else ""
    p.note = "; ".join(w for w in (p.note, words) if w)
    return p


def _whole(p: Prepared) -> Prepared:
    """The same backend with every image decoded whole: the row beside its region-decode row."""
    p.datamodule.region_decode = False
    p.note = "; ".join(w for w in (p.note, "whole decode (region decode off)") if w)
    return p


FACTORIES: dict[str, Callable[[Settings], Prepared]] = {
    "imagefolder": lambda s: _region_note(_imagefolder(s)),
    "imagefolder-whole": lambda s: _whole(_imagefolder(s)),
    "lmdb": lambda s: _region_note(_lmdb(s)),
    "lmdb-whole": lambda s: _whole(_lmdb(s)),
    "downscaled": _downscaled,
    "dali-cpu": lambda s: _dali(s, gpu=False),
    "dali-gpu": lambda s: _dali(s, gpu=True),
    "streaming-local": streaming_local,
    "streaming-s3": streaming_s3,
}


def default_root(preset: str, train_per_class: int | None, val_per_class: int | None) -> Path:
    """The built-in preset's tree (made on first use): the data when no --data-dir is given."""
    from datamodules.builtin.tree import ensure_builtin

    return Path(ensure_builtin(preset, root=BUILTIN_ROOT, train_per_class=train_per_class, val_per_class=val_per_class))
