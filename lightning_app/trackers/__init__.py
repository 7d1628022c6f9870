"""The experiment trackers a fit logs to: `--trackers [tensorboard, csv, mlflow, wandb]`, in its run folder.

Unset (the default), a run logs to TensorBoard exactly as it always has. configs/logger/NAME.yaml each add one
tracker (`trackers+: [NAME]`, jsonargparse's list append), so stacked configs name several; naming any replaces
the default (list tensorboard too to keep it). Every tracker keeps the run folder's contract:
- TensorBoard and CSV write into ROOT/version_N itself (CSV's metrics.csv survives a resume: RunCSVLogger);
- MLflow writes to `sqlite:///ROOT/mlflow.db` (its artifacts to ROOT/mlartifacts) unless --mlflow.tracking_uri or
  MLFLOW_TRACKING_URI names another store; a run resumed from an older `file:ROOT/mlruns` store stays there;
- W&B writes under ROOT/version_N/wandb, offline unless --wandb.offline false (or WANDB_MODE=online).
The MLflow run id and the W&B run id go into run.json ("trackers"): a resumed fit continues those runs.
config.yaml and predictions.csv follow trainer.log_dir, which is the run folder whatever the first tracker is.
"""
from lightning_app.trackers.choose import NAMES, PACKAGES, add_arguments, chosen, require
from lightning_app.trackers.ids import describe, ids_of, on_resume, recorded, remember
from lightning_app.trackers.loggers import RunCSVLogger, RunMLFlowLogger, RunWandbLogger
from lightning_app.trackers.make import FILE, MLFLOW_ARTIFACTS, MLFLOW_DB, SQLITE, build

__all__ = ["FILE", "MLFLOW_ARTIFACTS", "MLFLOW_DB", "NAMES", "PACKAGES", "SQLITE", "RunCSVLogger", "RunMLFlowLogger",
           "RunWandbLogger", "add_arguments", "build", "chosen", "describe", "ids_of", "on_resume", "recorded",
           "remember", "require"]
