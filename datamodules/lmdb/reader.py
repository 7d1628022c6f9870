"""Random access to a packed LMDB database, without Lightning.

DALI's spawned `external_source` workers read through `LMDBReader`, and loader workers that unpickle their dataset
(--data.worker_start forkserver, spawn) through `LMDBSource`; importing them must not pull in `datamodules.base`
(Lightning), which costs each worker seconds. `datamodules.lmdb` re-exports both.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import lmdb
import numpy as np

from datamodules.errors import DataError
from datamodules.lmdb.format import HEADER, META_KEY, close_env, read_meta, sample_key, shared_env, unpack_value

__all__ = ["LMDBReader", "MapPrefetch"]


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
        self._tls: tuple[int, threading.local] | None = None

    @property
    def meta(self) -> dict:
        if self._meta is None:
            self._meta = json.loads(bytes(self._transaction().get(META_KEY)))
        return self._meta

    def count(self, split: str) -> int:
        if split not in self._counts:
            raise DataError(f"LMDB database {self.path} has no split {split!r} (it has {sorted(self._counts)}).")
        return self._counts[split]

    def _transaction(self) -> lmdb.Transaction:
        if self._pid != os.getpid() or self._txn is None:
            # One long read transaction per process: the database never changes while it is read.
            self._txn = shared_env(self.path).begin(buffers=False)
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

    def view(self, key: bytes) -> memoryview | None:
        """The value of `key` as a read-only view into the memory map (no copy), or None.

        Each thread reads in its own long read transaction (py-lmdb opens every environment with
        MDB_NOTLS, lmdb/cffi.py, so one thread may hold several): the sample threads never share one.
        """
        try:
            return self._thread_txn().get(key)
        except lmdb.Error:  # the shared environment was closed by close(): open it again
            self._tls = None
            return self._thread_txn().get(key)

    def _thread_txn(self) -> lmdb.Transaction:
        tls = self._tls
        if tls is None or tls[0] != os.getpid():
            tls = self._tls = (os.getpid(), threading.local())
        txn = getattr(tls[1], "txn", None)
        if txn is None:
            txn = tls[1].txn = shared_env(self.path).begin(buffers=True)
        return txn

    def source_path(self, split: str, i: int) -> str:
        return os.path.join(self.meta.get("source_root", ""), self.meta["splits"][split]["paths"][i])

    def close(self) -> None:
        """Close this process's environment for this database (every reader of it reopens on next use)."""
        self._txn = self._pid = self._tls = None
        close_env(self.path)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_txn=None, _pid=None, _tls=None, _meta=None)  # the paths list can be large
        return state

    def __len__(self) -> int:
        return sum(self._counts.values())


class MapPrefetch:
    """Asks the kernel to read a whole value of the memory map in one request.

    Readers open the environment with readahead=False (MADV_RANDOM: right for random access to a
    database larger than RAM), so on a cold cache every 4 KiB page of a 100 KB image would be its
    own synchronous read. posix_fadvise(WILLNEED) on the value's range of data.mdb starts one read
    of exactly those bytes. The value's file offset is its address minus where data.mdb is mapped
    (/proc/self/maps; elsewhere this does nothing).
    """

    def __init__(self, path: str) -> None:
        self.file = os.path.realpath(os.path.join(path, "data.mdb"))
        # (pid, fd, base) published as ONE attribute: the sample threads of a worker call this at once,
        # and must never see a base without its fd (that race once passed fd None to posix_fadvise).
        self._state: tuple[int, int | None, int | None] | None = None
        self._lock = threading.Lock()

    def __call__(self, view: memoryview) -> None:
        state = self._state
        if state is None or state[0] != os.getpid():
            state = self._open()
        _, fd, base = state
        if fd is not None and len(view) > 4096:
            addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
            os.posix_fadvise(fd, addr - base, len(view), os.POSIX_FADV_WILLNEED)

    def _open(self) -> tuple[int, int | None, int | None]:
        with self._lock:
            state = self._state
            if state is not None and state[0] == os.getpid():
                return state  # another thread opened it meanwhile
            fd = base = None
            if hasattr(os, "posix_fadvise"):
                try:
                    with open("/proc/self/maps") as f:
                        for line in f:
                            fields = line.split(maxsplit=5)
                            if len(fields) == 6 and fields[5].strip() == self.file:
                                base = int(fields[0].split("-")[0], 16) - int(fields[2], 16)
                                break
                    if base is not None:
                        fd = os.open(self.file, os.O_RDONLY)
                except (OSError, ValueError):
                    fd = base = None
            self._state = (os.getpid(), fd, base)
            return self._state

    def __getstate__(self) -> dict:
        return {"file": self.file, "_state": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


class LMDBSource:
    """The image bytes of one split's values, as read-only views into the memory map (no copy).

    Valid while the reader's per-process read transaction lives (for the life of the process).
    """

    def __init__(self, reader: LMDBReader, split: str) -> None:
        self.reader = reader
        self.split = split
        self.prefetch = MapPrefetch(reader.path)

    def read(self, i: int) -> memoryview:
        key = sample_key(self.split, i)
        value = self.reader.view(key)
        if value is None:
            raise DataError(f"LMDB database {self.reader.path} lacks key {key.decode()}: it is damaged; pack it again.")
        self.prefetch(value)
        return value[HEADER.size:]

    def describe(self, i: int, error: Exception) -> str:
        return (f"cannot decode {self.split} sample {i} of {self.reader.path} "
                f"(source {self.reader.source_path(self.split, i)}): {error}. Pack the tree again.")
