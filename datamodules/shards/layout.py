"""The layout of a pack made by `python -m datamodules.shards` (a local folder or s3://bucket/prefix).

    DEST/train/index.json, DEST/train/chunk-000000.bin, ...   one LitData dataset per split
    DEST/val/index.json,   DEST/val/chunk-000000.bin, ...
    DEST/fic-shards.json                                      written LAST: the pack is complete

Each item is a tuple (encoded image bytes exactly as in the source file, label, path relative to
the source root, position in the split's validated Index). Labels are the Index's, as for every
backend. The order was shuffled with a fixed seed before writing: LitData mixes samples only
within the chunks a worker holds, and an Index is sorted by class.

`fic-shards.json` holds the classes, per-split counts, the files left out and the source's
fingerprint. While a pack is under way, `.pack/` holds one record per finished chunk (so a killed
pack resumes); it is removed once the marker is written.
"""
from __future__ import annotations

import json

from datamodules.errors import DataError
from datamodules.index import SPLITS
from datamodules.shards.errors import PACK_HINT, as_data_error
from datamodules.shards.pack_store import Store

FORMAT = "fast-image-classifier-shards"
VERSION = 1
MARKER = "fic-shards.json"
PROGRESS = ".pack"
INDEX = "index.json"  # LitData's name (litdata/constants.py, _INDEX_FILENAME)
ITEM = ("image", "label", "path", "index")


def chunk_name(k: int) -> str:
    return f"chunk-{k:06d}.bin"


def read_meta(store: Store) -> dict:
    """The metadata of a complete pack; a DataError naming the place for anything else."""
    try:
        raw = store.read(MARKER)
        if raw is None:
            partial = bool(store.keys(PROGRESS + "/")) or store.read(f"train/{INDEX}") is not None
    except Exception as e:  # an unreachable store, refused credentials: one paragraph
        raise as_data_error(e, store.url, endpoint=getattr(store, "endpoint", None)) from e
    url = store.url
    if raw is None:
        what = ("an interrupted pack: run the same command again to finish it" if partial else
                "not a pack made by python -m datamodules.shards (or the prefix is wrong)")
        raise DataError(f"{url} has no {MARKER}: {what}. Pack an ImageFolder tree there with "
                        f"{PACK_HINT.format(url=url)}")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise DataError(f"{store.where(MARKER)} is not valid JSON ({e}); pack again: "
                        f"{PACK_HINT.format(url=url)}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{store.where(MARKER)} is format {meta.get('format')!r} version {meta.get('version')!r}; "
                        f"this code reads {FORMAT!r} version {VERSION}. Pack again: {PACK_HINT.format(url=url)}")
    missing = [s for s in SPLITS if s not in meta.get("splits", {})]
    if missing:
        raise DataError(f"{store.where(MARKER)} lacks the split(s) {missing}; pack again: {PACK_HINT.format(url=url)}")
    return meta
