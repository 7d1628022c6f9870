"""The Index's cache on disk: one JSON file per tree and split, valid while the key (the split's class list, the
check, the format's version) is the same and no folder the walk entered has changed its modification time. A
second start on a large tree costs one stat per folder and no per-file work."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

CACHE_VERSION = 4  # 4: val interleaved by class


def cache_file(root: str, split: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha1(f"{root}:{split}".encode()).hexdigest()
    return Path(base) / "fast-image-classifier" / "index" / f"{name}.json"


def cache_key(root: str, split: str, classes: list[str], check: bool) -> dict:
    # Adding, removing or renaming a file changes its folder's mtime, at any depth; editing a file in
    # place does not, so a file corrupted in place is caught at decode time instead.
    return {"version": CACHE_VERSION, "root": root, "split": split, "classes": classes, "check": check}


def read_cache(path: Path, key: dict, root: str) -> dict | None:
    """The cached Index's fields (Index.as_dict) when the key matches and no folder of the walk changed: one stat per
    folder."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key or not data.get("folders"):
        return None
    for rel, mtime in data["folders"].items():
        try:
            if os.stat(os.path.join(root, rel)).st_mtime_ns != mtime:
                return None
        except OSError:
            return None
    return data["index"]


def write_cache(path: Path, key: dict, index_fields: dict, folders: dict[str, int]) -> None:
    """`index_fields` (Index.as_dict) with the mtime of every folder the walk entered, written whole or not at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        relative = {os.path.relpath(f, index_fields["root"]): m for f, m in folders.items()}
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "folders": relative, "index": index_fields}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an optimisation only
