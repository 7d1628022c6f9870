"""The Index: the one validated list of (file, label) that every backend reads.

Classes are the sorted names of the non-hidden folders of train/; val/ must have the same
folders. Hidden files and folders and non-image files are never samples. Files that fail
the cheap checks of `images.check_file` are listed in `bad_files`, not in `samples`.
train/ is listed class by class (every loader shuffles it); val/ is interleaved by class, one sample of
each class in turn, so any prefix of it (`--trainer.limit_val_batches`, a smoke test) holds every class.
Scans (datamodules/scan.py) are cached (datamodules/index_cache.py), keyed by the modification time of every
folder the walk entered (nested ones included), so a second start on a large tree costs one stat per folder and no
per-file work.

A scan runs only once per machine: DDP ranks starting together take a file lock beside the cache, the first
scans and writes the cache, the others wait and then read it. A progress bar shows on a
terminal; elsewhere (cluster logs) a long scan prints one line when it is done.
`python -m bench.scanbench` measures files/s on a generated tree with a cold cache.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from datamodules import index_cache
from datamodules.errors import DataError
from datamodules.index_cache import cache_key
from datamodules.processes.locks import file_lock
from datamodules.sample.images import check_file
from datamodules.sample.pixel_limit import PILLOW_MAX_IMAGE_PIXELS
from datamodules.scan import SCAN_THREADS, scan_files

SPLITS = ("train", "val")

LAYOUT_HELP = (
    "Expected an ImageFolder tree: ROOT/train/<class>/<image> and ROOT/val/<class>/<image>, "
    "with the same class folders in both splits (leave data_dir null to use the built-in dataset)."
)


class Samples(Sequence):
    """An Index's samples, (relative posix path, label), read from its arrays: `samples[i]`, slices (lists),
    iteration, `len`, and `==` with any sequence of pairs (a list compares equal to the same pairs)."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._index.relative(i), int(self._index.label_array[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        index = self._index
        names = index.names.tobytes()
        if names.isascii():  # byte offsets are character offsets: one decode for all
            names = names.decode()
        ends = index.name_ends.tolist()
        for start, end, label in zip([0, *ends][:-1], ends, index.label_array.tolist(), strict=True):
            name = names[start:end]
            yield (name if isinstance(name, str) else name.decode()), label

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Samples):
            other_index = other._index
            return (np.array_equal(self._index.names, other_index.names)
                    and np.array_equal(self._index.name_ends, other_index.name_ends)
                    and np.array_equal(self._index.label_array, other_index.label_array))
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and all(tuple(a) == b for a, b in zip(other, self, strict=True))
        return NotImplemented

    def __repr__(self) -> str:
        return f"Samples({len(self)} of {self._index.root}/{self._index.split})"


