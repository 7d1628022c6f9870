"""`--trackers`: which trackers a run names, checked (a known name, its package installed) before anything runs."""
from __future__ import annotations

import difflib
from typing import Any

from lightning_app.errors import UserError

NAMES = ("tensorboard", "csv", "mlflow", "wandb")
# the modules a tracker imports, and the pip line that installs them (mlflow-skinny leaves out SQLAlchemy and Alembic,
# which its SQLite store needs: mlflow/store/db/utils.py)
PACKAGES = {"mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
            "wandb": (("wandb",), "wandb")}
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
