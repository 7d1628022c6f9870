"""`python -m lightning_app.mlflow_runs [ROOT]`: the MLflow runs of a runs root's store, one row each, with what the
template installs (mlflow-skinny has no `mlflow ui`): the run's name (its run folder), status, epochs and the last
validation figures. ROOT defaults to logs (trainer.default_root_dir), whose store is ROOT/mlflow.db
(lightning_app/trackers/); --tracking-uri reads another (an older file:ROOT/mlruns, a server)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_app.errors import EXIT_USER_ERROR, UserError
from lightning_app.trackers import MLFLOW_DB, SQLITE, require

COLUMNS = ("val/acc1", "val/loss")


def rows(tracking_uri: str, experiment: str) -> list[list[str]]:
    """[run name, status, epochs, last val/acc1, last val/loss, run id] per run, oldest first."""
    require("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise UserError(f"{tracking_uri} holds no experiment {experiment!r}: fit with --trackers mlflow first "
                        "(docs/trackers.md), or name the experiment with --experiment.")
    out = []
    for run in client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"]):
        metrics = run.data.metrics  # each metric's latest value
        epochs = "" if metrics.get("epoch") is None else str(int(metrics["epoch"]) + 1)
        figures = ["" if metrics.get(k) is None else f"{metrics[k]:.4g}" for k in COLUMNS]
        out.append([run.info.run_name or "", run.info.status, epochs, *figures, run.info.run_id])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("root", nargs="?", default="logs", help="the runs' root (default logs)")
    ap.add_argument("--tracking-uri", default=None, help="another store (default: sqlite:///ROOT/mlflow.db)")
    ap.add_argument("--experiment", default="lightning_logs", help="the experiment (default lightning_logs)")
    args = ap.parse_args(argv)
    uri = args.tracking_uri
    try:
        if uri is None:
            db = Path(args.root) / MLFLOW_DB
            if not db.is_file():
                raise UserError(f"{db} does not exist: no fit under {args.root} logged to MLflow's default store "
                                "(--trackers mlflow, docs/trackers.md). Another store: --tracking-uri URI.")
            uri = f"{SQLITE}{db.absolute()}"
        table = rows(uri, args.experiment)
    except UserError as error:
        print(f"mlflow_runs: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"MLflow runs in {uri}, experiment {args.experiment}:")
    print("| run | status | epochs | val/acc1 | val/loss | run id |")
    print("|:--|:--|--:|--:|--:|:--|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
