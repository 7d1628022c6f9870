"""The MLflow and W&B run ids in run.json, so that a resumed fit continues those runs; and where each tracker wrote,
for the end-of-run line."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pytorch_lightning.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from lightning_app.runs.folders import write_atomically
from lightning_app.runs.identity import RUN_JSON, read_run
from lightning_app.trackers.make import allow_file_store


def remember(run_dir: Path, loggers: list[Logger]) -> None:
    """Write the MLflow and W&B run ids into run.json, so a resume continues them (launch rank zero only)."""
    ids = ids_of(loggers)
    if not ids:
        return
    path = Path(run_dir) / RUN_JSON
    record = json.loads(path.read_text())
    record["trackers"] = {**(record.get("trackers") or {}), **ids}
    write_atomically(path, json.dumps(record, indent=1).encode())


def ids_of(loggers: list[Logger]) -> dict:
    ids: dict = {}
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            ids["mlflow"] = {"run_id": logger.run_id, "tracking_uri": logger._tracking_uri,
                             "experiment_id": logger.experiment_id}
        elif isinstance(logger, WandbLogger):
            ids["wandb"] = {"id": logger.version, "project": logger.name, "offline": logger._offline}
    return ids


def on_resume(previous: dict, loggers: list[Logger]) -> str | None:
    """A resumed fit's trackers against its run.json's: which runs continue, which begin, and which end. A tracker
    left out of --trackers now ends its run as an uninterrupted fit would have (MLflow's marked FINISHED, not left
    KILLED at the stop); None when neither MLflow nor W&B is in either."""
    ids = ids_of(loggers)
    words = []
    for name, label, key in (("mlflow", "MLflow", "run_id"), ("wandb", "W&B", "id")):
        before, now = previous.get(name) or {}, ids.get(name) or {}
        if now and before.get(key) == now.get(key):
            words.append(f"{label} run {now[key]} continues")
        elif now:
            words.append(f"{label} begins run {now[key]}"
                         + (f" (its run {before[key]} is in another store)" if before.get(key) else ""))
        elif before.get(key):
            words.append(_end(name, before))
    return "trackers on resume: " + "; ".join(words) + "." if words else None


def _end(name: str, before: dict) -> str:
    """End the run of a tracker the resumed fit no longer names; the words that say so."""
    if name == "wandb":
        return f"W&B run {before['id']} is not continued (wandb is not in --trackers now)"
    run_id, uri = before["run_id"], before.get("tracking_uri") or ""
    try:
        from mlflow.tracking import MlflowClient

        allow_file_store(uri)
        MlflowClient(uri).set_terminated(run_id, status="FINISHED")
    except Exception as error:  # noqa: BLE001 - no MLflow here, or the store is gone: said, the fit goes on
        return f"MLflow run {run_id} is left as it was ({type(error).__name__}: {str(error)[:120]})"
    return f"MLflow run {run_id} ends here, FINISHED (mlflow is not in --trackers now)"


def recorded(run_dir: Path | None) -> dict | None:
    """The tracker ids in a run's run.json."""
    record = read_run(run_dir) if run_dir is not None else None
    return (record or {}).get("trackers")


def describe(loggers: list[Logger]) -> list[str]:
    """Where each tracker wrote, for the end-of-run line."""
    parts = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            parts.append(f"TensorBoard in {os.path.abspath(logger.log_dir)}")
        elif isinstance(logger, CSVLogger):
            parts.append(f"CSV in {os.path.abspath(os.path.join(logger.log_dir, 'metrics.csv'))}")
        elif isinstance(logger, MLFlowLogger):
            parts.append(f"MLflow run {logger.run_id} in {logger._tracking_uri}")
        elif isinstance(logger, WandbLogger):
            mode = "offline " if logger._offline else ""
            where = os.path.abspath(os.path.join(logger.save_dir, "wandb"))
            parts.append(f"W&B {mode}run {logger.version} in {where}")
    return parts
