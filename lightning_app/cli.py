"""`python main.py {fit,validate,test,predict}`: LightningCLI with configs/default.yaml read first.

Every fit gets its own run folder, ROOT/version_N (ROOT = --trainer.default_root_dir, `logs`):
TensorBoard events, config.yaml and checkpoints/ (best and last.ckpt). `--ckpt_path last` resumes
the newest run of this configuration in its own folder. validate/test/predict log into a subfolder
of their checkpoint's run (ROOT/version_N/validate/), or ROOT/<subcommand>/ for any other checkpoint.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

from pytorch_lightning import LightningDataModule
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only

from lightning_app import runs
from lightning_app.callbacks import ThroughputMonitor, progress_callback
from lightning_app.cli_parser import ClassifierArgumentParser
from lightning_app.errors import (
    EXIT_USER_ERROR,
    UserError,
    find_user_error,
    paragraph,
    show_traceback,
    silence_known_noise,
)
from lightning_app.faults import (
    CheckpointOnSigterm,
    ReseedEveryEpoch,
    ResumableCheckpoint,
    describe_distributed_failure,
)
from lightning_app.memory_probe import MemoryProbe
from lightning_app.module import ImageClassifier
from lightning_app.saved_config import RedactedSaveConfigCallback
from lightning_app.settings import check_settings, require_trained_weights
from lightning_app.strategies import DDPStrategy  # importing registers --trainer.strategy dp and our ddp
from lightning_app.weights import refuse_plain_state_dict, safe_load

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class ClassifierCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True) -> None:
        silence_known_noise()
        info_to_stdout()
        self.run_dir: Path | None = None
        self.resolved_ckpt_path: str | None = None
        self.run_lock: runs.RunLock | None = None
        self.fresh_run = False
        super().__init__(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            parser_kwargs=default_config_kwargs(run),
            save_config_callback=RedactedSaveConfigCallback,  # no credentials in config.yaml
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [ThroughputMonitor(), CheckpointOnSigterm(), ReseedEveryEpoch(),
                                            MemoryProbe()]},
            parser_class=ClassifierArgumentParser,
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
            refuse_plain_state_dict(ckpt_path, safe_load(ckpt_path, "--ckpt_path"))
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        from models import list_models

        model = self._get(self.config, "model")
        arch = model.get("arch")
        if arch not in list_models():
            raise UserError(f"--model.arch {arch!r} is not a known architecture; choose one of "
                            f"{', '.join(list_models())} (or a configs/model/*.yaml).")
        check_settings(model, self._get(self.config, "data"), self._get(self.config, "trainer"))
        if self.subcommand not in (None, "fit"):
            require_trained_weights(self.subcommand, self._get(self.config, "ckpt_path"), model.get("weights"))

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config, "trainer")
        root = Path(config.get("default_root_dir") or "logs")
        self._warn_about_workers()
        version, log_parent = self._plan_run(root)
        if self.subcommand == "fit" and self.run_dir is not None:
            # what Lightning writes by itself (SLURM's hpc_ckpt_K.ckpt on requeue) goes into the run too
            kwargs["default_root_dir"] = str(self.run_dir)
        if config.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=str(log_parent), name="", version=version,
                                                 default_hp_metric=False)
        if config.get("enable_progress_bar", True) is not False:
            self.trainer_defaults["callbacks"].append(progress_callback())
        checkpoint = self._get(self.config_init, "checkpoint", default=None)
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None and self.run_dir is not None:
            checkpoint.dirpath = os.path.realpath(self.run_dir / runs.CHECKPOINTS)
        try:
            return super().instantiate_trainer(**kwargs)
        except BaseException:
            self._discard_failed_run()
            raise

    # -- run folders -------------------------------------------------------------------------
    def _plan_run(self, root: Path) -> tuple[int | str | None, Path]:
        """Decide the run folder and the checkpoint to load: (logger version, logger save_dir)."""
        sub = self.subcommand
        if sub is None:  # run=False: parse and instantiate only; nothing is written
            return None, root
        ckpt = self._get(self.config, "ckpt_path")
        signature = runs.ModelSignature.of_module(self.model)
        run = None
        if ckpt == "last":
            found, looked_at = runs.find_last(root, signature)
            if found is None:
                where = f"{looked_at} run(s) under {root}" if looked_at else f"no run under {root}"
                if sub != "fit":
                    raise UserError(f"--ckpt_path last: {where}, none with {signature.describe()} (this config); "
                                    "pass --ckpt_path PATH/TO.ckpt.")
                rank_zero_info(f"--ckpt_path last: {where}, none with {signature.describe()}; starting a fresh run.")
            else:
                ckpt = str(found)
                run = runs.run_of_checkpoint(found)
                rank_zero_info(f"--ckpt_path last: resuming {found}")
        elif ckpt is not None and ckpt not in ("best", "hpc", "registry"):
            if not Path(ckpt).is_file():
                raise UserError(f"--ckpt_path {ckpt}: no such file.")
            runs.check_compatible(ckpt, signature)
            run = runs.run_of_checkpoint(ckpt)
        self.resolved_ckpt_path = None if ckpt == "last" else ckpt

        if sub != "fit":
            # never a new version_N: a subfolder of the checkpoint's run, or ROOT/<subcommand>
            self.run_dir = run[1] if run else None
            return sub, (run[1] if run else root)
        if run is not None:
            version, self.run_dir = run
        elif runs.is_launch_rank_zero():
            version, self.run_dir = runs.new_run(root)
            self.fresh_run = True
        else:
            return None, root  # a fresh run on rank > 0: rank 0's folder is broadcast by Lightning
        if runs.is_launch_rank_zero():
            self.run_lock = runs.RunLock(self.run_dir).acquire()
            atexit.register(self.run_lock.release)
            if self.run_lock.took_over:
                rank_zero_info(f"took over the lock of {self.run_dir} from process "
                               f"{self.run_lock.took_over.get('pid')}, which is no longer running.")
        return version, root

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if "ckpt_path" in kwargs:
            kwargs["ckpt_path"] = self.resolved_ckpt_path
        return kwargs

    def _warn_about_workers(self) -> None:
        from datamodules.cpus import usable_cpus

        workers = getattr(self.datamodule, "num_workers", None)
        cpus = usable_cpus()
        if isinstance(workers, int) and cpus and workers > cpus:
            # one info line instead of torch's warning at every DataLoader (silenced in lightning_app.errors)
            rank_zero_info(f"--data.num_workers {workers} per process is more than the {cpus} usable CPUs here; "
                           f"{cpus} or fewer is usually faster.")

    # -- after the subcommand ------------------------------------------------------------------
    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except Exception:  # not on Ctrl-C or SIGTERM: an interrupted run keeps what it logged
            self._discard_failed_run()
            raise
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _discard_failed_run(self) -> None:
        """A fresh run that failed (a bad setting, say) before its first checkpoint leaves no folder behind."""
        if self.run_lock is not None:
            self.run_lock.release()
        if self.fresh_run and self.run_dir is not None and runs.is_launch_rank_zero():
            ckpts = self.run_dir / runs.CHECKPOINTS
            if not (ckpts.is_dir() and any(ckpts.iterdir())):
                shutil.rmtree(self.run_dir, ignore_errors=True)

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


def info_to_stdout() -> None:
    """Lightning's info lines ("GPU available", "Seed set to") go to stdout with the epoch lines, so
    stderr holds warnings and errors only. Lightning gives its package loggers one StreamHandler on
    stderr (pytorch_lightning/__init__.py, lightning_fabric/__init__.py)."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and handler.stream is sys.__stderr__:
                handler.setStream(sys.stdout)


def default_config_kwargs(run: bool) -> dict:
    """configs/default.yaml for every subcommand (or for the bare parser when run=False)."""
    defaults = {"default_config_files": [str(DEFAULT_CONFIG)]}
    return {sub: defaults for sub in SUBCOMMANDS} if run else defaults


def main(args=None) -> ClassifierCLI:
    try:
        return ClassifierCLI(args=args)
    except Exception as error:
        user_error = find_user_error(error)
        if user_error is not None:
            if show_traceback():
                traceback.print_exc()
            if rank_zero_only.rank == 0:  # once, from rank 0; the other ranks exit quietly
                print(paragraph(user_error), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        message = describe_distributed_failure(error, DDPStrategy.last_timeout_s, DDPStrategy.last_rank)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(1) from error