class Index:
    """One split's samples, kept as arrays: the relative paths' UTF-8 bytes end to end (`names`, each ending at
    `name_ends[i]`) and the labels (`label_array`). 1.28M ImageNet paths take ~60 MiB so, against ~170 MiB as
    Python tuples. A worker that unpickles its dataset (--data.worker_start forkserver or spawn) maps the same
    arrays: `__reduce__` hands them over as tensors in shared memory, which torch's reduction for multiprocessing
    sends as file descriptors (torch/multiprocessing/reductions.py, `reduce_storage`), so a worker receives a few
    hundred bytes and holds no copy (python -m bench.worker_start measures both).

    Index(root, split, classes, samples, bad_files=[], empty_classes=[]) as before: `samples` any iterable of
    (relative posix path, label); `index.samples` reads them back (`Samples`).
    """

    def __init__(self, root: str, split: str, classes: list[str], samples: Iterable[tuple[str, int]],
                 bad_files: list[tuple[str, str]] | None = None, empty_classes: list[str] | None = None) -> None:
        self.root, self.split, self.classes = root, split, list(classes)
        self.bad_files = list(bad_files or [])  # (relative path, reason)
        self.empty_classes = list(empty_classes or [])
        encoded, labels = [], []
        for rel, label in samples:
            encoded.append(rel.encode())
            labels.append(label)
        self.names = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.name_ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        self.label_array = np.asarray(labels, dtype=np.int32).reshape(-1)
        self._shared: tuple[torch.Tensor, ...] | None = None
        self.large_files: list[tuple[str, int]] = []  # (relative path, pixels) above the pixel limit

    @property
    def samples(self) -> Samples:
        return Samples(self)

    def __len__(self) -> int:
        return len(self.name_ends)

    def relative(self, i: int) -> str:
        """Sample i's path relative to root (posix)."""
        if i < 0:
            i += len(self)
        start = int(self.name_ends[i - 1]) if i > 0 else 0
        return self.names[start:int(self.name_ends[i])].tobytes().decode()

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.relative(i))

    @property
    def labels(self) -> list[int]:
        return self.label_array.tolist()

    def without_bad_files(self) -> Index:
        return Index._of_arrays(self.root, self.split, self.classes, self.names, self.name_ends, self.label_array,
                                [], self.empty_classes)

    def raise_if_bad(self, limit: int = 20) -> None:
        if not self.bad_files:
            return
        listed = "\n".join(f"  {os.path.join(self.root, p)}: {why}" for p, why in self.bad_files[:limit])
        more = f"\n  ... and {len(self.bad_files) - limit} more" if len(self.bad_files) > limit else ""
        raise DataError(
            f"{len(self.bad_files)} unreadable image file(s) in {self.root}/{self.split}:\n{listed}{more}\n"
            "Fix or delete them, or pass --data.skip_invalid true to leave them out of training."
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Index):
            return NotImplemented
        return ((self.root, self.split, self.classes, self.bad_files, self.empty_classes)
                == (other.root, other.split, other.classes, other.bad_files, other.empty_classes)
                and self.samples == other.samples)

    __hash__ = None  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        return (f"Index(root={self.root!r}, split={self.split!r}, {len(self.classes)} classes, {len(self)} samples, "
                f"{len(self.bad_files)} bad files)")

    def as_dict(self) -> dict:
        """The JSON form of the scan cache (what `dataclasses.asdict` gave)."""
        return {"root": self.root, "split": self.split, "classes": self.classes,
                "samples": [list(s) for s in self.samples], "bad_files": [list(b) for b in self.bad_files],
                "empty_classes": self.empty_classes, "large_files": [list(f) for f in self.large_files]}

    # -- pickled to a worker: the arrays in shared memory ----------------------------------------------------------
    def __reduce__(self):
        # A plain pickle (no worker) writes the tensors' bytes; a worker's pickler (multiprocessing's ForkingPickler,
        # with torch's reductions registered) sends their shared memory's file descriptors.
        return _index_of_tensors, (self.root, self.split, self.classes, self.bad_files, self.empty_classes,
                                   *self.shared_arrays())

    def shared_arrays(self) -> tuple[torch.Tensor, ...]:
        """names, name_ends, label_array as tensors in shared memory, made once; this Index reads them from then on
        (one copy in the process, not two)."""
        if self._shared is None:
            self._shared = tuple(torch.from_numpy(np.array(a)).share_memory_()
                                 for a in (self.names, self.name_ends, self.label_array))
            self.names, self.name_ends, self.label_array = (t.numpy() for t in self._shared)
        return self._shared

    @classmethod
    def _of_arrays(cls, root, split, classes, names, name_ends, label_array, bad_files, empty_classes) -> Index:
        index = cls(root, split, classes, (), bad_files, empty_classes)
        index.names, index.name_ends, index.label_array = names, name_ends, label_array
        return index


