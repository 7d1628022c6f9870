"""The data side: one validated Index per split, read by interchangeable backends.

Names are imported on first use, so `python -m datamodules.builtin` (and DataLoader or DALI
workers that import a submodule) do not pay for importing Lightning, and the module tools do
not import themselves twice.
"""
from importlib import import_module

_EXPORTS = {
    "DataError": "datamodules.errors",
    "Index": "datamodules.index",
    "load_index": "datamodules.index",
    "load_indexes": "datamodules.index",
    "ImageDataModule": "datamodules.base",
    "ImageFolderDataModule": "datamodules.imagefolder",
    "LMDBDataModule": "datamodules.lmdb.datamodule",
    "DownscaledDataModule": "datamodules.downscale.datamodule",
    "DALIDataModule": "datamodules.dali.datamodule",  # imports nvidia.dali only when instantiated
    "StreamingDataModule": "datamodules.shards.datamodule",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - a list, built from the table above


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
