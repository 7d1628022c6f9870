"""A run's identity: `version_N/run.json`, written when the run is made and updated at every resume (runs/plan.py).

It holds the run's training settings (what `--ckpt_path last` compares), where and when it started,
every SLURM job that trained it (job id, array job and task id, restart count) and every torchrun worker group
(rendezvous run id, restart count), as runs/launch.py reads them from this process's environment. `IGNORED` is the
one list of settings that do not change what a run learns: `last` ignores them, and a resumed fit
changes them without a word.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_app.runs.folders import run_dirs, run_of_checkpoint, write_atomically
from lightning_app.runs.launch import elastic_key, job_key

RUN_JSON = "run.json"

# Settings that never change the weights a run ends with (speed, logging, layout, where files go).
# The global batch is data.batch_size whatever the layout, so devices, nodes and the strategy are here;
# the strategy's gradient compression is not (COMPRESSION).
IGNORED: dict[str, tuple[str, ...]] = {
    "model": ("pictures", "compile", "channels_last", "matmul_precision"),
    "data": ("num_workers", "pin_memory", "persistent_workers", "predict_dir", "decode_threads", "pack_workers",
             "cache_dir", "max_cache_size", "max_pre_download", "storage_options", "in_memory", "num_threads",
             "prefetch_queue_depth", "hw_decoder_load", "pinned_budget_gib", "shm_budget_gib", "host_budget_gib"),
    "trainer": ("accelerator", "strategy", "devices", "num_nodes", "logger", "enable_progress_bar",
                "enable_model_summary", "enable_checkpointing", "log_every_n_steps", "default_root_dir",
                "num_sanity_val_steps", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                "val_check_interval", "check_val_every_n_epoch", "benchmark", "inference_mode", "profiler",
                "detect_anomaly", "barebones", "plugins", "max_time", "enable_autolog_hparams", "model_registry"),
    # callbacks that only watch or save: matched by class name, subclasses included. Any other callback
    # class is compared unless it says `changes_training = False` (as the callbacks in tests/helpers/callbacks.py do).
    "trainer.callbacks": ("ProgressBar", "LearningRateMonitor", "DeviceStatsMonitor", "ModelSummary", "Timer",
                          "ModelCheckpoint", "OnExceptionCheckpoint", "BasePredictionWriter", "TrainSpeedMonitor"),
}


# Where classes a run.json may name moved (the training core's rooms, 2026-11): a run made before names them by
# the old path, and `last` must not take a moved class for a changed setting.
MOVED_CLASSES = {
    "lightning_app.schedules.ProgressiveResizing": "lightning_app.callbacks.progressive_resizing.ProgressiveResizing",
    "lightning_app.ema.EMAWeightAveraging": "lightning_app.callbacks.ema.DelayedStartEMA",
    "lightning_app.callbacks.ThroughputMonitor": "lightning_app.callbacks.throughput.TrainSpeedMonitor",
    "lightning_app.faults.CheckpointOnSigterm": "lightning_app.callbacks.checkpoints.CheckpointOnSigterm",
    "lightning_app.faults.ResumableCheckpoint": "lightning_app.callbacks.checkpoints.ResumableCheckpoint",
    "lightning_app.faults.ReseedEveryEpoch": "lightning_app.callbacks.reseed.ReseedEveryEpoch",
    "lightning_app.memory_probe.MemoryProbe": "lightning_app.callbacks.memory_probe.MemoryProbe",
    "lightning_app.pictures.TensorBoardPictures": "lightning_app.callbacks.pictures.callback.TensorBoardPictures",
    "lightning_app.predict.PredictionsCSV": "lightning_app.callbacks.predictions.PredictionsCSV",
    "lightning_app.strategies.DDPStrategy": "lightning_app.strategies.ddp.ClusterDDPStrategy",
    "lightning_app.strategies.DataParallelStrategy": "lightning_app.strategies.dp.DataParallelStrategy",
}


def current_class_paths(value: Any) -> Any:
    """`value` with every class path of MOVED_CLASSES replaced by where the class lives now."""
    if isinstance(value, dict):
        return {k: current_class_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [current_class_paths(v) for v in value]
    return MOVED_CLASSES.get(value, value) if isinstance(value, str) else value


# ClusterDDPStrategy's settings that change what is learned: a compressed all-reduce changes each step's gradient
# (lightning_app/strategies/comm_hooks.py). Compared only when a hook is on, so runs without one record nothing.
COMPRESSION = {"fp16": ("comm_hook",), "bf16": ("comm_hook",),
               "powersgd": ("comm_hook", "powersgd_rank", "powersgd_start_iter")}


def _compression(strategy: Any) -> dict:
    args = strategy.get("init_args") if isinstance(strategy, dict) else None
    hook = (args or {}).get("comm_hook")
    return {k: args.get(k) for k in COMPRESSION[hook]} if hook in COMPRESSION else {}


def comparable(training: dict, subcommand: str) -> dict:
    """What `last` compares for this subcommand: validate/test/predict evaluate a network, so only the seed,
    model and data settings count for them; how long or how it was trained (the trainer's) does not."""
    return training if subcommand == "fit" else {k: v for k, v in training.items() if k != "trainer"}


def _keep(section: str, values: dict) -> dict:
    return {k: v for k, v in values.items() if k not in IGNORED[section] and not str(k).startswith("_")}


def model_settings(model_hparams: dict) -> dict:
    return _plain(_keep("model", model_hparams))


def training_settings(model_hparams: dict, data_class: str, data_hparams: dict, trainer: dict,
                      seed: Any) -> dict:
    """The settings `last` compares, as plain JSON values."""
    keep = _keep
    data = keep("data", data_hparams)
    if isinstance(data.get("data_dir"), str) and "://" not in data["data_dir"]:
        data["data_dir"] = os.path.abspath(os.path.expanduser(data["data_dir"]))
    compression = _compression(trainer.get("strategy"))
    trainer = keep("trainer", trainer)
    if compression:
        trainer["gradient_compression"] = compression
    callbacks = trainer.get("callbacks") or []
    trainer["callbacks"] = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
                            if _changes_training(c)]
    return _plain({"seed": seed, "model": keep("model", model_hparams), "data": {"class_path": data_class, **data},
                   "trainer": trainer})


