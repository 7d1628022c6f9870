"""`python main.py {fit,validate,test,predict}`: LightningCLI with configs/default.yaml read first.

Every fit gets its own run folder, ROOT/version_N (ROOT = --trainer.default_root_dir, `logs`):
TensorBoard events, config.yaml and checkpoints/ (best and last.ckpt). `--ckpt_path last` resumes
the newest run of this configuration in its own folder. validate/test/predict log into a subfolder
of their checkpoint's run (ROOT/version_N/validate/), or ROOT/<subcommand>/ for any other checkpoint.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

from pytorch_lightning import LightningDataModule
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only
from pytorch_lightning.utilities.exceptions import SIGTERMException

from datamodules.processes import dead_workers
from lightning_app import disk_full, parse_errors, runs, trackers
from lightning_app.callbacks import finite_loss, stop_signals
from lightning_app.callbacks.checkpoints import CheckpointOnSigterm, ResumableCheckpoint
from lightning_app.callbacks.memory_probe import MemoryProbe
from lightning_app.callbacks.progress import progress_callback
from lightning_app.callbacks.reseed import ReseedEveryEpoch
from lightning_app.callbacks.saved_config import RedactedSaveConfigCallback
from lightning_app.callbacks.throughput import TrainSpeedMonitor
from lightning_app.cli_parser import ClassifierArgumentParser
from lightning_app.data_checks import check_tree_holds_a_batch
from lightning_app.devices import cpu_precision, hide_gpus_from_a_cpu_run, refuse_unusable_gpu
from lightning_app.errors import (
    EXIT_USER_ERROR,
    find_user_error,
    paragraph,
    show_traceback,
    silence_known_noise,
)
from lightning_app.module import ImageClassifier
from lightning_app.runs.flags_over_checkpoint import network_settings
from lightning_app.runs.guard import use_atomic_checkpoints
from lightning_app.runs.identity import training_settings
from lightning_app.runs.plan import discard_evaluation_folder
from lightning_app.runs.predict_data import check_predict_data, run_of
from lightning_app.settings import check_settings, init_args, require_trained_weights
from lightning_app.strategies import STRATEGY_HELP, ClusterDDPStrategy  # registers --trainer.strategy dp, ddp
from lightning_app.strategies.launched_ranks import die_with_the_launching_rank
from lightning_app.strategies.peers import describe_distributed_failure, describe_taken_port
from lightning_app.strategies.slurm_variables import check_slurm_variables
from lightning_app.weights import refuse_plain_state_dict, safe_load

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class ClassifierCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True) -> None:
        silence_known_noise()
        disk_full.quiet_writer_threads()
        info_to_stdout()
        self.plan: runs.RunPlan | None = None
        super().__init__(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            parser_kwargs=default_config_kwargs(run),
            save_config_callback=RedactedSaveConfigCallback,  # no credentials in config.yaml
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [TrainSpeedMonitor(), CheckpointOnSigterm(), ReseedEveryEpoch(),
                                            MemoryProbe(), finite_loss.StopOnNonFiniteLoss()]},
            parser_class=ClassifierArgumentParser,
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data decides these; the model never has them typed twice.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.image_size", "model.image_size", apply_on="instantiate")
        parser.link_arguments("data.batch_size", "model.global_batch_size", apply_on="instantiate")
        strategy = next(a for a in parser._actions if a.dest == "trainer.strategy")
        strategy.help = STRATEGY_HELP + (strategy.help or "")
        parser.add_lightning_class_args(ResumableCheckpoint, "checkpoint")
        parser.add_argument("--resume_or_fail", type=bool, default=False,
                            help="With --ckpt_path last (or hpc): when no run of this config is found, stop with exit "
                                 "status 2 instead of starting a fresh run (for a scheduler's restart).")
        trackers.add_arguments(parser)
        parser.set_defaults({
            "checkpoint.monitor": "val/acc1",
            "checkpoint.mode": "max",
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": 1,
            "checkpoint.filename": "best-epoch{epoch:03d}-acc{val/acc1:.4f}",
            "checkpoint.auto_insert_metric_name": False,
            # Always last.ckpt, never last-v1.ckpt: Lightning versions the name when a last.ckpt it did not
            # write itself is there (callbacks/model_checkpoint.py, _save_last_checkpoint), e.g. one saved on
            # SIGTERM before its first save, or in a run whose folder moved; `--ckpt_path last` reads last.ckpt.
            "checkpoint.enable_version_counter": False,
        })

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # Lightning's own --ckpt_path load (lightning_fabric/utilities/cloud_io.py, _load) passes weights_only
        # through; None would let TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turn full pickle back on.
        parser.set_defaults(weights_only=True)
        if subcommand == "predict":
            # Lightning keeps every batch's output for its return value unless told not to
            # (trainer/trainer.py, predict: return_predictions None -> True); PredictionsCSV streams them instead.
            parser.set_defaults(return_predictions=False)
        return parser

    def _set_seed(self) -> None:
        self.seed_given = self._get(self.config, "seed_everything")  # before LightningCLI draws one for `true`
        super()._set_seed()

    def _parse_ckpt_path(self) -> None:
        # Not LightningCLI's: it merges the checkpoint's hyperparameters over the command line (see
        # lightning_app/runs/flags_over_checkpoint.py); here only what builds the network comes from the checkpoint.
        # safe_load reads it with weights_only=True, so a file needing pickle gets a message saying what to do.
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return
        checkpoint = safe_load(ckpt_path, "--ckpt_path")
        refuse_plain_state_dict(ckpt_path, checkpoint)
        saved = checkpoint.get("hyper_parameters") or {}
        model = self.config[sub].model
        defaults = self._parser(sub).get_defaults().model
        for key, value in network_settings(saved, dict(model.items()), dict(defaults.items()), ckpt_path).items():
            model[key] = value

    def before_instantiate_classes(self) -> None:
        model = self._get(self.config, "model")
        check_settings(model, self._get(self.config, "data"), self._get(self.config, "trainer"))
        if self.subcommand == "fit":  # a tree smaller than one batch: before the model and the banner
            data = self._get(self.config, "data")
            check_tree_holds_a_batch(getattr(data, "class_path", None), init_args(data))
        # before any run folder is made: a missing tracker package is one paragraph and nothing on disk
        self.tracker_names = trackers.chosen(self._get(self.config, "trackers", default=None),
                                             (self._get(self.config, "trainer") or {}).get("logger"))
        if self.subcommand not in (None, "fit"):
            require_trained_weights(self.subcommand, self._get(self.config, "ckpt_path"), model.get("weights"))
            # a checkpoint file, before its data is generated or read (`last` and `best` find only a run whose data
            # settings are these: lightning_app/runs/resolve.py)
            ckpt_path = self._get(self.config, "ckpt_path")
            check_predict_data(self.subcommand, init_args(self._get(self.config, "data")), run_of(ckpt_path),
                               ckpt_path)
        if self.subcommand is not None:  # a GPU torch cannot use: never a quiet CPU run
            trainer_settings = self._get(self.config, "trainer") or {}
            check_slurm_variables(trainer_settings.get("devices"), trainer_settings.get("num_nodes"))
            accelerator = (self._get(self.config, "trainer") or {}).get("accelerator", "auto")
            refuse_unusable_gpu(accelerator)
            hide_gpus_from_a_cpu_run(accelerator)
            trainer_config = self._get(self.config, "trainer")
            instead = cpu_precision(trainer_config.get("precision"), accelerator) if trainer_config else None
            if instead:
                rank_zero_info(f"--trainer.precision {trainer_config.get('precision')} on this CPU: it has no native "
                               "bfloat16 (AVX512-BF16 or AMX), where bf16 autocast runs many times slower than "
                               f"float32, so this run trains in {instead}; --trainer.precision bf16-mixed insists.")
                trainer_config["precision"] = instead
        # jsonargparse reports an error raised inside a strategy's __init__ as "Does not validate against any
        # of the Union subtypes" chained to the str subtype's error, not ours: check our settings first
        strategy = (self._get(self.config, "trainer") or {}).get("strategy")
        strategy_class = resolve_class(getattr(strategy, "class_path", None))
        if isinstance(strategy_class, type) and issubclass(strategy_class, ClusterDDPStrategy):
            ClusterDDPStrategy.check_settings(**dict(strategy.get("init_args") or {}))

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config, "trainer")
        # for the recipe line: which config file, or the command line, set the optimiser's values
        self.model.setting_sources = parse_errors.model_sources(getattr(self.parser, "args", None), DEFAULT_CONFIG)
        self._warn_about_workers()
        root = Path(config.get("default_root_dir") or "logs")
        plan = self.plan = self._plan_run(root)
        if plan is not None:
            runs.announce(plan)
            if self.subcommand == "fit" and plan.run_dir is not None:
                # what Lightning writes by itself (SLURM's hpc_ckpt_K.ckpt on requeue) goes into the run too
                kwargs["default_root_dir"] = str(plan.run_dir)
            if plan.guard is not None:
                self.trainer_defaults["callbacks"].append(plan.guard)
        if config.get("logger") in (None, True):
            kwargs["logger"] = self._trackers(self.tracker_names, plan, root)
        if config.get("enable_progress_bar", True) is not False:
            self.trainer_defaults["callbacks"].append(progress_callback())
        checkpoint = self._get(self.config_init, "checkpoint", default=None)
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None and plan and plan.run_dir is not None:
            checkpoint.dirpath = os.path.realpath(plan.run_dir / runs.CHECKPOINTS)
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except BaseException:
            self._discard_failed_run()
            raise
        use_atomic_checkpoints(trainer)
        return trainer

    def _trackers(self, names: list[str] | None, plan: runs.RunPlan | None, root: Path) -> list:
        """TensorBoard as always, or the --trackers named (lightning_app/trackers/); a resumed fit continues the
        MLflow and W&B runs its run.json names, and a fresh one records them there."""
        settings = {name: dict(self._get(self.config, name, default=None) or {}) for name in trackers.PACKAGES}
        fit = self.subcommand == "fit" and plan is not None and plan.run_dir is not None
        resuming = fit and bool(plan.ckpt_path) and not plan.made_here
        resumed = trackers.recorded(plan.run_dir) if resuming else None
        folder = (plan.run_dir if fit else plan.log_parent / str(plan.version)) if plan and plan.version is not None \
            else None
        runs_root = plan.run_dir.parent if plan and plan.run_dir else plan.log_parent if plan else root
        loggers = trackers.build(names, settings, plan.log_parent if plan else root, plan.version if plan else None,
                                 plan.purge_step if plan else None, folder, resumed, runs_root)
        if fit and plan.lock is not None and names:  # the launch-rank-zero process, which wrote run.json
            trackers.remember(plan.run_dir, loggers)
        if resuming and plan.lock is not None:
            line = trackers.on_resume(resumed or {}, loggers)
            if line:
                rank_zero_info(line)
        return loggers

    # -- run folders -------------------------------------------------------------------------
    def _plan_run(self, root: Path) -> runs.RunPlan | None:
        """The run folder and the checkpoint to load (lightning_app/runs/plan.py); None with run=False."""
        if self.subcommand is None:  # run=False: parse and instantiate only; nothing is written
            return None
        training = training_settings(
            dict(self.model.hparams), f"{type(self.datamodule).__module__}.{type(self.datamodule).__name__}",
            dict(getattr(self.datamodule, "hparams", {}) or {}), self._get(self.config, "trainer").as_dict(),
            getattr(self, "seed_given", None))
        plan = runs.plan_run(self.subcommand, self._get(self.config, "ckpt_path"), root, training,
                             runs.ModelSignature.of_module(self.model),
                             resume_or_fail=bool(self._get(self.config, "resume_or_fail", default=False)))
        if plan.lock is not None:
            atexit.register(plan.lock.release)
        return plan

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if "ckpt_path" in kwargs and self.plan is not None:
            kwargs["ckpt_path"] = self.plan.ckpt_path
        return kwargs

    def _warn_about_workers(self) -> None:
        from datamodules.budget.cpus import usable_cpus

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
        except Exception as error:  # not on Ctrl-C or SIGTERM: an interrupted run keeps what it logged
            full = disk_full.explain(error, getattr(self, "trainer", None), self.plan and self.plan.run_dir)
            if not isinstance(error, finite_loss.NonFiniteTraining):  # nor a diverged one: its curves show why
                self._discard_failed_run()
            if full is not None:  # one paragraph, exit status 2 (lightning_app/disk_full.py)
                raise full from None
            raise
        finally:
            if self.plan is not None and self.plan.lock is not None:
                self.plan.lock.release()

    def _discard_failed_run(self) -> None:
        """A fresh run that failed (a bad setting, say) before its first checkpoint leaves no folder behind, and
        so does a validate/test/predict that failed before its first result (a bad --data.predict_dir, say)."""
        plan = self.plan
        if plan is None:
            return
        if plan.lock is not None:
            plan.lock.release()
        trainer = getattr(self, "trainer", None)
        discard_evaluation_folder(plan, logged_metrics=bool(trainer is not None and trainer.logged_metrics))
        if plan.made_here and plan.run_dir is not None:
            ckpts = plan.run_dir / runs.CHECKPOINTS
            if not (ckpts.is_dir() and any(ckpts.iterdir())):
                shutil.rmtree(plan.run_dir, ignore_errors=True)

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.global_rank != 0:
            return
        best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
        monitor = next((c for c in trainer.callbacks if isinstance(c, TrainSpeedMonitor)), None)
        img_s = monitor.summary.get("train_img_s") if monitor else None
        # a sweep's ReportToStudy (lightning_app/sweep/pruning.py) that stopped this trial says after which epoch
        pruned = next((c.pruned_at for c in trainer.callbacks if getattr(c, "pruned_at", None) is not None), None)
        epochs = trainer.current_epoch
        parts = [
            f"best val/acc1 {float(best):.4f}" if best is not None else "best val/acc1 n/a",
            f"{epochs} epoch{'' if epochs == 1 else 's'}" + (f" (pruned by the sweep after epoch {pruned})"
                                                            if pruned is not None else ""),
            f"{img_s:,.0f} images/s ({trainer.world_size} process{'es' if trainer.world_size > 1 else ''})"
            if img_s else "images/s n/a",
        ]
        from datamodules.sample.decode_report import decode_line

        decoding = decode_line(getattr(trainer.datamodule, "device_decoders", None) or {})
        if decoding:
            parts.append(decoding)
        if trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path:
            parts.append(f"best checkpoint {trainer.checkpoint_callback.best_model_path}")
        if self._get(self.config, "trackers", default=None):  # the default line stays as it was: TensorBoard's
            parts += trackers.describe(trainer.loggers)
        rank_zero_info("Done: " + "; ".join(parts))


def resolve_class(class_path: str | None) -> object | None:
    """The object a config's `class_path` names (any import path to it), or None when it names none."""
    module, _, name = (class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


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
    die_with_the_launching_rank()
    try:
        return ClassifierCLI(args=args)
    except SIGTERMException:  # a stop signal, saved by CheckpointOnSigterm
        if finite_loss.last_stop:  # ... unless the weights were not finite
            _say_diverged(finite_loss.last_stop)
        raise SystemExit(stop_signals.exit_status()) from None
    except finite_loss.NonFiniteTraining as diverged:
        _say_diverged(str(diverged))
    except Exception as error:
        if dead_workers.unsaved_paragraph(error):  # a loader worker died where no stop could save
            print(dead_workers.unsaved_paragraph(error), file=sys.stderr, flush=True)
            raise SystemExit(dead_workers.EXIT_WORKER_DIED) from None
        user_error = find_user_error(error)
        if user_error is not None:
            if show_traceback():
                traceback.print_exc()
            # once, from rank 0 (the other ranks exit quietly), or from each rank an error says it concerns
            if rank_zero_only.rank == 0 or getattr(user_error, "every_rank", False):
                print(paragraph(user_error), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        taken = describe_taken_port(error)  # a setting (MASTER_PORT), not a lost peer
        if taken is not None:
            print(taken, file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        message = describe_distributed_failure(error, ClusterDDPStrategy.last_timeout_s, ClusterDDPStrategy.last_rank)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(1) from error


def _say_diverged(text: str) -> None:
    """A diverged fit (lightning_app/callbacks/finite_loss.py): its paragraph once, from rank 0; every rank exits
    with EXIT_NON_FINITE."""
    if rank_zero_only.rank == 0:
        print(text, file=sys.stderr, flush=True)
    raise SystemExit(finite_loss.EXIT_NON_FINITE) from None
