"""Hyperparameters in TensorBoard's HPARAMS tab, with a metric attached; MLflow's params and W&B's config once per run.

The tab stays empty unless the hparams summary names a metric. Lightning's own call
(TensorBoardLogger.log_hyperparams with metrics) also logs a placeholder value for it; here the summary
names `val/acc1` without writing a fake point into that curve, so the tab reads the real values as
validation logs them.
"""
from __future__ import annotations

from collections.abc import Mapping

import pytorch_lightning as pl
from pytorch_lightning.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

# Keys LightningCLI adds to a model's hparams for reloading it (cli.py, _InstantiatorFn): not settings a person changes.
INTERNAL_KEYS = ("_class_path", "_instantiator")
Scalar = int | float | str | bool


def public(hparams) -> dict:
    return {k: v for k, v in dict(hparams).items() if k not in INTERNAL_KEYS and not str(k).startswith("_")}


def run_hparams(trainer: pl.Trainer) -> dict:
    params: dict = {}
    if trainer.lightning_module is not None:
        params["model"] = public(trainer.lightning_module.hparams)
    if trainer.datamodule is not None:
        params["data"] = {"class": type(trainer.datamodule).__name__, **public(trainer.datamodule.hparams)}
    params["trainer"] = {
        "precision": trainer.precision,
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "max_epochs": trainer.max_epochs,
        "accelerator": type(trainer.accelerator).__name__,
    }
    return params


def flat(params: Mapping, prefix: str = "") -> dict[str, Scalar]:
    """{"model": {"lr": 0.1}} -> {"model/lr": 0.1}; what TensorBoard cannot show (lists, None) as text."""
    out: dict[str, Scalar] = {}
    for key, value in params.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flat(value, name))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


class HparamsWithMetric(pl.Callback):
    """At the start of a fit, rank 0 writes the run's hyperparameters with `metric` attached (see the module doc)."""

    changes_training = False  # --ckpt_path last ignores it (lightning_app/runs/identity.py)

    def __init__(self, metric: str = "val/acc1") -> None:
        self.metric = metric

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.utils.tensorboard.summary import hparams

        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment._get_file_writer()  # reopened if closed
                for summary in hparams(flat(run_hparams(trainer)), {self.metric: 0.0}):
                    writer.add_summary(summary)
            elif isinstance(logger, MLFlowLogger):
                log_mlflow_params(logger, flat(run_hparams(trainer)))
            elif isinstance(logger, WandbLogger) and trainer.ckpt_path is None:  # a resumed W&B run has its config
                logger.experiment.config.update(flat(run_hparams(trainer)), allow_val_change=True)


def log_mlflow_params(logger: MLFlowLogger, params: dict[str, Scalar]) -> None:
    """Once per MLflow run: a continued run keeps the params it has (MLflow refuses to change a logged param,
    mlflow/store/tracking/file_store.py, _log_run_param), whatever a resume changed (run.json records that)."""
    from mlflow.entities import Param

    client = logger.experiment
    if client.get_run(logger.run_id).data.params:
        return
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]  # MLflow's longest param value
    for start in range(0, len(items), 100):  # MLflow's batch limit (Lightning's MLFlowLogger batches by 100 too)
        client.log_batch(run_id=logger.run_id, params=items[start:start + 100])
