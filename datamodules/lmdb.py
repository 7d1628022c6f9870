"""LMDB backend: a whole ImageFolder tree packed into one LMDB, and its DataModule.

    python -m datamodules.lmdb --src ROOT --dst OUT.lmdb [--skip-invalid] [--workers N]

Format (version 1; the DALI and benchmark code read it too):
  keys    f"{split}/{i:08d}" for split in train, val; i = 0..count-1 in Index order
          (files that failed to decode are absent from the numbering)
  values  b"FIC1" + label (uint32 little-endian) + encoded image: the original bytes of a plain
          RGB JPEG without EXIF rotation, otherwise a lossless PNG of `decode_rgb(file)`, so
          every decoder (PIL, DALI) gives the same RGB pixels as the ImageFolder backend
  __meta__ UTF-8 JSON (classes, per-split counts, skipped files, paths and labels in key
          order, source root, creation time); written LAST: a database without it is incomplete.

Packing writes to `.OUT.lmdb.partial` beside OUT.lmdb and renames it when complete. Every
commit also records how far it got (`__progress__`, in the same transaction), so a rerun after
an interruption RESUMES from the last commit (after checking the committed keys are all there
and that the source tree is unchanged; otherwise it starts over). OUT.lmdb itself only ever
appears complete.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import lmdb
import torch
from PIL import Image
from torch.utils.data import Dataset

from datamodules.base import BUILTIN_ROOT, REPO_ROOT, ImageDataModule
from datamodules.images import check_bytes, decode_rgb
from datamodules.index import SPLITS, DataError, Index, find_classes, load_indexes
from datamodules.packing import file_lock, list_bad, parallel_imap, source_size
from datamodules.transforms import train_transform, val_transform

FORMAT = "fast-image-classifier-lmdb"
VERSION = 1
MAGIC = b"FIC1"
HEADER = struct.Struct("<4sI")
META_KEY = b"__meta__"
PROGRESS_KEY = b"__progress__"
COMMIT_EVERY = 1000  # images per write transaction
COMMIT_BYTES = 128 << 20

__all__ = ["LMDBDataModule", "LMDBReader", "pack", "ensure_lmdb", "pack_value", "unpack_value", "sample_key", "main"]


def sample_key(split: str, i: int) -> bytes:
    return f"{split}/{i:08d}".encode()


def pack_value(data: bytes, label: int) -> bytes:
    return HEADER.pack(MAGIC, label) + data


def unpack_value(value: bytes | memoryview) -> tuple[bytes, int]:
    """(encoded image bytes, label) from a stored value."""
    magic, label = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise DataError(f"LMDB value does not start with {MAGIC!r} (found {bytes(magic)!r}): not a {FORMAT} database.")
    return bytes(value[HEADER.size:]), label


# ------------------------------------------------------------------------------ packing

def encode_for_db(path: str) -> tuple[bytes | None, bool, str | None, int]:
    """Read and fully decode one file: (value to store or None, re-encoded?, why unusable, source bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, False, f"unreadable ({e.strerror or e})", 0
    why = check_bytes(data[:1024], data[-1024:], len(data))
    if why:
        return None, False, why, len(data)
    try:
        with Image.open(io.BytesIO(data)) as img:
            plain = img.format == "JPEG" and img.mode == "RGB" and img.getexif().get(0x0112, 1) == 1
        image = decode_rgb(data)  # the full decode: the one-time check that makes training safe
    except Exception as e:  # noqa: BLE001 - any decoder failure makes the file unusable
        return None, False, f"cannot decode ({type(e).__name__}: {e})", len(data)
    if plain:
        return data, False, None, len(data)
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue(), True, None, len(data)


def _encode_job(job: tuple[str, int]) -> tuple[bytes | None, bool, str | None, int]:
    path, label = job
    data, reencoded, why, size = encode_for_db(path)
    return (pack_value(data, label) if data is not None else None), reencoded, why, size


def _fingerprint(indexes: dict[str, Index]) -> str:
    plan = [indexes["train"].classes, {s: indexes[s].samples for s in SPLITS}]
    return hashlib.sha1(json.dumps(plan).encode()).hexdigest()


def _open_writer(path: Path, map_size: int) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=map_size, subdir=True, readahead=False, meminit=False, max_dbs=0)


