"""The values a user types, checked when the command line and configs are parsed, before anything is built.

`--model.lr -1` used to reach the optimizer and end in a 44-line traceback from rank 0, and
`--model.lr 0` trained for nothing. Every bad value of the config is listed in one paragraph
(`lightning_app.errors.UserError`: exit status 2), each as the flag that sets it.
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_app import timm_weights
from lightning_app.errors import UserError
from lightning_app.weights import weights_arch_problem
from lightning_app.weights_words import bare_word_problem
from models import create_model, list_models, registry, torchvision_zoo

Rule = tuple[str, Callable[[Any], bool], str]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


def _non_negative(v: Any) -> bool:
    return _number(v) and v >= 0


def _fraction(v: Any) -> bool:  # [0, 1]
    return _number(v) and 0 <= v <= 1


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


MODEL_RULES: tuple[Rule, ...] = (
    ("lr", lambda v: v is None or _positive(v),
     "> 0 (the learning rate per 256 images: 0.1 for SGD on ImageNet), or null for the arch family's"),
    ("weight_decay", lambda v: v is None or _non_negative(v), ">= 0 (typically 5e-5 to 1e-4), or null"),
    ("optimizer", lambda v: v in (None, "sgd", "adamw"), "sgd, adamw, or null for the arch family's"),
    ("momentum", lambda v: _number(v) and 0 <= v < 1, "in [0, 1) (typically 0.9)"),
    ("warmup_epochs", _non_negative, ">= 0"),
    ("label_smoothing", lambda v: _number(v) and 0 <= v < 1, "in [0, 1) (typically 0.1)"),
    ("mixup_alpha", _non_negative, ">= 0 (0 = off; 0.2 in torchvision's recipe)"),
    ("cutmix_alpha", _non_negative, ">= 0 (0 = off; 1.0 in torchvision's recipe)"),
    ("mix_switch_prob", _fraction, "in [0, 1]"),
    ("freeze_backbone_epochs", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    ("backbone_lr_scale", _positive, "> 0 (e.g. 0.1 when fine-tuning)"),
)
DATA_RULES: tuple[Rule, ...] = (
    ("batch_size", _positive_int, "an integer >= 1 (the GLOBAL batch, split across all processes)"),
    ("image_size", _positive_int, "an integer >= 1 (pixels)"),
    ("val_image_size", lambda v: v is None or _positive_int(v), "an integer >= 1 (pixels) or null (= image_size)"),
    ("val_crop_ratio", lambda v: _number(v) and 0 < v <= 1, "in (0, 1] (0.875 = resize to size/0.875, then crop)"),
    ("min_scale", lambda v: _number(v) and 0 < v <= 1, "in (0, 1] (0.08 in ImageNet recipes)"),
    ("random_erasing", _fraction, "a probability in [0, 1]"),
    ("num_workers", lambda v: v == "auto" or (isinstance(v, int) and v >= 0), '"auto" or an integer >= 0'),
)
TRAINER_RULES: tuple[Rule, ...] = (
    ("max_epochs", lambda v: v is None or v == -1 or _positive_int(v), "an integer >= 1 (or -1: no limit)"),
)


def _as_dict(section: Any) -> Mapping:
    if section is None:
        return {}
    if hasattr(section, "as_dict"):
        section = section.as_dict()
    return section if isinstance(section, Mapping) else {}


def init_args(section: Any) -> dict:
    """A data (or other class_path) section's init args as a plain dict; a flat section as it is."""
    section = _as_dict(section)
    return dict(_as_dict(section.get("init_args")) or section)


def problems(model: Any, data: Any, trainer: Any) -> list[str]:
    """`--section.key VALUE must be ...` for every bad value; `data` may be a class_path/init_args section."""
    data = init_args(data)
    found = []
    for section, values, rules in (("model", _as_dict(model), MODEL_RULES), ("data", data, DATA_RULES),
                                   ("trainer", _as_dict(trainer), TRAINER_RULES)):
        for key, ok, must in rules:
            if key in values and not ok(values[key]):
                found.append(f"--{section}.{key} {values[key]!r} must be {must}")
    found += strategy_problems(_as_dict(trainer).get("strategy"))
    if not found:  # the sizes are sane: now whether the arch exists and takes them
        found += arch_problems(_as_dict(model), data)
    return found


