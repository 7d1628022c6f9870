"""What the CLI checks after parsing and before it builds anything (no model, no data, no run folder yet): the
settings, a tree too small for one batch, the trackers' packages, the weights an evaluation needs, the SLURM
variables, a GPU this torch cannot use, more CPU processes than CPUs, bf16 on a CPU without it, and the strategy's
own settings."""
from __future__ import annotations

import importlib

from pytorch_lightning.utilities import rank_zero_info

from lightning_app import trackers
from lightning_app.cpu_processes import check_cpu_processes
from lightning_app.data_checks import check_tree_holds_a_batch
from lightning_app.devices import cpu_precision, hide_gpus_from_a_cpu_run, refuse_unusable_gpu
from lightning_app.runs.predict_data import check_predict_data, run_of
from lightning_app.settings import check_settings, init_args, require_trained_weights
from lightning_app.strategies import ClusterDDPStrategy
from lightning_app.strategies.slurm_variables import check_slurm_variables


def check_before_building(subcommand: str | None, model, data, trainer, ckpt_path: str | None,
                          trackers_setting) -> list[str] | None:
    """Every check in the order a user meets them; returns the --trackers chosen. `trainer` is the parsed trainer
    namespace: a CPU without native bfloat16 gets its precision changed here, said in one line."""
    check_settings(model, data, trainer)
    if subcommand == "fit":  # a tree smaller than one batch: before the model and the banner
        check_tree_holds_a_batch(getattr(data, "class_path", None), init_args(data))
    # before any run folder is made: a missing tracker package is one paragraph and nothing on disk
    tracker_names = trackers.chosen(trackers_setting, (trainer or {}).get("logger"))
    if subcommand not in (None, "fit"):
        require_trained_weights(subcommand, ckpt_path, model.get("weights"))
        # a checkpoint file, before its data is generated or read (`last` and `best` find only a run whose data
        # settings are these: lightning_app/runs/resolve.py)
        check_predict_data(subcommand, init_args(data), run_of(ckpt_path), ckpt_path)
    if subcommand is not None:  # a GPU torch cannot use: never a quiet CPU run
        trainer_settings = trainer or {}
        accelerator = trainer_settings.get("accelerator", "auto")
        check_slurm_variables(trainer_settings.get("devices"), trainer_settings.get("num_nodes"),
                              accelerator=accelerator)
        refuse_unusable_gpu(accelerator)
        shared = check_cpu_processes(accelerator, trainer_settings.get("devices"))
        if shared:
            rank_zero_info(shared)
        hide_gpus_from_a_cpu_run(accelerator)
        instead = cpu_precision(trainer.get("precision"), accelerator) if trainer else None
        if instead == "bf16-mixed":
            rank_zero_info(f"--trainer.precision {trainer.get('precision')} on this CPU: float16 autocast is CUDA's; "
                           "this CPU computes bfloat16 natively (AVX512-BF16 or AMX), so this run trains in "
                           "bf16-mixed.")
        elif instead:
            rank_zero_info(f"--trainer.precision {trainer.get('precision')} on this CPU: it has no native "
                           "bfloat16 (AVX512-BF16 or AMX), where bf16 autocast runs many times slower than "
                           f"float32, so this run trains in {instead}; --trainer.precision bf16-mixed insists.")
        if instead:
            trainer["precision"] = instead
    # jsonargparse reports an error raised inside a strategy's __init__ as "Does not validate against any
    # of the Union subtypes" chained to the str subtype's error, not ours: check our settings first
    strategy = (trainer or {}).get("strategy")
    strategy_class = resolve_class(getattr(strategy, "class_path", None))
    if isinstance(strategy_class, type) and issubclass(strategy_class, ClusterDDPStrategy):
        ClusterDDPStrategy.check_settings(**dict(strategy.get("init_args") or {}))
    return tracker_names


def resolve_class(class_path: str | None) -> object | None:
    """The object a config's `class_path` names (any import path to it), or None when it names none."""
    module, _, name = (class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None
