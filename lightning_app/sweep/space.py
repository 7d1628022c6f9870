"""The space file: which CLI settings a sweep varies, over which distributions, and what it optimises.

    objective: val/acc1          # a metric every validation epoch logs
    direction: maximize          # or minimize
    pruner: median               # median (default), percentile, hyperband, successive_halving, threshold, none;
                                 # or {kind: threshold, lower: 0.3}: the other keys go to optuna's pruner class
    sampler: tpe                 # tpe (default) or random; or {kind: tpe, seed: 0, n_startup_trials: 4}
    model.lr: loguniform 0.01 1  # any dotted key is a CLI setting (--model.lr): KIND ARGS
    data.batch_size: choice [64, 128, 256]

Kinds: `uniform LOW HIGH`, `loguniform LOW HIGH`, `int LOW HIGH`, `logint LOW HIGH`, `choice [A, B, ...]`.
The fingerprint covers everything that decides what a trial means; a study folder keeps it (storage.py).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_app.cli_parser import closest
from lightning_app.errors import UserError
from lightning_app.runs.identity import flatten

KINDS = ("uniform", "loguniform", "int", "logint", "choice")
PRUNERS = {"median": "MedianPruner", "percentile": "PercentilePruner", "hyperband": "HyperbandPruner",
           "successive_halving": "SuccessiveHalvingPruner", "threshold": "ThresholdPruner", "none": "NopPruner"}
SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler"}
SETTINGS = ("objective", "direction", "pruner", "sampler")


@dataclass(frozen=True)
class Distribution:
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple = ()

    def to_optuna(self):
        import optuna.distributions as d

        if self.kind == "choice":
            return d.CategoricalDistribution(list(self.choices))
        if self.kind in ("int", "logint"):
            return d.IntDistribution(int(self.low), int(self.high), log=self.kind == "logint")
        return d.FloatDistribution(float(self.low), float(self.high), log=self.kind == "loguniform")


@dataclass
class Space:
    path: Path
    parameters: dict[str, Distribution]
    objective: str = "val/acc1"
    direction: str = "maximize"
    pruner: dict = field(default_factory=lambda: {"kind": "median"})
    sampler: dict = field(default_factory=lambda: {"kind": "tpe"})

    @property
    def fingerprint(self) -> str:
        """What makes two space files the same sweep: parameters, objective, direction (not comments, not order)."""
        doc = {"parameters": {k: [v.kind, v.low, v.high, list(v.choices)] for k, v in sorted(self.parameters.items())},
               "objective": self.objective, "direction": self.direction}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def make_pruner(self):
        import optuna

        kind, kwargs = self.pruner["kind"], {k: v for k, v in self.pruner.items() if k != "kind"}
        try:
            return getattr(optuna.pruners, PRUNERS[kind])(**kwargs)
        except (TypeError, ValueError) as error:
            raise UserError(f"{self.path}: pruner {kind} does not take {kwargs}: {error}. See optuna.pruners."
                            f"{PRUNERS[kind]} for its arguments.") from None

    def sampler_seed(self, session: str) -> int | None:
        """The seed one sweep process draws with: a seed in the space is the study's, and each process derives its
        own from it and `session` (its identity, which the journal records: storage.py), so two processes, or a
        process and its --resume, never draw the same trials. None: the space sets no seed (optuna seeds each
        process at random)."""
        seed = self.sampler.get("seed")
        return None if seed is None else process_seed(seed, session)

    def make_sampler(self, seed: int | None = None):
        """Optuna's sampler; `seed` (sampler_seed's) replaces the space's."""
        import optuna

        kind, kwargs = self.sampler["kind"], {k: v for k, v in self.sampler.items() if k != "kind"}
        if seed is not None:
            kwargs["seed"] = seed
        try:
            return getattr(optuna.samplers, SAMPLERS[kind])(**kwargs)
        except (TypeError, ValueError) as error:
            raise UserError(f"{self.path}: sampler {kind} does not take {kwargs}: {error}. See optuna.samplers."
                            f"{SAMPLERS[kind]} for its arguments.") from None


