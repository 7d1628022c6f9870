"""Inside a trial's own `python main.py fit`: report the objective to the study every validation epoch, and stop the
fit when the pruner says so.

runner.py adds it to the trial's command (`--trainer.callbacks+=...ReportToStudy`), and the trial's process learns
its trial from the environment (DIR_ENV, TRIAL_ENV: the sweep folder and the trial number). A pruned fit is not
ended by raising optuna.TrialPruned: inside Lightning's loop that is an exception like any other (the CLI would
print a traceback, exit 1 and, before a checkpoint, remove the run folder). Instead the callback sets
`trainer.should_stop`, which the fit loop honours at the epoch's end (pytorch_lightning/loops/fit_loop.py, `done`;
as EarlyStopping does), records the epoch in the trial's user attrs, and the fit ends cleanly; the sweep process
then tells the study PRUNED (runner.py). This is what optuna's own trial.report / trial.should_prune do
(optuna/trial/_trial.py), minus the sampler the child never needs.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.utilities import rank_zero_info

from lightning_app.runs.launch import SWEEP_DIR_ENV as DIR_ENV
from lightning_app.runs.launch import SWEEP_TRIAL_ENV as TRIAL_ENV
from lightning_app.runs.launch import sweep_trial

SPACE_COPY = "space.yaml"


class ReportToStudy(Callback):
    """Reports the space's objective at every validation epoch's end (rank 0) and stops a pruned trial on every
    rank (rank 0's decision, broadcast)."""

    changes_training = False  # lightning_app/runs/identity.py: `last` does not compare it

    def __init__(self) -> None:
        from lightning_app.errors import UserError
        from lightning_app.sweep.space import read_space
        from lightning_app.sweep.storage import load_study_for_trial

        found = sweep_trial()
        if not found:
            raise UserError(f"{type(self).__name__} reports to a sweep's study and runs only inside a sweep's trial "
                            f"({DIR_ENV} and {TRIAL_ENV} unset): run `python -m lightning_app.sweep`, or drop it "
                            "from trainer.callbacks.")
        self.folder, self.number = Path(found["folder"]), found["trial"]
        self.pruned_at: int | None = None  # the epoch after which the pruner stopped the fit (cli.py's Done line)
        self.space = read_space(self.folder / SPACE_COPY)
        self.study = load_study_for_trial(self.folder, self.folder.name, self.space.make_pruner())
        self.storage = self.study._storage  # optuna.study.Study keeps its storage there (optuna/study/study.py)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(
            self.storage.get_study_id_from_name(self.folder.name), self.number)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            from lightning_app.sweep.storage import RUN_DIR, WORLD_SIZE

            self.storage.set_trial_user_attr(self.trial_id, RUN_DIR, os.path.realpath(trainer.default_root_dir))
            self.storage.set_trial_user_attr(self.trial_id, WORLD_SIZE, trainer.world_size)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # not called when a stop signal ends the fit (a SIGTERMException leaves the loop; a stopped fit that saved
        # exits 0 all the same, lightning_app/callbacks/stop_signals.py): only this says the trial ran to its end
        if trainer.is_global_zero:
            from lightning_app.sweep.storage import FIT_ENDED

            self.storage.set_trial_user_attr(self.trial_id, FIT_ENDED, trainer.current_epoch)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune, value, missing = False, float("nan"), None
        if trainer.is_global_zero:
            found = trainer.callback_metrics.get(self.space.objective)
            if found is None:
                missing = (f"The sweep's objective {self.space.objective} ({self.space.path}) is not among the "
                           f"metrics this fit logs ({', '.join(sorted(trainer.callback_metrics))}).")
            else:
                value = float(found)
                try:
                    if math.isfinite(value):
                        self.storage.set_trial_intermediate_value(self.trial_id, trainer.current_epoch, value)
                    trial = self.storage.get_trial(self.trial_id)
                    prune = not math.isfinite(value) or self.study.pruner.prune(self.study, trial)
                except Exception as error:  # noqa: BLE001 - the journal's folder gone or locked: said by every rank
                    missing = (f"Sweep trial {self.number} could not report to its study in {self.folder} "
                               f"({type(error).__name__}: {error}); the sweep fails the trial.")
        # rank 0's decision, and its error, reach every rank before any acts: a rank that raised alone would leave
        # the others in this collective until the process group's timeout
        prune, missing = trainer.strategy.broadcast((prune, missing), src=0)
        if missing:
            from lightning_app.errors import UserError

            raise UserError(missing)
        if prune:
            from lightning_app.sweep.storage import PRUNED_AT

            epoch = trainer.current_epoch + 1  # counted from 1, as the epoch lines are (callbacks/progress.py)
            if trainer.is_global_zero:
                self.storage.set_trial_user_attr(self.trial_id, PRUNED_AT, epoch)
            rank_zero_info(f"Sweep trial {self.number}: pruned after epoch {epoch} "
                           f"({self.space.objective} {value:.4f}); the fit stops here.")
            trainer.should_stop = True
            self.pruned_at = epoch
