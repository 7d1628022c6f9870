"""LMDB backend: reads a database packed by `python -m datamodules.lmdb` through the shared sample path.

    python -m datamodules.lmdb --src ROOT --dst OUT.lmdb [--skip-invalid] [--workers N]

The format is in format.py, the packer (and that command) in pack.py. Here: random
access to a packed database (`LMDBReader`), the sample source over it (`LMDBSource`: a value's
image bytes read in place from the memory map, no copy) and `LMDBDataModule`.
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

from torch.utils.data import Dataset

from datamodules.base import BUILTIN_ROOT, REPO_ROOT, ImageDataModule
from datamodules.index import SPLITS, Index, find_classes
from datamodules.lmdb.format import (  # noqa: F401 - the public names of the LMDB backend
    FORMAT,
    HEADER,
    MAGIC,
    META_KEY,
    VERSION,
    close_env,
    pack_value,
    read_meta,
    sample_key,
    unpack_value,
)
from datamodules.lmdb.pack import ensure_lmdb, main, pack
from datamodules.lmdb.reader import LMDBReader, LMDBSource

__all__ = [
    "LMDBDataModule",
    "LMDBReader",
    "LMDBSource",
    "ensure_lmdb",
    "main",
    "pack",
    "pack_value",
    "read_meta",
    "sample_key",
    "unpack_value",
]


def default_cache(root: Path) -> Path:
    digest = hashlib.sha1(str(root.absolute()).encode()).hexdigest()[:10]
    return REPO_ROOT / "data" / "lmdb" / f"{root.name}-{digest}.lmdb"


class LMDBDataModule(ImageDataModule):
    """Reads a database packed by `python -m datamodules.lmdb` (see ImageDataModule for the shared args).

    Args:
        data_dir: the OUT.lmdb folder. An ImageFolder root is also accepted: it is packed on
            first use into `cache_dir` (default data/lmdb/<name>-<hash>.lmdb). None = the
            built-in dataset, packed on first use into data/builtin/<preset>.lmdb.
        cache_dir: where to pack an ImageFolder `data_dir` (a path ending in .lmdb).
        pack_workers: processes for that first-use pack (default: all cores).
    """

    def __init__(self, data_dir: str | None = None, cache_dir: str | None = None,
                 pack_workers: int | None = None, **kwargs) -> None:
        self.cache_dir = cache_dir
        self.pack_workers = pack_workers
        super().__init__(data_dir=data_dir, **kwargs)

    def discover_classes(self) -> list[str]:
        if self.data_dir is None:
            from datamodules.builtin.tree import ensure_builtin

            tree = Path(ensure_builtin(self.builtin, root=BUILTIN_ROOT))
            db = ensure_lmdb(tree, tree.parent / f"{tree.name}.lmdb", skip_invalid=self.skip_invalid,
                             workers=self.pack_workers)
        else:
            path = Path(self.data_dir).expanduser()
            if path.is_dir() and (path / "train").is_dir() and not (path / "data.mdb").exists():
                find_classes(path)  # a clear error for a bad layout before packing
                dst = Path(self.cache_dir).expanduser() if self.cache_dir else default_cache(path)
                db = ensure_lmdb(path, dst, skip_invalid=self.skip_invalid, workers=self.pack_workers)
            else:
                db = path
        self.root = Path(db)
        self.reader = LMDBReader(db)
        skipped = {s: v.get("skipped", 0) for s, v in self.reader.meta["splits"].items()}
        if any(skipped.values()):
            warnings.warn(f"LMDB database {db} was packed with --skip-invalid: it leaves out {skipped} "
                          "unreadable file(s) (listed under skipped_files in its metadata).", stacklevel=2)
        return self.reader.classes

    def load_indexes(self) -> dict[str, Index]:
        # The metadata replaces the directory walk; labels live in the values.
        meta = self.reader.meta
        indexes = {}
        for s in SPLITS:
            paths = meta["splits"][s]["paths"]
            labels = meta["splits"][s].get("labels") or [-1] * len(paths)  # optional: labels live in the values
            indexes[s] = Index(str(self.root), s, self.classes, list(zip(paths, labels, strict=False)))
        return indexes

    def make_dataset(self, split: str, index: Index) -> Dataset:
        labels = index.labels
        if any(label < 0 for label in labels):  # an old pack without labels in its metadata: read the values'
            labels = [self.reader.get(split, i)[1] for i in range(len(labels))]
        return self.sample_dataset(split, LMDBSource(self.reader, split), labels)


if __name__ == "__main__":
    main()