def process_seed(study_seed: int, session: str) -> int:
    """A sampler seed for one process: the study's seed and the process's identity, hashed (31 bits)."""
    return int.from_bytes(hashlib.sha256(f"{study_seed}/{session}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def read_space(path: str | Path) -> Space:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as error:
        raise UserError(f"--space {path}: cannot read it ({error.strerror or error}). Give a YAML file such as "
                        "configs/sweeps/lr_wd.yaml.") from None
    except yaml.YAMLError as error:
        raise UserError(f"--space {path} is not valid YAML: {str(error).splitlines()[0]}.") from None
    if not isinstance(doc, dict):
        raise UserError(f"--space {path} must be a mapping of settings (model.lr: loguniform 0.01 1, ...) and "
                        "objective/direction; it holds none.")
    space = Space(path, {})
    for key, value in doc.items():
        key = str(key)
        if "." in key:
            space.parameters[key] = parse_distribution(key, value, path)
        elif key == "objective":
            space.objective = str(value)
        elif key == "direction":
            if value not in ("maximize", "minimize"):
                raise UserError(f"{path}: direction is {value!r}; it must be maximize or minimize.")
            space.direction = value
        elif key in ("pruner", "sampler"):
            setattr(space, key, _kind_and_args(key, value, PRUNERS if key == "pruner" else SAMPLERS, path))
        else:
            raise UserError(f"{path}: {key!r} is neither a CLI setting (a dotted key such as model.lr) nor one of "
                            f"{', '.join(SETTINGS)}.")
    if not space.parameters:
        raise UserError(f"{path} names no setting to vary: add one such as `model.lr: loguniform 0.01 1`.")
    return space


def check_objective(space: Space, logged: tuple[str, ...]) -> None:
    """The objective is a metric every validation epoch logs, checked before any trial runs."""
    if space.objective not in logged:
        close = closest(space.objective, list(logged))
        raise UserError(f"{space.path}: objective {space.objective} is not a metric the model logs at every "
                        f"validation epoch ({', '.join(logged)})" + (f"; did you mean {close}?" if close else "."))


def _kind_and_args(key: str, value: Any, known: dict, path: Path) -> dict:
    spec = {"kind": value} if isinstance(value, str) else dict(value) if isinstance(value, dict) else {}
    if spec.get("kind") not in known:
        raise UserError(f"{path}: {key} {value!r} is not one of {', '.join(known)} (or a mapping with kind: and "
                        "that class's arguments).")
    return spec


def parse_distribution(key: str, value: Any, path: Path) -> Distribution:
    """`KIND ARGS` from the space file, checked: a known kind, low < high, no log of a non-positive number."""
    text = str(value).strip()
    kind, _, rest = text.partition(" ")
    where = f"{path}: {key}: {text!r}"
    if kind not in KINDS:
        raise UserError(f"{where} names no known distribution; use one of {', '.join(KINDS)}, e.g. "
                        f"`{key}: loguniform 1e-5 1e-3` or `{key}: choice [64, 128]`.")
    if kind == "choice":
        try:
            choices = yaml.safe_load(rest)
        except yaml.YAMLError:
            choices = None
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}: choice needs a non-empty list, e.g. `{key}: choice [64, 128, 256]`.")
        return Distribution(kind, choices=tuple(choices))
    words = rest.split()
    try:
        low, high = (int(w) if kind in ("int", "logint") else float(w) for w in words) if len(words) == 2 else (0, 0)
    except ValueError:
        words = []
    if len(words) != 2 or any(isinstance(v, float) and not math.isfinite(v) for v in (low, high)):
        raise UserError(f"{where}: {kind} needs two {'integers' if 'int' in kind else 'numbers'}, LOW HIGH, e.g. "
                        f"`{key}: {kind} {'1 8' if 'int' in kind else '0.01 1'}`.")
    if low >= high:
        raise UserError(f"{where}: LOW {low} is not below HIGH {high}.")
    if kind.startswith("log") and low <= 0:
        raise UserError(f"{where}: a log scale needs LOW > 0 (the log of {low} is undefined); use uniform, or a "
                        "positive LOW.")
    return Distribution(kind, low, high)


# -- against the CLI ----------------------------------------------------------------------------------------
def place_of(key: str, config: dict) -> tuple[str, ...] | None:
    """Where a dotted CLI key sits in the CLI's full config (`main.py fit --print_config`): `data.batch_size` is
    data.init_args.batch_size for a DataModule given by class_path (how LightningCLI's subclass mode nests it)."""
    known = flatten(config)
    section, _, rest = key.partition(".")
    for candidate in (key, f"{section}.init_args.{rest}"):
        if candidate in known or any(k.startswith(candidate + ".") for k in known):
            return tuple(candidate.split("."))
    return None


def locate(space: Space, config: dict) -> dict[str, tuple[str, ...]]:
    """place_of() each parameter; one the parser does not know is a user error naming the closest setting."""
    places = {}
    for key in space.parameters:
        place = place_of(key, config)
        if place is None:
            names = sorted({k.replace(".init_args.", ".") for k in flatten(config)})
            near = closest(key, names)
            raise UserError(f"{space.path}: {key} is not a setting of `python main.py fit` with this config"
                            f"{f' (did you mean {near}?)' if near else ''}; every setting: python main.py fit "
                            "--print_config.")
        places[key] = place
    return places


def as_config(values: dict[str, Any], places: dict[str, tuple[str, ...]]) -> dict:
    """values (dotted CLI keys) as a config file's nested mapping, at the places `locate` found."""
    doc: dict = {}
    for key, value in values.items():
        node = doc
        *parents, last = places.get(key, tuple(key.split(".")))
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return doc
