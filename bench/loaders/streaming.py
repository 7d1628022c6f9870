"""`bench loaders`' streaming rows: the train split packed by `python -m datamodules.shards`, streamed by
StreamingDataModule from a local folder and from an S3 endpoint, and the bytes-only download ceiling.

The S3 endpoint is the one AWS_ENDPOINT_URL names (with the AWS_* credentials), or else a
`moto_server` this run starts on 127.0.0.1 and stops at the end. On loopback the S3 row measures
what streaming costs beyond ImageFolder (HTTP GETs of whole chunks, LitData's cache and per-item
reads), not a network: the download ceiling says how fast the endpoint hands out the chunks.

Cold (S3): the chunk cache is emptied between epochs, while the persistent workers wait for the
next one (each epoch makes LitData a new reader: litdata/streaming/dataset.py, __iter__ ->
_create_cache), so the epoch downloads every chunk again. Cold (folder): the chunk files are
evicted from the page cache, as the other rows' files are.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

from bench.loaders import ceilings
from bench.loaders.prepared import Prepared, Settings, Skip, datamodule_kwargs
from datamodules.processes.exits import die_with_parent

BUCKET = "fic-bench"
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _pack(s: Settings, dst: str) -> dict:
    from datamodules.shards.pack import pack

    return pack(s.root, dst, progress=True)  # returns at once when dst already holds this pack


def _chunk_files(pack_dir: Path) -> list[str]:
    return sorted(str(p) for p in (pack_dir / "train").glob("chunk-*.bin"))


def streaming_local(s: Settings) -> Prepared:
    from datamodules import StreamingDataModule

    dst = s.work / "shards"
    meta = _pack(s, str(dst))
    dm = StreamingDataModule(**datamodule_kwargs(StreamingDataModule, s, data_dir=str(dst)))
    dm.setup("fit")
    train = meta["splits"]["train"]
    return Prepared(dm, _chunk_files(dst), train["bytes"] / max(1, train["count"]), "shards", "original",
                    note=f"LitData shards in {dst.name} ({train['chunks']} chunks), read in place")


class MotoServer:
    """`moto_server -H 127.0.0.1 -p PORT`: an in-memory S3 endpoint on loopback for this run, stopped by `close()`
    (or leaving its `with` block) on every way out: normal end, exception and Ctrl-C unwind to it; SIGTERM's
    handler (datamodules/processes/exits.py) kills the tool's descendants; and the server dies with its parent
    (`die_with_parent`). It stays in the tool's process group, so a signal to the group reaches it too."""

    def __init__(self, log: Path) -> None:
        exe = Path(sys.executable).parent / "moto_server"  # this environment's, before any on PATH
        exe = str(exe) if exe.exists() else shutil.which("moto_server") or ""
        if not exe:
            raise Skip("no S3 endpoint: set AWS_ENDPOINT_URL, or pip install 'moto[server]' for a local one")
        with socket.socket() as sock:  # a free port on loopback
            sock.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", self.url.rsplit(":", 1)[1]], stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent)  # noqa: PLW1509
        try:
            self._wait_listening(log)
        except BaseException:
            self.close()
            raise

    def _wait_listening(self, log: Path) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise Skip(f"moto_server did not start: {log.read_text()[-300:]}") from None
                time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def streaming_s3(s: Settings) -> Prepared:
    from datamodules import StreamingDataModule
    from datamodules.shards.s3_clients import s3_client

    server, saved = None, {}
    if not os.environ.get("AWS_ENDPOINT_URL"):
        server = MotoServer(s.work / "moto.log")
        for k, v in {**MOTO_ENV, "AWS_ENDPOINT_URL": server.url}.items():
            saved[k] = os.environ.get(k)
            os.environ[k] = v

    def close() -> None:
        if server is not None:
            server.close()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

    try:
        client = s3_client(None)
        if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/{s.root.name}"
        meta = _pack(s, url)
        cache = s.work / "s3-cache"
        shutil.rmtree(cache, ignore_errors=True)
        dm = StreamingDataModule(**datamodule_kwargs(StreamingDataModule, s, data_dir=url, cache_dir=str(cache)))
        dm.setup("fit")
    except BaseException:
        close()
        raise
    train = meta["splits"]["train"]
    endpoint = client.meta.endpoint_url

    def evict() -> str:
        for f in cache.rglob("*"):
            if f.is_file() and f.name != "index.json":
                f.unlink(missing_ok=True)
        return "chunk cache emptied"

    return Prepared(dm, [], train["bytes"] / max(1, train["count"]), "s3", "original",
                    note=f"{url} at {endpoint}{' (moto_server, loopback)' if server else ''}; "
                         f"{train['chunks']} chunks; cold: every chunk downloaded during the epoch",
                    evict=evict, io_ceiling=lambda: download_rate(url, threads=max(1, s.num_workers) * 2),
                    close=close)


def download_rate(url: str, threads: int = 4, storage_options: dict | None = None) -> ceilings.Ceiling:
    """Bytes-only ceiling: GET every train chunk of the pack with `threads` concurrent requests through the
    obstore client LitData downloads with (datamodules/shards/s3_clients.py), nothing decoded or written."""
    import json

    import obstore
    from litdata.streaming.client import S3Client
    from litdata.streaming.downloader import _obstore_credential_provider

    from datamodules.shards.s3_clients import client_settings, obstore_store, split_url

    bucket, prefix = split_url(url)
    litdata_client = S3Client(storage_options=client_settings(storage_options))  # as ShardS3Downloader makes it
    client = litdata_client.client
    index = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/train/index.json")["Body"].read())
    keys = [f"{prefix}/train/{c['filename']}" for c in index["chunks"]]
    store = obstore_store(bucket, client, _obstore_credential_provider(litdata_client))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))
    dt = max(time.perf_counter() - t0, 1e-9)
    images = sum(c["chunk_size"] for c in index["chunks"])
    return ceilings.Ceiling(images / dt, total / dt / 1e6, images, dt,
                            f"GET of {len(keys)} chunks, {threads} at a time (obstore), bytes only")
