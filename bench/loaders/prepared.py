"""What a `bench loaders` backend factory takes (`Settings`), returns (`Prepared`) or raises (`Skip`), and the
init args every DataModule it makes shares (`datamodule_kwargs`). Imported by backends.py and streaming.py.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self


class Skip(Exception):
    """A backend that cannot run here; the message is the reason shown in the table."""


@dataclass
class Settings:
    root: Path
    work: Path
    batch_size: int = 64
    num_workers: int = 2
    image_size: int = 224
    min_scale: float = 0.25  # the train crop's smallest area (the DataModule's default; ImageNet recipes: 0.08)
    downscale_size: int = 160
    warm_epochs: int = 2
    rounds: int = 3
    max_batches: int | None = None
    drop_caches: bool = False
    device: str = "cpu"
    decode: str = "cpu"  # --data.decode of the backends that take it (ImageFolder, LMDB, downscaled)


@dataclass
class Prepared:
    datamodule: Any
    files: list[str]           # what to evict for a cold epoch
    image_bytes: float          # mean stored bytes per train image
    storage: str                # key of the IO ceiling (the files this backend reads)
    images: str                 # key of the decode ceiling (the encoded images it decodes)
    gpu_decode: bool = False
    note: str = ""
    evict: Callable[[], str] | None = None       # how to make the next epoch cold, instead of evicting `files`
    io_ceiling: Callable[[], Any] | None = None  # the IO ceiling (a ceilings.Ceiling), instead of reading `files`
    close: Callable[[], None] | None = None      # after the run (a server this backend started)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.close is not None:
            self.close()


def datamodule_kwargs(cls: type, s: Settings, **extra: Any) -> dict[str, Any]:
    """The init args every backend shares (datamodules/base.py) plus whichever of ``extra`` the class accepts."""
    params = inspect.signature(cls.__init__).parameters
    kw = {"data_dir": str(s.root), "batch_size": s.batch_size, "num_workers": s.num_workers,
          "image_size": s.image_size, "min_scale": s.min_scale, "decode": s.decode}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw.update({k: v for k, v in extra.items() if k in params or takes_any})
    return {k: v for k, v in kw.items() if k in params or takes_any}