def _commit(env: lmdb.Environment, items: list[tuple[bytes, bytes]]) -> None:
    """Write `items` in one transaction, growing the map when a re-encoded image makes it full."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)


def _resume_state(tmp: Path, fingerprint: str, map_size: int) -> tuple[lmdb.Environment, dict] | None:
    """Open a partial database left by an interrupted run if it can be continued, else None."""
    if not (tmp / "data.mdb").is_file():
        return None
    try:
        env = _open_writer(tmp, max(map_size, (tmp / "data.mdb").stat().st_size * 2))
    except lmdb.Error:
        return None
    with env.begin() as txn:
        raw = txn.get(PROGRESS_KEY)
        state = json.loads(raw) if raw else None
        ok = state is not None and state.get("fingerprint") == fingerprint
        # Keys are written in order, so the committed count is right iff key count-1 is there
        # and key count is not.
        for split in SPLITS if ok else ():
            n = state["splits"][split]["count"]
            ok = (n == 0 or txn.get(sample_key(split, n - 1)) is not None) and txn.get(sample_key(split, n)) is None
            ok = ok and txn.get(META_KEY) is None
    if ok:
        return env, state
    env.close()
    return None


def read_meta(path: str | os.PathLike) -> dict:
    """The metadata of a packed database; a clear DataError for anything that is not one."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"LMDB database {str(path)!r} does not exist. Pack an ImageFolder tree first: "
            f"python -m datamodules.lmdb --src ROOT --dst {path}"
        )
    if not path.is_dir() or not (path / "data.mdb").is_file():
        raise DataError(
            f"{str(path)!r} is not an LMDB database (expected a folder holding data.mdb, as written by "
            f"python -m datamodules.lmdb --src ROOT --dst {path})."
        )
    entry = _ENVS.get(str(path.absolute()))
    if entry is not None and entry[0] == os.getpid():  # already open in this process: reuse it
        with entry[1].begin() as txn:
            raw = txn.get(META_KEY)
    else:
        try:
            env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, meminit=False, subdir=True)
        except lmdb.Error as e:
            raise DataError(f"cannot open LMDB database {str(path)!r}: {e}") from e
        try:
            with env.begin() as txn:
                raw = txn.get(META_KEY)
        finally:
            env.close()
    if raw is None:
        raise DataError(
            f"LMDB database {str(path)!r} has no {META_KEY.decode()} record: it is incomplete (an interrupted "
            "or foreign pack). Pack it again with python -m datamodules.lmdb --src ROOT --dst " + str(path)
        )
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise DataError(f"the metadata of LMDB database {str(path)!r} is not valid JSON ({e}); pack it again.") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"LMDB database {str(path)!r} is format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"this code reads {FORMAT!r} version {VERSION}. Pack it again."
        )
    return meta


