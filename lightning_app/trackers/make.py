"""The loggers a run's `--trackers` name, each writing where the run folder's contract says (trackers/__init__.py)."""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from pytorch_lightning.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from lightning_app.trackers.loggers import RunCSVLogger, RunMLFlowLogger, RunWandbLogger

MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
FILE, SQLITE = "file:", "sqlite:///"


def build(names: list[str] | None, settings: dict, save_dir: Path, version: int | str | None,
          purge_step: int | None, folder: Path | None, resumed: dict | None, root: Path | None = None) -> list[Logger]:
    """The loggers: `save_dir`/`version` are the run plan's (lightning_app/runs/plan.py), `folder` the run's own
    (version_N, or validate_K), `resumed` the tracker ids of the run.json a resumed fit continues, `root` the runs'
    root (the MLflow store's folder; default save_dir)."""
    tensorboard = TensorBoardLogger(save_dir=str(save_dir), name="", version=version, default_hp_metric=False,
                                    **({"purge_step": purge_step} if purge_step is not None else {}))
    if names is None:
        return [tensorboard]
    folder = folder or save_dir
    resumed = resumed or {}
    loggers: list[Logger] = []
    for name in names:
        if name == "tensorboard":
            loggers.append(tensorboard)
        elif name == "csv":
            loggers.append(RunCSVLogger(save_dir=str(save_dir), name="", version=version, keep=purge_step != 0))
        elif name == "mlflow":
            loggers.append(_mlflow(settings.get("mlflow") or {}, root or save_dir, folder, resumed.get("mlflow") or {}))
        elif name == "wandb":
            loggers.append(_wandb(settings.get("wandb") or {}, folder, resumed.get("wandb") or {}))
    return loggers


def _mlflow(settings: dict, root: Path, folder: Path, resumed: dict) -> MLFlowLogger:
    # read here, not from MLFlowLogger's default: that is os.getenv at import (pytorch_lightning/loggers/mlflow.py)
    uri = settings.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    artifacts = None
    if not uri and str(resumed.get("tracking_uri") or "").startswith(FILE):
        uri = resumed["tracking_uri"]  # a run of an older default store goes on there
    elif not uri:
        # SQLite, as MLflow recommends (its file store is in maintenance mode); a database store's default artifact
        # root is ./mlruns under the working directory (mlflow/store/tracking/__init__.py), so the experiment this
        # creates keeps them beside the database
        uri = f"{SQLITE}{os.path.abspath(root / MLFLOW_DB)}"
        artifacts = (Path(root).absolute() / MLFLOW_ARTIFACTS).as_uri()
        for noisy in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." at INFO
            logging.getLogger(noisy).setLevel(logging.WARNING)
    allow_file_store(uri)
    # MLFlowLogger(run_id=...) reads that run and logs into it instead of creating one (pytorch_lightning/loggers/
    # mlflow.py, experiment: get_run, not create_run); a run id means nothing in another store
    run_id = resumed.get("run_id") if resumed.get("tracking_uri") == uri else None
    return RunMLFlowLogger(folder, experiment_name=settings.get("experiment_name") or "lightning_logs",
                           tracking_uri=uri, run_id=run_id, run_name=f"{folder.parent.name}/{folder.name}",
                           artifact_location=artifacts)


def allow_file_store(uri: str) -> None:
    """MLflow 3 refuses its file store unless told (mlflow/store/tracking/file_store.py, FileStore.__init__): a
    `file:` store here is the user's, or an older run's."""
    if uri.startswith(FILE):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def _wandb(settings: dict, folder: Path, resumed: dict) -> WandbLogger:
    offline = settings.get("offline")
    if offline is None:
        offline = os.environ.get("WANDB_MODE", "offline") not in ("online", "run")
    # an id chosen here, so run.json can hold it before W&B starts; resume="allow" continues it
    # (WandbLogger passes id and resume to wandb.init: pytorch_lightning/loggers/wandb.py, __init__)
    run_id = resumed.get("id") or uuid.uuid4().hex[:8]
    return RunWandbLogger(save_dir=str(folder), project=settings.get("project"), id=run_id, offline=offline,
                          name=f"{folder.parent.name}/{folder.name}")
