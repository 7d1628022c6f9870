"""Lightning's loggers, kept to the run folder's contract across a resume: CSV rows survive it (those of the steps a
resume redoes dropped); MLflow and W&B write where the run folder says."""
from __future__ import annotations

import csv
import io
import os
import warnings
from pathlib import Path

from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, WandbLogger
from pytorch_lightning.utilities import rank_zero_only

from lightning_app.runs.folders import write_atomically


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

    def drop_from_step(self, step: int) -> str:
        """Drop the rows logged at `step` or later; the words for the resume's line ("metrics.csv (3 rows)")."""
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
        dropped = len(rows) - len(kept)
        return f"metrics.csv ({dropped} row{'' if dropped == 1 else 's'})"


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
