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
    "load_index",
    "load_indexes",
]
