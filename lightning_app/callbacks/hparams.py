"""Hyperparameters in TensorBoard's HPARAMS tab, with a metric attached.

The tab stays empty unless the hparams summary names a metric. Lightning's own call logs a
placeholder value for it; here the summary names `val/acc1` without writing a fake point
into that curve, so the tab reads the real values as validation logs them.
"""
from __future__ import annotations

import pytorch_lightning as pl
from lightning_fabric.utilities.logger import _convert_params, _flatten_dict, _sanitize_params
from pytorch_lightning.loggers import TensorBoardLogger

# Keys LightningCLI adds to a model's hparams for reloading it (cli.py, _InstantiatorFn): not settings a person changes.
INTERNAL_KEYS = ("_class_path", "_instantiator")


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


def log_hparams_with_metric(trainer: pl.Trainer, metric: str) -> None:
    from torch.utils.tensorboard.summary import hparams

    if trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            params = _sanitize_params(_flatten_dict(_convert_params(run_hparams(trainer))))
            params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
            writer = logger.experiment._get_file_writer()
            for summary in hparams(params, {metric: 0.0}):
                writer.add_summary(summary)
