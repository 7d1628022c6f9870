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
from pathlib import Path

from pytorch_lightning import LightningDataModule
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_app import disk_full, parse_errors, runs, trackers
from lightning_app.callbacks import finite_loss
from lightning_app.callbacks.checkpoints import ResumableCheckpoint
from lightning_app.callbacks.progress import progress_callback
from lightning_app.callbacks.required import refuse_dropped_safety
from lightning_app.callbacks.saved_config import RedactedSaveConfigCallback
from lightning_app.cli_parser import ClassifierArgumentParser
from lightning_app.ending import done_line, exit_for
from lightning_app.errors import silence_known_noise
from lightning_app.module import ImageClassifier
from lightning_app.preflight import check_before_building
from lightning_app.runs.flags_over_checkpoint import network_settings
from lightning_app.runs.guard import RunGuard, use_atomic_checkpoints
from lightning_app.runs.identity import training_settings
from lightning_app.runs.plan import discard_evaluation_folder
from lightning_app.strategies import STRATEGY_HELP  # registers --trainer.strategy dp, ddp
from lightning_app.strategies.launched_ranks import die_with_the_launching_rank
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
        parser.add_lightning_class_args(ResumableCheckpoint, "checkpoint")  # its settings: configs/default.yaml
        parser.add_argument("--resume_or_fail", type=bool, default=False,
                            help="With --ckpt_path last (or hpc): when no run of this config is found, stop with exit "
                                 "status 2 instead of starting a fresh run (for a scheduler's restart).")
        trackers.add_arguments(parser)

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
        refuse_dropped_safety(self._get(self.config, "trainer").get("callbacks"))  # configs/callbacks/default.yaml
        # every check that needs no model, data or run folder (lightning_app/preflight.py)
        self.tracker_names = check_before_building(
            self.subcommand, self._get(self.config, "model"), self._get(self.config, "data"),
            self._get(self.config, "trainer"), self._get(self.config, "ckpt_path"),
            self._get(self.config, "trackers", default=None))

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config, "trainer")
        # for the recipe line: which config file, or the command line, set the optimiser's values
        self.model.setting_sources = parse_errors.model_sources(getattr(self.parser, "args", None), DEFAULT_CONFIG)
        self._warn_about_workers()
        root = Path(config.get("default_root_dir") or "logs")
        plan = self.plan = self._plan_run(root)
        # The callbacks a setting asks for (configs/callbacks/default.yaml lists them); LightningCLI adds
        # trainer_defaults["callbacks"] after the config's (pytorch_lightning/cli.py, _instantiate_trainer).
        added = self.trainer_defaults["callbacks"] = []
        if plan is not None:
            for line in plan.lines:
                rank_zero_info(line)
            if self.subcommand == "fit" and plan.run_dir is not None:
                # what Lightning writes by itself (SLURM's hpc_ckpt_K.ckpt on requeue) goes into the run too
                kwargs["default_root_dir"] = str(plan.run_dir)
            if plan.agreement is not None:  # every rank on the same run (runs/guard.py)
                added.append(RunGuard(**plan.agreement))
        if config.get("logger") in (None, True):
            kwargs["logger"] = self._trackers(self.tracker_names, plan, root)
        if config.get("enable_progress_bar", True) is not False:  # Lightning refuses a bar with it false
            added.append(progress_callback())
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
        if self.trainer.global_rank == 0:
            rank_zero_info(done_line(self.trainer, bool(self._get(self.config, "trackers", default=None))))


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
    except (SIGTERMException, Exception) as error:  # not Ctrl-C
        exit_for(error)  # a stop signal, a diverged fit, a user error, a lost peer: its paragraph and exit status
        raise
