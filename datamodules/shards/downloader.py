"""How LitData downloads the chunks of an s3:// pack: `ShardS3Downloader`, registered for s3:// through
litdata's public `register_downloader`, is litdata 0.2.76's S3Downloader (litdata/streaming/downloader.py) with:

- the store and client of s3_clients.py: bounded retries and timeouts, `allow_http` for an http:// endpoint;
- a size check: a chunk whose object is shorter than its index.json says fails at once (ChunkSizeError),
  where litdata would wait 30 s for the rest, then download it again;
- index.json waited for: litdata gives another process's download of it 1 s (S3Downloader.download_file,
  `FileLock(..., timeout=1)`), then goes on without the file and fails with "doesn't contain any
  index.json file". Every rank of a node, and nodes that share a cache folder, fetch it at the same moment;
- one code path for every download: litdata fetches several chunks at once on its prefetch thread's
  event loop (async_prefetch.py, download_chunk_indexes_concurrently). `adownload_file` runs
  `download_file` in a thread, as litdata itself does for a downloader without a native async path, so
  the checks above hold there too. It also keeps obstore's native futures off that loop: when one
  download fails, the prefetch thread ends and closes its loop (reader.py, PrepareChunksThread.run ->
  close_thread_event_loop), and an obstore GET still under way then completes into the closed loop
  and prints "Event loop is closed" tracebacks in the worker. A thread's result is dropped quietly.
"""
from __future__ import annotations

import asyncio
import os
import time
from contextlib import suppress
from typing import Any

from datamodules.shards.s3_clients import ATTEMPTS, READ_TIMEOUT_S, client_settings, obstore_store

INDEX_WAIT_S = READ_TIMEOUT_S * ATTEMPTS  # the longest another process's index.json download may take


class ChunkSizeError(OSError):
    """A downloaded chunk whose size is not the one its index.json records."""


_class: type | None = None


def __getattr__(name: str) -> Any:
    """`ShardS3Downloader`, made on first use (litdata is imported then): the name a pickled reference to it (a
    dataset sent to a forkserver or spawned worker, --data.worker_start) is looked up by."""
    if name == "ShardS3Downloader":
        return _downloader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _downloader_class():
    global _class
    if _class is not None:
        return _class
    from filelock import FileLock, Timeout
    from litdata.constants import _INDEX_FILENAME
    from litdata.streaming import downloader as ld

    class ShardS3Downloader(ld.S3Downloader):
        """litdata's S3 downloader, with the changes of the module doc."""

        def __init__(self, remote_dir: str, cache_dir: str, chunks: list, storage_options: dict | None = None,
                     **kwargs: Any) -> None:
            super().__init__(remote_dir, cache_dir, chunks, client_settings(storage_options), **kwargs)

        def download_file(self, remote_filepath: str, local_filepath: str) -> None:
            super().download_file(remote_filepath, local_filepath)
            if remote_filepath.endswith(_INDEX_FILENAME):
                self._wait_for_index(remote_filepath, local_filepath)
            self._check_size(remote_filepath, local_filepath)

        async def adownload_file(self, remote_filepath: str, local_filepath: str) -> None:
            await asyncio.to_thread(self.download_file, remote_filepath, local_filepath)

        def _wait_for_index(self, remote_filepath: str, local_filepath: str) -> None:
            """Another process holds the download lock: wait for its index.json, or fetch it once it gave up."""
            deadline = time.monotonic() + INDEX_WAIT_S
            while not os.path.exists(local_filepath) and time.monotonic() < deadline:
                with suppress(Timeout), FileLock(local_filepath + ".lock", timeout=deadline - time.monotonic()):
                    pass
                super().download_file(remote_filepath, local_filepath)

        def _check_size(self, remote_filepath: str, local_filepath: str) -> None:
            expected = ld._indexed_object_bytes(self._chunks, remote_filepath)  # index.json: 0, not checked
            size = os.path.getsize(local_filepath) if expected and os.path.exists(local_filepath) else expected
            if size != expected:
                os.remove(local_filepath)
                raise ChunkSizeError(f"{remote_filepath} is {size} bytes, its index.json says {expected}")

        def _get_store(self, bucket: str) -> Any:
            # the same process-local caching (and fork check) as S3Downloader._get_store
            return ld._cached_obstore_store(
                self, lambda: obstore_store(bucket, self._client.client, ld._obstore_credential_provider(self._client)))

    ShardS3Downloader.__qualname__ = "ShardS3Downloader"  # pickled by name: this module's __getattr__
    _class = ShardS3Downloader
    return _class


_registered = False


def register_downloader() -> None:
    """Make litdata download s3:// chunks with `ShardS3Downloader` in this process (idempotent).

    Called where a StreamingDataset is made and, after unpickling, in every DataLoader worker
    (a spawned worker starts with litdata's own registry).
    """
    global _registered
    if _registered:
        return
    from litdata.streaming.downloader import register_downloader as register

    register("s3://", _downloader_class(), overwrite=True)
    _registered = True