def pack(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    skip_invalid: bool = False,
    workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    commit_every: int = COMMIT_EVERY,
) -> Path:
    """Pack the ImageFolder tree `src` into the LMDB folder `dst` (atomically, resumably) and return `dst`.

    An existing complete `dst` from the same source listing is returned as it is; another
    existing `dst` is replaced only with `overwrite`.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    with file_lock(dst.parent / f".{dst.name}.lock"):
        indexes = load_indexes(src)
        fingerprint = _fingerprint(indexes)
        if dst.exists():
            try:
                same = read_meta(dst).get("source_fingerprint") == fingerprint
            except DataError:
                same = False
            if same:
                return dst
            if not overwrite:
                raise DataError(
                    f"{dst} already exists and is not a complete pack of {src}; delete it or choose another --dst."
                )
        tmp = dst.parent / f".{dst.name}.partial"
        paths = [os.path.join(src, p) for s in SPLITS for p, _ in indexes[s].samples]
        map_size = max(source_size(paths) * 3, 1 << 20) + (256 << 20)
        try:  # killed between the last commit and the rename: only the rename is left to do
            finished = read_meta(tmp).get("source_fingerprint") == fingerprint
        except DataError:
            finished = False
        if finished:
            if dst.exists():
                close_env(dst)
                shutil.rmtree(dst)
            os.rename(tmp, dst)
            return dst
        resumed = _resume_state(tmp, fingerprint, map_size)
        if resumed is None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            env = _open_writer(tmp, map_size)
            state = {"fingerprint": fingerprint,
                     "splits": {s: {"done": 0, "count": 0, "bad": [], "reencoded": 0} for s in SPLITS}}
        else:
            env, state = resumed
            if progress:
                print(f"resuming the interrupted pack in {tmp} "
                      f"({sum(v['done'] for v in state['splits'].values())} images already done)", file=sys.stderr)
        try:
            for split in SPLITS:
                _pack_split(env, state, split, indexes[split], workers, progress, commit_every)
            bad = [(os.path.join(src, p), why) for s in SPLITS for p, why in indexes[s].bad_files + [
                tuple(b) for b in state["splits"][s]["bad"]]]
            if bad and not skip_invalid:
                raise DataError(
                    f"{len(bad)} image file(s) of {src} cannot be decoded:\n{list_bad(bad)}\n"
                    f"Fix or delete them and rerun, or rerun with --skip-invalid to leave them out "
                    f"(the {sum(v['count'] for v in state['splits'].values())} good images packed so far are kept "
                    f"in {tmp} and reused)."
                )
            meta = _meta(src, indexes, state, fingerprint)
            with env.begin(write=True) as txn:
                txn.put(META_KEY, json.dumps(meta).encode())
                txn.delete(PROGRESS_KEY)
            env.sync(True)
        finally:
            env.close()
        if dst.exists():
            close_env(dst)
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.rename(dst, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, dst)
    return dst


def _pack_split(env: lmdb.Environment, state: dict, split: str, index: Index, workers: int | None,
                progress: bool, commit_every: int) -> None:
    st = state["splits"][split]
    todo = index.samples[st["done"]:]
    if not todo:
        return
    jobs = [(os.path.join(index.root, rel), label) for rel, label in todo]
    results = parallel_imap(_encode_job, jobs, workers=workers, desc=f"pack {split}", progress=progress,
                            nbytes=lambda r: r[3])
    pending: list[tuple[bytes, bytes]] = []
    pending_bytes = 0
    for (rel, _), (value, reencoded, why, _size) in zip(todo, results):
        if value is None:
            st["bad"].append([rel, why])
        else:
            pending.append((sample_key(split, st["count"]), value))
            pending_bytes += len(value)
            st["count"] += 1
            st["reencoded"] += int(reencoded)
        st["done"] += 1
        if len(pending) >= commit_every or pending_bytes >= COMMIT_BYTES:
            _commit(env, pending + [(PROGRESS_KEY, json.dumps(state).encode())])
            pending, pending_bytes = [], 0
    _commit(env, pending + [(PROGRESS_KEY, json.dumps(state).encode())])


def _meta(src: Path, indexes: dict[str, Index], state: dict, fingerprint: str) -> dict:
    splits = {}
    for s in SPLITS:
        st = state["splits"][s]
        bad = {p for p, _ in st["bad"]}
        kept = [(p, label) for p, label in indexes[s].samples if p not in bad]
        assert len(kept) == st["count"]
        skipped = [list(b) for b in indexes[s].bad_files] + st["bad"]
        splits[s] = {"count": st["count"], "skipped": len(skipped), "paths": [p for p, _ in kept],
                     "labels": [label for _, label in kept], "skipped_files": skipped}
    return {
        "format": FORMAT,
        "version": VERSION,
        "classes": indexes["train"].classes,
        "splits": splits,
        "source_root": str(src),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "reencoded": sum(state["splits"][s]["reencoded"] for s in SPLITS),
        "source_fingerprint": fingerprint,
    }


# ------------------------------------------------------------------------------ reading

# One read-only environment per database and process, shared by every reader in it: py-lmdb
# refuses to open a path twice in one process, and its record of open paths survives fork.
_ENVS: dict[str, tuple[int, lmdb.Environment]] = {}


def _shared_env(path: str) -> lmdb.Environment:
    pid = os.getpid()
    entry = _ENVS.get(path)
    if entry is not None:
        if entry[0] == pid:
            return entry[1]
        entry[1].close()  # inherited through fork: unusable here, and it blocks a new open
    env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False, subdir=True)
    _ENVS[path] = (pid, env)
    return env


def close_env(path: str | os.PathLike) -> None:
    """Close this process's handle on a database (readers reopen it when next used)."""
    entry = _ENVS.pop(str(Path(path).absolute()), None)
    if entry is not None and entry[0] == os.getpid():
        entry[1].close()


