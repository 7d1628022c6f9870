"""What a file on disk is, read without torch: a checkpoint torch.save wrote (zip or the legacy pickle), or one cut
short by a full disk or a killed copy. runs/ reads checkpoints' folders with it and needs no torch for that."""
from __future__ import annotations

import os
import zipfile

# torch.save's legacy format (before PyTorch 1.6) starts with a pickled magic number (torch/serialization.py,
# MAGIC_NUMBER 0x1950a86a20f9469cfc6c, written with pickle protocol 2: PROTO 2, LONG1 of 10 bytes).
ZIP_START = b"PK\x03\x04"  # a zip archive's first local file header: torch.save's format since torch 1.6
LEGACY_TORCH_START = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def is_torch_file(path: str | os.PathLike) -> bool:
    """Whether torch.save wrote `path`: a zip archive holding <name>/data.pkl, or the legacy pickle format."""
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                return any(n == "data.pkl" or n.endswith("/data.pkl") for n in archive.namelist())
        except (zipfile.BadZipFile, OSError):
            return False
    with open(path, "rb") as f:
        return f.read(len(LEGACY_TORCH_START)) == LEGACY_TORCH_START


def damage(path: str | os.PathLike) -> str | None:
    """How a checkpoint was cut short, as a write stopped by a full disk or a killed copy leaves it: "empty (0 bytes)",
    or "truncated: N bytes" for a zip archive (torch.save's format) without the directory every complete one ends
    with (what torch then says, "mmap can only be used with files saved with ..." or "failed finding central
    directory", names neither). None for a file that is whole, or not a checkpoint at all."""
    size = os.path.getsize(path)
    if size == 0:
        return "empty (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(len(ZIP_START))
    if head == ZIP_START and not zipfile.is_zipfile(path):
        return f"truncated: {size:,} bytes, without the zip directory that ends every complete checkpoint"
    return None
