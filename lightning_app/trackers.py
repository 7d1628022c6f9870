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
from __future__ import annotations

import csv
import difflib
import io
import json
import logging
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from pytorch_lightning.utilities import rank_zero_only

from lightning_app.errors import UserError
from lightning_app.runs.folders import write_atomically
from lightning_app.runs.identity import RUN_JSON, read_run

NAMES = ("tensorboard", "csv", "mlflow", "wandb")
# the modules a tracker imports, and the pip line that installs them (mlflow-skinny leaves out SQLAlchemy and Alembic,
# which its SQLite store needs: mlflow/store/db/utils.py)
PACKAGES = {"mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
            "wandb": (("wandb",), "wandb")}
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
FILE, SQLITE = "file:", "sqlite:///"


def add_arguments(parser) -> None:
    """--trackers and each tracker's own settings (parsed by every subcommand, saved in config.yaml)."""
    # a name or a list, checked by `chosen` (a Literal list gets jsonargparse's "does not validate" without names)
    parser.add_argument("--trackers", type=list[str] | str | None, default=None,
                        help=f"Experiment trackers, one name or a list of {', '.join(NAMES)} (docs/trackers.md); "
                             "unset: TensorBoard. configs/logger/*.yaml add one each.")
    parser.add_argument("--mlflow.tracking_uri", type=str | None, default=None,
                        help="MLflow store; unset: MLFLOW_TRACKING_URI, else sqlite:///ROOT/mlflow.db")
    parser.add_argument("--mlflow.experiment_name", type=str, default="lightning_logs")
    parser.add_argument("--wandb.project", type=str | None, default=None,
                        help="W&B project; unset: WANDB_PROJECT, else lightning_logs")
    parser.add_argument("--wandb.offline", type=bool | None, default=None,
                        help="unset: offline unless WANDB_MODE is online")


def chosen(names: list[str] | str | None, logger_setting: Any) -> list[str] | None:
    """The trackers named (one name or a list; in order, once each), or None for the default; an unknown name or a
    missing package is one paragraph."""
    if isinstance(names, str):
        names = [names]
    if not names:
        return None
    for name in names:
        if name not in NAMES:
            near = difflib.get_close_matches(str(name), NAMES, n=1, cutoff=0.5)
            raise UserError(f"--trackers: no tracker is called {name!r}"
                            + (f" (did you mean {near[0]}?)" if near else "")
                            + f". The trackers: {', '.join(NAMES)}. Name one (--trackers mlflow) or a list "
                            "(--trackers '[tensorboard, mlflow]'); --trackers+=csv adds one to those the configs "
                            "named (docs/trackers.md).")
    if logger_setting not in (None, True):
        raise UserError(f"--trackers {list(names)} and --trainer.logger {logger_setting!r} both choose the loggers: "
                        "keep one (remove trainer.logger from your config, or the configs/logger/*.yaml files).")
    names = list(dict.fromkeys(names))
    for name in names:
        if name in PACKAGES:
            require(name)
    return names


def require(name: str) -> None:
    modules, pip_name = PACKAGES[name]
    try:
        for module in modules:
            __import__(module)
    except ImportError as error:
        raise UserError(f"--trackers names {name}, but its package is not installed here ({error}). Install it with "
                        f"`pip install {pip_name}` (requirements-extras.txt has every optional part), or leave "
                        f"{name} out of --trackers (configs/logger/{name}.yaml adds it).") from None


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
    _allow_file_store(uri)
    # MLFlowLogger(run_id=...) reads that run and logs into it instead of creating one (pytorch_lightning/loggers/
    # mlflow.py, experiment: get_run, not create_run); a run id means nothing in another store
    run_id = resumed.get("run_id") if resumed.get("tracking_uri") == uri else None
    return RunMLFlowLogger(folder, experiment_name=settings.get("experiment_name") or "lightning_logs",
                           tracking_uri=uri, run_id=run_id, run_name=f"{folder.parent.name}/{folder.name}",
                           artifact_location=artifacts)


def _allow_file_store(uri: str) -> None:
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

        _allow_file_store(uri)
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


class RunCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv survives a resume. Lightning's writer deletes the file it finds, with a warning
    that the folder is not empty (lightning_fabric/loggers/csv_logs.py, _ExperimentWriter._check_log_dir_exists):
    the rows already there are read first and written again (unless the run starts again from scratch: `keep`
    False); `drop_from_step` (called by the run guard at a resumed fit's first batch) drops what a stopped attempt
    logged after its checkpoint, as TensorBoard's purge does."""

    def __init__(self, *args, keep: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep = keep

    @property
    def experiment(self):
        if self._experiment is None and rank_zero_only.rank == 0:
            rows = _read_rows(os.path.join(self.log_dir, "metrics.csv")) if self.keep else []
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
                writer = super().experiment
            if rows:
                writer.metrics = rows + writer.metrics
                writer.metrics_keys = list(dict.fromkeys([k for row in rows for k in row] + writer.metrics_keys))
            return writer
        return super().experiment

    def drop_from_step(self, step: int) -> None:
        writer = self.experiment
        writer.save()  # every row on disk, then the file without the rows logged at `step` or later
        rows = _read_rows(writer.metrics_file_path)
        kept = [row for row in rows if _step(row) < step]
        if len(kept) < len(rows):
            def write(f) -> None:
                text = io.StringIO()
                out = csv.DictWriter(text, fieldnames=writer.metrics_keys)
                out.writeheader()
                out.writerows(kept)
                f.write(text.getvalue().encode())
            write_atomically(writer.metrics_file_path, write)


def _read_rows(path: str) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def _step(row: dict) -> float:
    try:
        return float(row.get("step", -1))
    except (TypeError, ValueError):
        return -1


class RunMLFlowLogger(MLFlowLogger):
    """MLFlowLogger whose `save_dir` is the run folder: Trainer.log_dir is a non-folder logger's save_dir
    (pytorch_lightning/trainer/trainer.py, log_dir), and config.yaml and predictions.csv go there. A continued run
    is marked running again (Lightning's finalize marked it finished). Hyperparameters come from
    lightning_app/callbacks/hparams.py once per run, not from Lightning's call at every fit start: MLflow refuses a
    changed value for a param already logged, and a resume may change lr."""

    def __init__(self, folder: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.folder = str(folder)
        self.continued = kwargs.get("run_id") is not None

    @property
    def save_dir(self) -> str:
        return self.folder

    @property
    def experiment(self):
        client = super().experiment
        if self.continued and rank_zero_only.rank == 0:
            self.continued = False
            client.update_run(self.run_id, status="RUNNING")
        return client

    def log_hyperparams(self, params) -> None:
        pass


class RunWandbLogger(WandbLogger):
    """WandbLogger that ends its W&B run when the fit ends (Lightning's finalize leaves it open,
    pytorch_lightning/loggers/wandb.py, finalize: a second fit in the process would reuse it). Hyperparameters
    come from lightning_app/callbacks/hparams.py once per run."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self._wandb_init.get("anonymous") is None:  # wandb warns that the setting is going away, even unset
            self._wandb_init.pop("anonymous", None)

    def log_hyperparams(self, params) -> None:
        pass

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None
