"""What TensorBoard shows of a run folder: its event files read back."""
from __future__ import annotations

import os
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def event_file_scalars(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(run_dir: str | os.PathLike, tag: str, kind: str = "scalars") -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard shows it: every event file of the folder, a resumed attempt's
    SessionLog START dropping what a killed one logged after its checkpoint. kind "images": (step, None)."""
    acc = EventAccumulator(str(Path(run_dir)), size_guidance={kind: 0})
    acc.Reload()
    if tag not in acc.Tags()[kind]:
        return []
    if kind == "images":
        return [(e.step, None) for e in acc.Images(tag)]
    return [(e.step, e.value) for e in acc.Scalars(tag)]