def _changes_training(callback: Any) -> bool:
    class_path = callback.get("class_path") if isinstance(callback, dict) else None
    if not class_path:
        return True
    class_path = MOVED_CLASSES.get(class_path, class_path)
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return True
    if getattr(cls, "changes_training", True) is False:
        return False
    return not any(base.__name__ in IGNORED["trainer.callbacks"] for base in cls.__mro__)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested config."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every setting that differs."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def describe(diffs: list[tuple[str, Any, Any]], limit: int = 6) -> str:
    shown = [f"{k} {_short(o)} -> {_short(n)}" for k, o, n in diffs[:limit]]
    return ", ".join(shown) + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


def _short(value: Any) -> str:
    text = "unset" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def last_elastic_attempt(record: dict, key: str) -> datetime.datetime | None:
    """When torchrun job `key` last created or resumed the run; None if it never did. A job started again by
    hand with the same --rdzv-id may resume an older run: the one it trained last is its own."""
    times = [datetime.datetime.fromisoformat(a["at"]) for a in record.get("attempts", [])
             if elastic_key(a.get("torchelastic") or {}) == key and a.get("at")]
    return max(times, default=None)


# -- runs as `--ckpt_path` sees them ---------------------------------------------------------------
@dataclass
class FoundRun:
    """A run folder, its run.json, and how its training settings compare with this config's, said in words."""
    number: int | None  # N of version_N
    folder: Path | None  # None: the checkpoint lies outside any run
    record: dict | None  # its run.json; None: made before runs had one
    differs: list  # what `last` compares for this subcommand (comparable) that differs
    changed: list  # every training setting that differs: what a resume records and says it changed
    said_differs: str = ""
    said_changed: str = ""


def _found(number: int | None, folder: Path | None, record: dict | None, differs: list, changed: list) -> FoundRun:
    return FoundRun(number, folder, record, differs, changed, describe(differs), describe(changed))


def runs_under(root: str | os.PathLike, training: dict, subcommand: str) -> list[FoundRun]:
    """Every run folder under root, by N, compared with this config's training settings."""
    wanted, found = comparable(training, subcommand), []
    for number, folder in run_dirs(root):
        record = read_run(folder)
        if record is None:
            found.append(_found(number, folder, None, [], []))
            continue
        found.append(_found(number, folder, record, differences(comparable(record["training"], subcommand), wanted),
                            differences(record["training"], training)))
    return found


def run_of_file(ckpt_path: str | os.PathLike, training: dict, saved_hparams: dict) -> FoundRun:
    """The run a checkpoint file lies in, compared with this config: all its training settings when it has a
    run.json; else (no run.json, or a file outside any run) the model settings the checkpoint saved."""
    run = run_of_checkpoint(ckpt_path)
    record = read_run(run[1]) if run else None
    if record:
        changed = differences(record["training"], training)
    else:
        changed = differences({"model": model_settings(saved_hparams)}, {"model": training["model"]})
    return _found(run[0] if run else None, run[1] if run else None, record, changed, changed)


# -- run.json ------------------------------------------------------------------------------
def read_run(run_dir: str | os.PathLike) -> dict | None:
    try:
        record = json.loads((Path(run_dir) / RUN_JSON).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("training"), dict)):
        return None
    return {**record, "training": current_class_paths(record["training"])}


def record_sweep_outcome(run_dir: str | os.PathLike, state: str, **details: Any) -> None:
    """How the sweep ended this run's trial (complete, pruned with its epoch, fail), into run.json's "sweep" entry.
    Written by the sweep process once the trial's own process has ended, so no other writer races it; a run
    without a run.json (its fit failed before making one) is left alone."""
    path = Path(run_dir) / RUN_JSON
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    record["sweep"] = {**(record.get("sweep") or {}), "state": state, **details}
    write_atomically(path, json.dumps(record, indent=1).encode())


def jobs_of(record: dict) -> set[str]:
    """Every SLURM job that created or resumed the run."""
    keys = {job_key(record.get("slurm") or {})}
    keys |= {job_key(a.get("slurm") or {}) for a in record.get("attempts", [])}
    return {k for k in keys if k}