class IndexPaths(Sequence):
    """`paths[i]` is `index.path(i)`: an Index's absolute paths, read from its arrays (a worker that unpickles it
    gets the arrays' shared memory, not a list of every path)."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        return self.index.path(i)


def _index_of_tensors(root, split, classes, bad_files, empty_classes, names, name_ends, labels) -> Index:
    index = Index._of_arrays(root, split, classes, names.numpy(), name_ends.numpy(), labels.numpy(), bad_files,
                             empty_classes)
    index._shared = (names, name_ends, labels)
    return index


def find_classes(root: str | os.PathLike) -> list[str]:
    """Validate the layout of `root` and return its class names (sorted)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data_dir {str(root)!r} does not exist or is not a folder. {LAYOUT_HELP}")
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise DataError(f"data_dir {str(root)!r} has no {' or '.join(m + '/' for m in missing)} folder. {LAYOUT_HELP}")
    per_split = {s: _class_folders(root / s) for s in SPLITS}
    classes = per_split["train"]
    if not classes:
        raise DataError(f"{root / 'train'} has no class folders. {LAYOUT_HELP}")
    if len(classes) < 2:  # a one-class classifier reaches accuracy 1.0 having learnt nothing
        raise DataError(f"{root / 'train'} has one class folder ({classes[0]}/): a classifier needs at least 2 "
                        f"classes to tell apart. Add a folder per class under train/ and val/. {LAYOUT_HELP}")
    if set(per_split["val"]) != set(classes):
        only_train = sorted(set(classes) - set(per_split["val"]))
        only_val = sorted(set(per_split["val"]) - set(classes))
        raise DataError(
            f"the class folders of {root / 'val'} differ from those of {root / 'train'}: "
            f"only in train/: {only_train or 'none'}; only in val/: {only_val or 'none'}. "
            "Both splits must have the same class folders (an empty folder is fine: it keeps its label). "
            + LAYOUT_HELP
        )
    return classes


def load_index(
    root: str | os.PathLike,
    split: str,
    classes: list[str] | None = None,
    *,
    check: bool = True,
    cache: bool = True,
    max_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS,
) -> Index:
    """The Index of one split, from the cache when the tree has not changed since."""
    root = os.path.abspath(root)
    classes = classes if classes is not None else find_classes(root)
    key = cache_key(root, split, classes, check) | {"max_pixels": max_pixels}
    cache_file = index_cache.cache_file(root, split)
    if not cache:
        return _checked(scan_split(root, split, classes, check, max_pixels=max_pixels), root, split)
    cached = _valid_cache(cache_file, key, root)
    if cached is not None:
        return cached
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_lock(cache_file.with_suffix(".lock")))
        except OSError:
            pass  # no writable cache dir: every process scans for itself
        cached = _valid_cache(cache_file, key, root)  # another rank may have scanned while this one waited
        if cached is not None:
            return cached
        split_dir = os.path.join(root, split)
        folders = {split_dir: os.stat(split_dir).st_mtime_ns}  # each folder is stat'ed before it is listed
        index = _checked(scan_split(root, split, classes, check, folders=folders, max_pixels=max_pixels), root, split)
        index_cache.write_cache(cache_file, key, index.as_dict(), folders)
        return index


def _valid_cache(cache_file: Path, key: dict, root: str) -> Index | None:
    fields = index_cache.read_cache(cache_file, key, root)
    cached = None if fields is None else Index(
        fields["root"], fields["split"], fields["classes"], [tuple(s) for s in fields["samples"]],
        [tuple(b) for b in fields["bad_files"]], fields["empty_classes"])
    if cached is not None:
        cached.large_files = [tuple(f) for f in fields.get("large_files", [])]
    # A bad file repaired in place does not change its folder's mtime: re-check those.
    if cached is not None and all(check_file(os.path.join(root, p), max_pixels=key.get("max_pixels"))
                                  for p, _ in cached.bad_files):
        return cached
    return None


def _checked(index: Index, root: str, split: str) -> Index:
    if not index.samples:
        first = f", e.g. {index.bad_files[0][0]}: {index.bad_files[0][1]}" if index.bad_files else ""
        raise DataError(
            f"{os.path.join(root, split)} holds no usable image files "
            f"({len(index.bad_files)} unreadable{first}). {LAYOUT_HELP}"
        )
    return index


def load_indexes(root: str | os.PathLike, **kwargs) -> dict[str, Index]:
    classes = find_classes(root)
    return {split: load_index(root, split, classes, **kwargs) for split in SPLITS}


def _class_folders(split_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def scan_split(root: str, split: str, classes: list[str], check: bool, threads: int = SCAN_THREADS,
               progress: bool | None = None, folders: dict[str, int] | None = None,
               max_pixels: int | None = PILLOW_MAX_IMAGE_PIXELS) -> Index:
    """The Index of ROOT/split, scanned now (datamodules/scan.py). `folders` gets {folder: mtime_ns} of every folder
    entered (the cache's key); files above `max_pixels`' warning go to Index.large_files."""
    samples, bad, empty, large = scan_files(root, split, classes, check, threads, progress, folders, max_pixels)
    index = Index(root, split, list(classes), samples, bad, empty)
    index.large_files = large
    return index
