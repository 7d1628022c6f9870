"""The one part of SLURM this machine cannot run, `scontrol`, as a stand-in that records its arguments."""
from __future__ import annotations

import stat
from pathlib import Path


def fake_scontrol(folder: Path) -> Path:
    """A folder holding an `scontrol` that appends its arguments to folder/calls.txt; put it first on PATH."""
    folder.mkdir()
    tool = folder / "scontrol"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls.txt'}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return folder
