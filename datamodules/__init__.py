"""The data side: one validated Index per split, read by interchangeable backends."""
from datamodules.base import ImageDataModule
from datamodules.dali import DALIDataModule  # imports nvidia.dali only when instantiated
from datamodules.imagefolder import ImageFolderDataModule
from datamodules.index import DataError, Index, load_index, load_indexes

__all__ = [
    "DALIDataModule",
    "DataError",
    "ImageDataModule",
    "ImageFolderDataModule",
    "Index",
    "DownscaledDataModule",
    "LMDBDataModule",
    "load_index",
    "load_indexes",
]


def __getattr__(name: str):
    # Imported lazily so that `python -m datamodules.lmdb` / `.downscale` do not import themselves twice.
    if name == "LMDBDataModule":
        from datamodules.lmdb import LMDBDataModule

        return LMDBDataModule
    if name == "DownscaledDataModule":
        from datamodules.downscaled import DownscaledDataModule

        return DownscaledDataModule
    raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
