"""Checkpoints crafted for tests."""
from __future__ import annotations

import pathlib

import torch


class _RunsCode:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def evil_file(tmp_path, name="evil.ckpt") -> tuple[pathlib.Path, pathlib.Path]:
    marker = tmp_path / "code_ran"
    path = tmp_path / name
    torch.save({"state_dict": {"backbone.fc.weight": torch.zeros(2, 2)}, "payload": _RunsCode(str(marker))}, path)
    return path, marker