class LMDBReader:
    """Random access to a packed database. Picklable; the environment opens lazily, once per process."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(Path(path).absolute())
        meta = read_meta(self.path)  # opens the environment briefly and closes it again
        self._meta: dict | None = meta
        self.classes: list[str] = list(meta["classes"])
        self._counts = {s: int(meta["splits"][s]["count"]) for s in meta["splits"]}
        self._txn: lmdb.Transaction | None = None
        self._pid: int | None = None

    @property
    def meta(self) -> dict:
        if self._meta is None:
            self._meta = json.loads(self._transaction().get(META_KEY))
        return self._meta

    def count(self, split: str) -> int:
        if split not in self._counts:
            raise DataError(f"LMDB database {self.path} has no split {split!r} (it has {sorted(self._counts)}).")
        return self._counts[split]

    def _transaction(self) -> lmdb.Transaction:
        if self._pid != os.getpid() or self._txn is None:
            # One long read transaction per process: the database never changes while it is read.
            self._txn = _shared_env(self.path).begin(buffers=False)
            self._pid = os.getpid()
        return self._txn

    def get(self, split: str, i: int) -> tuple[bytes, int]:
        """(encoded image bytes, label) of sample `i` of `split`."""
        if not 0 <= i < self.count(split):
            raise IndexError(f"sample {i} out of range for {split} ({self.count(split)} samples) in {self.path}")
        key = sample_key(split, i)
        try:
            value = self._transaction().get(key)
        except lmdb.Error:  # the shared environment was closed by close(): open it again
            self._txn = None
            value = self._transaction().get(key)
        if value is None:
            raise DataError(f"LMDB database {self.path} lacks key {key.decode()}: it is damaged; pack it again.")
        return unpack_value(value)

    def source_path(self, split: str, i: int) -> str:
        return os.path.join(self.meta.get("source_root", ""), self.meta["splits"][split]["paths"][i])

    def close(self) -> None:
        """Close this process's environment for this database (every reader of it reopens on next use)."""
        self._txn = self._pid = None
        close_env(self.path)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_txn=None, _pid=None, _meta=None)  # the paths list can be large
        return state

    def __len__(self) -> int:
        return sum(self._counts.values())


class LMDBDataset(Dataset):
    """One split of a packed database, decoded to RGB and transformed like the ImageFolder backend."""

    def __init__(self, reader: LMDBReader, split: str, transform: Callable) -> None:
        self.reader = reader
        self.split = split
        self.transform = transform
        self.length = reader.count(split)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, label = self.reader.get(self.split, i)
        try:
            image = decode_rgb(data)
        except Exception as e:  # noqa: BLE001 - name the sample, whatever the decoder raised
            raise DataError(
                f"cannot decode {self.split} sample {i} of {self.reader.path} "
                f"(source {self.reader.source_path(self.split, i)}): {e}. Pack the tree again."
            ) from e
        return self.transform(image), label


def ensure_lmdb(src: str | os.PathLike, dst: str | os.PathLike, **kw) -> Path:
    """`dst`, packed from `src` on first use (or when `src` changed). Safe for DDP ranks starting at once."""
    return pack(src, dst, overwrite=True, progress=kw.pop("progress", True), **kw)


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
            from datamodules.builtin import ensure_builtin

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
            indexes[s] = Index(str(self.root), s, self.classes, list(zip(paths, labels)))
        return indexes

    def make_dataset(self, split: str, index: Index) -> Dataset:
        if split == "train":
            transform = train_transform(self.train_size, self.min_scale, augment=self.train_augment)
        else:
            transform = val_transform(self.val_image_size, self.val_crop_ratio)
        return LMDBDataset(self.reader, split, transform)


# ------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.lmdb",
        description="Pack both splits of an ImageFolder tree (ROOT/train/<class>/*, ROOT/val/<class>/*) into one "
                    "LMDB database for fast training (--data datamodules.LMDBDataModule --data.data_dir OUT.lmdb). "
                    "Every image is decoded once while packing; broken files are listed at the end. Writes to "
                    ".OUT.lmdb.partial beside OUT.lmdb and renames it when complete; rerunning after an "
                    "interruption resumes from the last commit.",
    )
    ap.add_argument("--src", required=True, type=Path, help="ImageFolder root holding train/ and val/")
    ap.add_argument("--dst", required=True, type=Path, help="output database folder, e.g. data/imagenet.lmdb")
    ap.add_argument("--skip-invalid", action="store_true", help="leave undecodable files out (counted in the metadata)")
    ap.add_argument("--workers", type=int, default=None, help="decode processes (default: all CPU cores)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --dst from another source")
    ap.add_argument("--commit-every", type=int, default=COMMIT_EVERY,
                    help=f"images per write transaction: the most a rerun redoes (default: {COMMIT_EVERY})")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = pack(a.src, a.dst, skip_invalid=a.skip_invalid, workers=a.workers, progress=not a.quiet,
                   overwrite=a.overwrite, commit_every=max(1, a.commit_every))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    meta = read_meta(out)
    counts = ", ".join(f"{s} {v['count']} (skipped {v['skipped']})" for s, v in meta["splits"].items())
    size = (out / "data.mdb").stat().st_size
    print(f"{out}: {counts}; {len(meta['classes'])} classes; {meta['reencoded']} re-encoded as PNG; "
          f"{size / 1e6:.1f} MB; {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
