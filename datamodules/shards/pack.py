"""Packing an ImageFolder tree into LitData shards, in a local folder or in object storage (layout.py).

    python -m datamodules.shards --src ROOT --dst DIR|s3://bucket/prefix [--create-bucket] [--skip-invalid]

Each split of the validated Index is shuffled with a fixed seed, cut into chunks of about
--chunk-mb, and every file is read and decoded once (a file that fails is named, and left out
with --skip-invalid). A chunk is written by LitData's own BinaryWriter (litdata/streaming/writer.py),
fsynced, moved or uploaded into place, and only then recorded as done under `.pack/`: a killed pack,
run again, redoes at most the chunks in flight. The splits' index.json files come after every
chunk, and `fic-shards.json` last, so an incomplete pack is never taken for a finished one. A local
--dst is built in `.NAME.partial` beside it and renamed when complete. An s3:// --dst's bucket must exist, or
--create-bucket makes it with the packer's own client.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from datamodules.errors import DataError
from datamodules.index import SPLITS, Index, load_indexes
from datamodules.packing import list_bad, parallel_imap, require_source
from datamodules.processes.exits import tool
from datamodules.sample.decode import decode  # imported before the pool forks: workers start at once
from datamodules.sample.images import check_bytes
from datamodules.shards.errors import as_data_error, missing_bucket
from datamodules.shards.layout import FORMAT, INDEX, ITEM, MARKER, PROGRESS, VERSION, chunk_name, read_meta
from datamodules.shards.pack_store import LocalStore, S3Store, Store, open_store
from datamodules.shards.s3_clients import is_remote

DEFAULT_CHUNK_MB = 16  # small enough that every worker starts on its own chunk soon; large enough per GET
DEFAULT_SEED = 0
SIZE_SAMPLE = 1000  # files whose sizes set the items per chunk


def read_checked(path: str) -> tuple[bytes | None, str | None]:
    """(the file's bytes, None), or (None, why it is unusable): cheap checks, then one full decode."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    why = check_bytes(data[:1024], data[-1024:], len(data))
    if why:
        return None, why
    try:
        decode(bytearray(data))  # the decoder training uses: what passes here trains
    except Exception as e:  # noqa: BLE001 - any decoder failure makes the file unusable
        return None, f"cannot decode ({type(e).__name__}: {e})"
    return data, None


def plan(indexes: dict[str, Index], seed: int, chunk_bytes: int) -> dict:
    """Per split: the shuffled order (positions in the Index) and the items per chunk."""
    out = {}
    for split in SPLITS:
        index = indexes[split]
        order = list(range(len(index)))
        random.Random(f"{seed}:{split}").shuffle(order)
        sample = order[:: max(1, len(order) // SIZE_SAMPLE)][:SIZE_SAMPLE]
        sizes = [os.path.getsize(index.path(i)) for i in sample]
        mean = sum(sizes) / max(1, len(sizes))
        out[split] = {"order": order, "per_chunk": max(1, int(chunk_bytes // max(1.0, mean + 16)))}
    return out


def fingerprint(indexes: dict[str, Index], layout: dict, seed: int) -> str:
    what = [FORMAT, VERSION, indexes["train"].classes, seed,
            {s: [list(indexes[s].samples), layout[s]["per_chunk"]] for s in SPLITS}]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()


def _chunks(order: list[int], per_chunk: int) -> list[list[int]]:
    return [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]


def _done_chunks(store: Store, split: str, fp: str) -> dict[int, dict]:
    """The chunks of `split` recorded as done by an earlier run of the same pack (and still in place)."""
    done = {}
    for key in store.keys(f"{PROGRESS}/{split}/"):
        raw = store.read(key)
        record = json.loads(raw) if raw else {}
        if record.get("fingerprint") != fp:
            continue
        chunk = record.get("chunk")
        if chunk is None or store.size(f"{split}/{chunk['filename']}") == chunk["chunk_bytes"]:
            done[int(record["k"])] = record
    return done


def _write_chunk(items: list[tuple], staging: Path) -> tuple[Path, dict, dict]:
    """LitData's BinaryWriter writes `items` as one chunk: (its file, its index entry, the index config)."""
    from litdata.streaming.writer import BinaryWriter

    tmp = Path(tempfile.mkdtemp(dir=staging, prefix="chunk-"))
    writer = BinaryWriter(str(tmp), chunk_size=len(items) + 1)  # +1: only done() closes the chunk
    for j, item in enumerate(items):
        writer.add_item(j, item)
    writer.done()
    written = json.loads(next(tmp.glob("*.index.json")).read_text())  # writer.write_chunks_index()
    (info,), config = written["chunks"], written["config"]
    return tmp / info["filename"], info, config


def _publish(store: Store, split: str, k: int, fp: str, file: Path | None, info: dict | None, config: dict | None,
             bad: list) -> None:
    """Chunk into place first, then its record: a record always means its chunk is whole."""
    if file is not None:
        info = dict(info, filename=chunk_name(k))
        store.put_file(file, f"{split}/{info['filename']}")
        shutil.rmtree(file.parent, ignore_errors=True)
    record = {"fingerprint": fp, "k": k, "chunk": info, "config": config, "bad": bad}
    store.write(f"{PROGRESS}/{split}/{k:06d}.json", json.dumps(record).encode())


def _pack_split(store: Store, split: str, index: Index, layout: dict, fp: str, staging: Path,
                workers: int | None, progress: bool) -> dict[int, dict]:
    chunks = _chunks(layout["order"], layout["per_chunk"])
    done = _done_chunks(store, split, fp)
    todo = [k for k in range(len(chunks)) if k not in done]
    if progress and done and todo:
        print(f"resuming {split}/ of {store.url}: {len(done)} of {len(chunks)} chunks already packed",
              file=sys.stderr)
    positions = [i for k in todo for i in chunks[k]]
    results = parallel_imap(read_checked, [index.path(i) for i in positions], workers=workers,
                            desc=f"pack {split}", progress=progress, nbytes=lambda r: len(r[0] or b""))
    pending: list[Future] = []
    with ThreadPoolExecutor(1, thread_name_prefix="publish") as publisher:  # uploads overlap the decoding
        for k in todo:
            items, bad = [], []
            for i in chunks[k]:
                data, why = next(results)
                rel, label = index.samples[i]
                if data is None:
                    bad.append([rel, why])
                else:
                    items.append((data, label, rel, i))
            file, info, config = _write_chunk(items, staging) if items else (None, None, None)
            pending.append(publisher.submit(_publish, store, split, k, fp, file, info, config, bad))
            while len(pending) > 2 or (pending and pending[0].done()):
                pending.pop(0).result()
        for f in pending:
            f.result()
    return _done_chunks(store, split, fp)


def _finish(store: Store, indexes: dict[str, Index], records: dict[str, dict[int, dict]], fp: str, seed: int,
            layout: dict, src: Path) -> dict:
    """Both splits' index.json, then the marker (last), then the progress records go."""
    created = _dt.datetime.now(_dt.timezone.utc)
    splits = {}
    for split in SPLITS:
        recs = [records[split][k] for k in sorted(records[split])]
        chunks = [r["chunk"] for r in recs if r["chunk"] is not None]
        config = next(r["config"] for r in recs if r["config"] is not None)
        index_json = {"chunks": chunks, "config": config, "updated_at": str(int(created.timestamp()))}
        store.write(f"{split}/{INDEX}", json.dumps(index_json, sort_keys=True).encode())
        skipped = [list(b) for b in indexes[split].bad_files] + [b for r in recs for b in r["bad"]]
        splits[split] = {"count": sum(c["chunk_size"] for c in chunks), "chunks": len(chunks),
                         "bytes": sum(c["chunk_bytes"] for c in chunks), "items_per_chunk": layout[split]["per_chunk"],
                         "max_chunk_bytes": max((c["chunk_bytes"] for c in chunks), default=0),
                         "skipped": len(skipped), "skipped_files": skipped}
    meta = {"format": FORMAT, "version": VERSION, "classes": indexes["train"].classes, "splits": splits,
            "item": list(ITEM), "seed": seed, "source_root": str(src), "source_fingerprint": fp,
            "created": created.isoformat(timespec="seconds")}
    store.write(MARKER, json.dumps(meta, indent=1).encode())
    store.delete(store.keys(PROGRESS + "/"))
    return meta


def _prepare(store: Store, fp: str, overwrite: bool, ours: bool) -> bool:
    """True when `store` already holds this very pack; clears what must go (--overwrite, a stale partial).

    ours: `store` is the packer's own .partial folder, whatever it holds may go.
    """
    marker = store.read(MARKER)
    if marker is not None:
        if json.loads(marker).get("source_fingerprint") == fp:
            return True
        if not overwrite:
            raise DataError(f"{store.url} already holds a pack of other data (or other settings); pass --overwrite "
                            "to replace it, or choose another --dst.")
        store.delete([MARKER])  # first: from here on nobody takes the old objects for a finished pack
    plan_raw = store.read(f"{PROGRESS}/plan.json")
    keys = store.keys()
    planned = json.loads(plan_raw).get("fingerprint") if plan_raw is not None else None
    if keys and (overwrite or planned not in (None, fp) or (ours and planned != fp)):
        store.delete(keys)  # another pack's leftovers: start over
    elif keys and planned is None:
        raise DataError(f"{store.url} is not empty and holds no pack (e.g. {keys[0]}); choose an empty --dst, or "
                        "pass --overwrite to delete everything under it first.")
    store.write(f"{PROGRESS}/plan.json", json.dumps({"fingerprint": fp}).encode())
    return False


def _pack(store: Store, src: Path, indexes: dict[str, Index], layout: dict, fp: str, seed: int,
          skip_invalid: bool, workers: int | None, progress: bool) -> dict:
    local = isinstance(store, LocalStore)
    staging = Path(store.url) / PROGRESS / "staging" if local else Path(tempfile.mkdtemp(prefix="fic-shards-"))
    staging.mkdir(parents=True, exist_ok=True)
    try:
        records = {s: _pack_split(store, s, indexes[s], layout[s], fp, staging, workers, progress) for s in SPLITS}
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    bad = [(os.path.join(src, p), why) for s in SPLITS for p, why in
           [tuple(b) for b in indexes[s].bad_files] + [tuple(b) for r in records[s].values() for b in r["bad"]]]
    if bad and not skip_invalid:
        raise DataError(f"{len(bad)} image file(s) of {src} cannot be decoded:\n{list_bad(bad)}\nFix or delete "
                        "them and rerun, or rerun with --skip-invalid to leave them out (the chunks packed so far "
                        f"are kept in {store.url} and reused).")
    return _finish(store, indexes, records, fp, seed, layout, src)


def pack(src: str | os.PathLike, dst: str, *, skip_invalid: bool = False, workers: int | None = None,
         chunk_mb: float = DEFAULT_CHUNK_MB, seed: int = DEFAULT_SEED, overwrite: bool = False,
         storage_options: dict | None = None, progress: bool = True, create_bucket: bool = False) -> dict:
    """Pack both splits of `src` into `dst`; returns the pack's metadata. Resumes an interrupted run.

    create_bucket: an s3:// `dst` whose bucket is missing gets it made (said in one line on stderr); without
    it, a missing bucket is a DataError saying how to make one."""
    src = Path(src).absolute()
    indexes = load_indexes(src)
    layout = plan(indexes, seed, int(chunk_mb * (1 << 20)))
    fp = fingerprint(indexes, layout, seed)
    local = not is_remote(dst)
    final = Path(dst).expanduser().absolute() if local else None
    if final is not None and final.exists():
        existing = LocalStore(final)
        if existing.read(MARKER) is not None and json.loads(existing.read(MARKER)).get("source_fingerprint") == fp:
            return read_meta(existing)
        if not overwrite:
            raise DataError(f"{final} already exists and is not this pack; delete it, pass --overwrite, or choose "
                            "another --dst.")
    store = LocalStore(final.parent / f".{final.name}.partial") if local else open_store(dst, storage_options)
    try:
        if isinstance(store, S3Store):
            _ensure_bucket(store, create_bucket)
        if _prepare(store, fp, overwrite, ours=local):
            meta = read_meta(store)  # finished earlier (a local pack killed before its rename)
        else:
            meta = _pack(store, src, indexes, layout, fp, seed, skip_invalid, workers, progress)
    except DataError:
        raise
    except Exception as e:  # an unreachable store, refused credentials: one paragraph
        raise as_data_error(e, str(dst), endpoint=getattr(store, "endpoint", None), side="packer") from e
    if local:
        shutil.rmtree(Path(store.url) / PROGRESS, ignore_errors=True)
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(store.url, final)
    return meta


def _ensure_bucket(store: S3Store, create: bool) -> None:
    if store.bucket_exists():
        return
    if not create:
        raise DataError(missing_bucket(store.url, store.endpoint))
    store.create_bucket()
    print(f"created the bucket s3://{store.bucket}" + (f" at {store.endpoint}" if store.endpoint else ""),
          file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.shards",
        description="Pack both splits of an ImageFolder tree (ROOT/train/<class>/*, ROOT/val/<class>/*) into LitData "
                    "shards for streaming (--config configs/data/streaming.yaml --data.data_dir DST). DST is a local "
                    "folder or s3://bucket/prefix; the endpoint and credentials come from the standard AWS "
                    "environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) or "
                    "--storage-options. The order is shuffled with a fixed seed; every image is decoded once and "
                    "broken files are listed. Rerunning after an interruption resumes; the pack counts as finished "
                    f"only once DST/{MARKER} exists.")
    ap.add_argument("--src", required=True, type=Path, help="ImageFolder root holding train/ and val/")
    ap.add_argument("--dst", required=True, help="output folder, or s3://bucket/prefix (the bucket must exist)")
    ap.add_argument("--create-bucket", action="store_true",
                    help="make the bucket of an s3:// DST if it is missing (same endpoint and credentials)")
    ap.add_argument("--skip-invalid", action="store_true", help="leave undecodable files out (listed in the metadata)")
    ap.add_argument("--workers", type=int, default=None, help="decode processes (default: all usable CPUs)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                    help=f"about this many MB per chunk (default {DEFAULT_CHUNK_MB})")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the shuffle before writing")
    ap.add_argument("--overwrite", action="store_true", help="replace what DST holds (another pack, other files)")
    ap.add_argument("--storage-options", default=None,
                    help='JSON of boto3 client arguments, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' '
                         "(keep credentials in the environment: a command line is visible to other users)")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


@tool("python -m datamodules.shards", on_stop="nothing half-written is used: rerun the same command")
def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        options = json.loads(a.storage_options) if a.storage_options else None
    except ValueError as e:
        raise DataError(f"--storage-options must be a JSON object, got {a.storage_options!r} ({e}).") from None
    if options is not None and not isinstance(options, dict):
        raise DataError(f"--storage-options must be a JSON object, got {a.storage_options!r}.")
    require_source(a.src)
    meta = pack(a.src, a.dst, skip_invalid=a.skip_invalid, workers=a.workers, chunk_mb=a.chunk_mb, seed=a.seed,
                overwrite=a.overwrite, storage_options=options, progress=not a.quiet, create_bucket=a.create_bucket)
    counts = ", ".join(f"{s} {v['count']} in {v['chunks']} chunks (skipped {v['skipped']})"
                       for s, v in meta["splits"].items())
    size = sum(v["bytes"] for v in meta["splits"].values())
    print(f"{a.dst}: {counts}; {len(meta['classes'])} classes; {size / 1e6:.1f} MB; "
          f"{time.perf_counter() - t0:.1f} s")
