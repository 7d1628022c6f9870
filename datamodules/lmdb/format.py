"""The LMDB format shared by the packer (pack.py), the reader (reader.py, datamodule.py) and DALI.

Format (version 1):
  keys    f"{split}/{i:08d}" for split in train, val; i = 0..count-1 in Index order
          (files that failed to decode are absent from the numbering)
  values  b"FIC1" + label (uint32 little-endian) + encoded image: the original bytes of a plain
          RGB JPEG without EXIF rotation, otherwise a lossless PNG of `decode_rgb(file)`, so
          every decoder (PIL, libjpeg-turbo, DALI) gives the same RGB pixels as the ImageFolder backend
  __meta__ UTF-8 JSON (classes, per-split counts, skipped files, paths and labels in key
          order, source root, creation time); written LAST: a database without it is incomplete.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import lmdb

from datamodules.errors import DataError

FORMAT = "fast-image-classifier-lmdb"
VERSION = 1
MAGIC = b"FIC1"
HEADER = struct.Struct("<4sI")
META_KEY = b"__meta__"
PROGRESS_KEY = b"__progress__"



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


# One read-only environment per database and process, shared by every reader in it: py-lmdb
# refuses to open a path twice in one process, and its record of open paths survives fork.
_ENVS: dict[str, tuple[int, lmdb.Environment]] = {}
_ENVS_LOCK = threading.Lock()


def shared_env(path: str) -> lmdb.Environment:
    with _ENVS_LOCK:  # sample threads may open it at once; a second open of a path raises
        return _open_shared(path)


def _open_shared(path: str) -> lmdb.Environment:
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