def strategy_problems(strategy: Any) -> list[str]:
    """A --trainer.strategy name Lightning does not know (it would raise from inside the Trainer, with a
    traceback: pytorch_lightning/trainer/connectors/accelerator_connector.py), with the nearest name."""
    if not isinstance(strategy, str) or strategy.lower() == "auto":
        return []
    from pytorch_lightning.strategies import StrategyRegistry

    from lightning_app.parse_errors import nearest

    names = ["auto", *StrategyRegistry.available_strategies()]
    if strategy.lower() in names:
        return []
    near = nearest(strategy, names)
    return [f"--trainer.strategy {strategy!r} is no strategy name: it takes one of auto, ddp, dp, ddp_spawn, fsdp, "
            f"deepspeed (and their variants: python main.py fit --help), or a class_path"
            + (f" (did you mean {near}?)" if near else "")]


def arch_problems(model: Mapping, data: Mapping) -> list[str]:
    """Why --model.arch (with its arch_kwargs, the data's image sizes and --model.weights) cannot be built: the
    closest names for an unknown arch, the size a fixed-size model needs, unknown builder arguments, weights of
    another architecture. Checked on the meta device (shapes only): nothing is allocated."""
    arch = model.get("arch")
    if arch is None:
        return []
    if isinstance(arch, str) and arch.startswith("timm/") and importlib.util.find_spec("timm") is None:
        return [(f"--model.arch {arch} is a timm model and timm is not installed: pip install timm (or pick a "
                "torchvision name, e.g. resnet18)")]
    if not registry.is_registered(arch):
        return [registry.unknown_arch_message(arch).rstrip(".")]
    kwargs = registry.own_kwargs(arch, model.get("arch_kwargs"))
    size = data.get("image_size", model.get("image_size", 224))
    # train sizes (a ProgressiveResizing schedule's, when known: lightning_app/module.py passes them), then val
    sizes = [*dict.fromkeys([size, *(data.get("scheduled_train_sizes") or [])]), data.get("val_image_size") or size]
    if not all(isinstance(s, int) for s in sizes):
        return []
    found = []
    if arch in list_models(origin="torchvision"):
        problem = torchvision_zoo.size_problem(arch, sizes, **{k: v for k, v in kwargs.items() if k != "blurpool"})
        if problem:
            found.append(f"--model.arch {problem}")
    elif arch.startswith("timm/"):
        from models import timm_zoo  # imports timm: only for timm names

        problem = timm_zoo.size_problem(arch[len("timm/"):], sizes, **kwargs)
        if problem:
            found.append(f"--model.arch {problem}")
    if not found:
        try:
            with torch.device("meta"):
                create_model(arch, num_classes=2, image_size=sizes[0], **kwargs)
        except (TypeError, ValueError) as e:
            hint = (" (conv11's width: give arch_kwargs by arch, {conv11: {width: 16}}, as configs/default.yaml "
                    "does, and only the chosen arch's apply)" if "width" in kwargs and arch != "conv11" else "")
            found.append(f"--model.arch_kwargs {kwargs} cannot build {arch}: {str(e).rstrip('.')}{hint}")
        except NotImplementedError:  # an init that copies data (regnet): meta tensors have none; built later
            pass
        except (RuntimeError, AssertionError):  # a timm init that reads data (.item(), .tolist()): built later
            if not arch.startswith("timm/"):
                raise
    weights = model.get("weights")
    problem = (weights_arch_problem(arch, weights) or timm_weights.source_problem(arch, weights)
               or bare_word_problem(arch, weights)) if weights else None
    if problem:
        found.append(problem)
    return found


def check_settings(model: Any, data: Any, trainer: Any) -> None:
    """Raise one UserError listing every bad value, or return."""
    found = problems(model, data, trainer)
    if found:
        raise UserError("Invalid setting" + ("s" if len(found) > 1 else "") + ": " + "; ".join(found)
                        + f". Fix {'them' if len(found) > 1 else 'it'} on the command line or in the --config file "
                        f"that sets {'them' if len(found) > 1 else 'it'}.")


def require_trained_weights(subcommand: str, ckpt_path: str | None, weights: str | None) -> None:
    """validate, test and predict of an untrained model give noise that looks like results: refuse them."""
    if ckpt_path or weights:
        return
    raise UserError(
        f"{subcommand} needs a trained model: pass --ckpt_path PATH/TO.ckpt (what fit wrote, e.g. "
        "logs/version_0/checkpoints/last.ckpt; `--ckpt_path last` takes the newest run of this config) or "
        f"--model.weights SOURCE. Without either, the model is untrained and its {subcommand} results are noise; "
        "nothing was written."
    )
