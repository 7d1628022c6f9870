"""`python main.py {fit,validate,test,predict}`: LightningCLI with configs/default.yaml read first."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pytorch_lightning import LightningDataModule
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.callbacks import LogFriendlyProgressBar, ThroughputMonitor
from lightning_app.faults import (
    CheckpointOnSigterm,
    ReseedEveryEpoch,
    ResumableCheckpoint,
    describe_distributed_failure,
)
from lightning_app.module import ImageClassifier
from lightning_app.strategies import DDPStrategy  # importing registers --trainer.strategy dp and our ddp
from lightning_app.weights import WeightsError, safe_load

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class ClassifierCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            parser_kwargs=default_config_kwargs(run),
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [ThroughputMonitor(), CheckpointOnSigterm(), ReseedEveryEpoch()]},
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data decides these; the model never has them typed twice.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.image_size", "model.image_size", apply_on="instantiate")
        parser.link_arguments("data.batch_size", "model.global_batch_size", apply_on="instantiate")
        parser.add_lightning_class_args(ResumableCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/acc1",
            "checkpoint.mode": "max",
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": 1,
            "checkpoint.filename": "best-epoch{epoch:03d}-acc{val/acc1:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # Lightning's own --ckpt_path load (lightning_fabric/utilities/cloud_io.py, _load) passes weights_only
        # through; None would let TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turn full pickle back on.
        parser.set_defaults(weights_only=True)
        return parser

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads --ckpt_path's hyperparameters here (torch.load with weights_only=True);
        # safe_load reads it the same way first, so a file needing pickle gets a message saying what to do.
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if ckpt_path and Path(ckpt_path).is_file():
            safe_load(ckpt_path, "--ckpt_path")
        super()._parse_ckpt_path()

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config, "trainer")
        root = config.get("default_root_dir") or "logs"
        # One knob, --trainer.default_root_dir, places everything: TensorBoard runs in
        # ROOT/version_N, checkpoints in ROOT/checkpoints (one fixed folder, so that
        # --ckpt_path last finds the newest last.ckpt of any earlier run).
        if config.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=root, name="", default_hp_metric=False)
        if config.get("enable_progress_bar", True) is not False:
            self.trainer_defaults["callbacks"].append(LogFriendlyProgressBar())
        checkpoint = self._get(self.config_init, "checkpoint", default=None)
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None:
            checkpoint.dirpath = os.path.realpath(os.path.join(root, "checkpoints"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.global_rank != 0:
            return
        best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
        monitor = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
        img_s = monitor.summary.get("train_img_s") if monitor else None
        parts = [
            f"best val/acc1 {float(best):.4f}" if best is not None else "best val/acc1 n/a",
            f"{trainer.current_epoch} epochs",
            f"{img_s:,.0f} images/s ({trainer.world_size} process{'es' if trainer.world_size > 1 else ''})"
            if img_s else "images/s n/a",
        ]
        if trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path:
            parts.append(f"best checkpoint {trainer.checkpoint_callback.best_model_path}")
        rank_zero_info("Done: " + "; ".join(parts))


def default_config_kwargs(run: bool) -> dict:
    """configs/default.yaml for every subcommand (or for the bare parser when run=False)."""
    defaults = {"default_config_files": [str(DEFAULT_CONFIG)]}
    return {sub: defaults for sub in SUBCOMMANDS} if run else defaults


def main(args=None) -> ClassifierCLI:
    try:
        return ClassifierCLI(args=args)
    except WeightsError as error:  # --model.weights / --ckpt_path: one paragraph, exit 2
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception as error:
        message = describe_distributed_failure(error, DDPStrategy.last_timeout_s, DDPStrategy.last_rank)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(1) from error
