"""Packing a whole ImageFolder tree into one LMDB (the format: format.py).

    python -m datamodules.lmdb --src ROOT --dst OUT.lmdb [--skip-invalid] [--workers N]

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
import sys
import time
from pathlib import Path

import lmdb
from PIL import Image

from datamodules.errors import DataError
from datamodules.index import SPLITS, Index, load_indexes
from datamodules.lmdb.format import (
    FORMAT,
    META_KEY,
    PROGRESS_KEY,
    VERSION,
    close_env,
    pack_value,
    read_meta,
    sample_key,
)
from datamodules.packing import list_bad, parallel_imap, require_source, source_size
from datamodules.processes.exits import tool
from datamodules.processes.locks import file_lock
from datamodules.sample.images import check_bytes, decode_rgb

_TURNS = range(2, 9)  # the EXIF orientations that turn or mirror (datamodules/sample/region.py)
COMMIT_EVERY = 1000  # images per write transaction
COMMIT_BYTES = 128 << 20


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
            # RGB or grayscale (every reader decodes gray to RGB by repeating it, as PIL's convert does), and no
            # EXIF orientation that turns (2 to 8; 0 is not one). A re-encoded PNG decodes about 5x slower than the
            # JPEG it replaces (the 20 grayscale photos in 900 ImageNet ones cost the LMDB loader 7% of its time).
            plain = img.format == "JPEG" and img.mode in ("RGB", "L") and img.getexif().get(0x0112, 1) not in _TURNS
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
    plan = [indexes["train"].classes, {s: list(indexes[s].samples) for s in SPLITS}]
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
    for (rel, _), (value, reencoded, why, _size) in zip(todo, results, strict=False):
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


def ensure_lmdb(src: str | os.PathLike, dst: str | os.PathLike, **kw) -> Path:
    """`dst`, packed from `src` on first use (or when `src` changed). Safe for DDP ranks starting at once."""
    return pack(src, dst, overwrite=True, progress=kw.pop("progress", True), **kw)


# ------------------------------------------------------------------------------ CLI

@tool("python -m datamodules.lmdb", on_stop="rerun the same command to resume from its last commit")
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
    require_source(a.src)
    out = pack(a.src, a.dst, skip_invalid=a.skip_invalid, workers=a.workers, progress=not a.quiet,
               overwrite=a.overwrite, commit_every=max(1, a.commit_every))
    meta = read_meta(out)
    counts = ", ".join(f"{s} {v['count']} (skipped {v['skipped']})" for s, v in meta["splits"].items())
    size = (out / "data.mdb").stat().st_size
    print(f"{out}: {counts}; {len(meta['classes'])} classes; {meta['reencoded']} re-encoded as PNG; "
          f"{size / 1e6:.1f} MB; {time.perf_counter() - t0:.1f} s")
