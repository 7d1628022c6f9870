"""predict without --data.predict_dir predicts the val split of the data the command sets up. When that is not the
data the checkpoint was trained on (its run's run.json says which), the checkpoint would label another dataset's
images with its own classes and exit 0: refused in one paragraph instead, before any data is generated or read."""
from __future__ import annotations

import os
from pathlib import Path

from lightning_app.errors import UserError
from lightning_app.runs.folders import run_of_checkpoint
from lightning_app.runs.identity import read_run


def run_of(checkpoint: str | os.PathLike | None) -> Path | None:
    """The run folder of a checkpoint file (version_N/checkpoints/NAME.ckpt), else None."""
    if not checkpoint or not os.path.isfile(checkpoint):
        return None
    found = run_of_checkpoint(checkpoint)
    return found[1] if found else None


def _where(data: dict) -> tuple[str | None, str | None]:
    """(the data folder made absolute, or None; the built-in preset when there is no folder)."""
    data_dir = data.get("data_dir")
    if isinstance(data_dir, str) and "://" not in data_dir:
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
    return data_dir, None if data_dir else data.get("builtin")


def _say(data_dir: str | None, builtin: str | None) -> str:
    return data_dir if data_dir else f"the built-in data ({builtin or 'its default preset'}: no --data.data_dir)"


def check_predict_data(subcommand: str | None, data: dict, run_dir: Path | None, checkpoint: str | None) -> None:
    """Refuse a predict of the val split of other data than the checkpoint's run trained on. `data` is the
    command's data init args; nothing is checked with --data.predict_dir, or without a run.json to compare."""
    if subcommand != "predict" or data.get("predict_dir") or run_dir is None:
        return
    record = read_run(run_dir)
    trained = (record or {}).get("training", {}).get("data")
    if not isinstance(trained, dict):
        return
    ours, theirs = _where(data), _where(trained)
    if ours == theirs:
        return
    their_dir = f" --data.data_dir {theirs[0]}" if theirs[0] else f" --data.builtin {theirs[1]}" if theirs[1] else ""
    raise UserError(
        f"predict without --data.predict_dir predicts the val split of {_say(*ours)}, but {checkpoint} was trained "
        f"on {_say(*theirs)} ({run_dir / 'run.json'}): its classes would label images of another dataset. Give the "
        f"images to predict with --data.predict_dir PATH, or predict the val split it was trained on with"
        f"{their_dir or ' that data'}.")

