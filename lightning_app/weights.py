"""Starting weights: where they come from, and reading a user's file without running its code.

`--model.weights SOURCE` takes
  * a checkpoint of this template (``*.ckpt``: its ``state_dict`` under ``backbone.``),
  * a plain ``state_dict`` file (e.g. ``torch.save(torchvision.models.resnet50(weights=...).state_dict(), F)``;
    our ``resnet50`` IS torchvision's ResNet-50, so its keys match as they are),
  * a torchvision weights name such as ``ResNet50_Weights.IMAGENET1K_V2``, read from torch.hub's
    cache (``torch.hub.get_dir()/checkpoints/<file>``). Nothing is downloaded.

Every file goes through `safe_load`: ``torch.load(..., weights_only=True)``, which unpickles
tensors and plain containers only. A file that needs full pickle is refused (pickle can run
any code the file holds), with the one-line conversion a user who trusts the file can run.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from lightning_app.checkpoint_files import damage, is_torch_file
from lightning_app.errors import UserError

TORCHVISION_NAME = re.compile(r"^[A-Za-z0-9_]+_Weights\.[A-Za-z0-9_]+$")
# torchvision's DenseNet files keep old keys (denselayer1.norm.1.weight for norm1.weight); its builder renames them
# (torchvision/models/densenet.py, _load_state_dict), and so does read_state_dict.
_DENSENET_OLD_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$")
# Prefixes that wrappers add to state-dict keys: ours (the LightningModule), DDP / DataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
LISTED = 8  # names shown per list in the report


class WeightsError(UserError):
    """A weights source that cannot be used as it is (the message says why and what to do)."""


class UnsafeFileError(WeightsError):
    """A file that needs full pickle (code execution) to load."""


def convert_command(path: str | os.PathLike) -> str:
    """The one-line conversion to a plain state_dict, shell-quoted (a path may hold spaces or quotes)."""
    out = f"{Path(path).with_suffix('')}.safe.pt"
    # JSON string literals are Python literals too, in double quotes: shlex.quote's single quotes stay plain
    code = (f'import torch; o = torch.load({json.dumps(str(path))}, weights_only=False, map_location="cpu"); '
            'sd = o.get("state_dict", o) if isinstance(o, dict) else o.state_dict(); '
            f"torch.save({{k: v for k, v in sd.items() if torch.is_tensor(v)}}, {json.dumps(out)})")
    return f"python -c {shlex.quote(code)}"


def _first_bytes(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(24)
    return f"it starts with {head!r}" if head else "it is empty"


def safe_load(path: str | os.PathLike, what: str = "weights file") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with an error that says which of three things went wrong.

    * not a file torch.save wrote at all (a README, a text file named .ckpt, a plain pickle): "is not a
      checkpoint", nothing about pickle;
    * a torch file that holds pickled objects (classes, functions): refused, with the conversion command;
    * a torch file torch.load cannot read (truncated, corrupt).

    An explicit ``weights_only=True`` also wins over ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    (torch/serialization.py, torch.load: the variable only overrides an unset argument).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsError(f"{what} {path} does not exist (or is not a file).")
    cut = damage(path)
    if cut is not None:
        raise WeightsError(f"{what} {path} is {cut}: a write that stopped early (a full disk, a killed copy) left it. "
                           "Pass another checkpoint (the run's best one, or an older copy).")
    if not is_torch_file(path):
        raise WeightsError(
            f"{what} {path} is not a checkpoint: torch.save did not write it ({_first_bytes(path)}). "
            "Pass a .ckpt that fit wrote (logs/version_N/checkpoints/) or a state_dict saved with torch.save."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights only load failed" in str(e).lower() or "weights_only" in str(e).lower():
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            reason = f"it holds a pickled {found.group(1)}" if found else reason
            raise UnsafeFileError(
                f"{what} {path} was refused: it needs full pickle to load, and unpickling can run any code "
                f"the file holds ({reason}). Only tensors and plain containers are read. If you trust the "
                f"file, convert it once to a plain state_dict and pass the new file instead:\n  {convert_command(path)}"
            ) from None
        raise WeightsError(f"{what} {path} is a PyTorch file that torch.load cannot read ({reason}); "
                           "is it truncated or corrupt?") from None
    except Exception as e:  # noqa: BLE001 - torch raises KeyError, RuntimeError, EOFError... for damaged files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"{what} {path} is a PyTorch file that torch.load cannot read ({reason}); "
                           "is it truncated or corrupt?") from None


def _first_tensor(state: dict) -> str:
    key = next((k for k, v in state.items() if isinstance(v, torch.Tensor)), None)
    return f"{key} {list(state[key].shape)}" if key is not None else "none"


def refuse_plain_state_dict(path: str | os.PathLike, obj: Any) -> None:
    """--ckpt_path wants a checkpoint of fit (weights, hyperparameters, training state); a bare state_dict is
    weights."""
    if (isinstance(obj, dict) and "state_dict" not in obj and obj
            and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise WeightsError(
            f"--ckpt_path {path} is a plain state_dict ({len(obj)} tensors, e.g. {_first_tensor(obj)}), not a "
            "checkpoint of fit: it holds no hyperparameters or training state. To start from these weights, "
            f"pass --model.weights {path} instead."
        )


def torchvision_cache_path(name: str) -> tuple[Path, str]:
    """(where torch.hub keeps the file of torchvision weights `name`, the URL it comes from)."""
    from torchvision.models import get_weight

    try:
        weights = get_weight(name)
    except (ValueError, KeyError, AttributeError) as e:
        raise WeightsError(f"model.weights {name!r} is not a torchvision weights name ({e}).") from None
    filename = os.path.basename(urlparse(weights.url).path)
    # torch.hub.load_state_dict_from_url keeps downloads in get_dir()/checkpoints/<file name of the URL>.
    return Path(torch.hub.get_dir()) / "checkpoints" / filename, weights.url


def weights_arch_problem(arch: str, source: str) -> str | None:
    """Why torchvision weights `source` do not fit torchvision arch `arch` (None when they do, or when either is
    not torchvision's: a file is checked layer by layer when it loads)."""
    from torchvision.models import get_model_weights, get_weight

    if not TORCHVISION_NAME.match(source) or Path(source).exists():
        return None
    try:
        weights = get_weight(source)
    except (ValueError, KeyError, AttributeError):
        return f"--model.weights {source} is not a torchvision weights name (e.g. ResNet18_Weights.IMAGENET1K_V1)"
    try:
        enum = get_model_weights(arch)
    except (ValueError, KeyError):
        return None  # conv11: no torchvision weights; loading says which layers match
    if isinstance(weights, enum):
        return None
    return (f"--model.weights {source} are weights of another architecture than --model.arch {arch}, whose "
            f"torchvision weights are {', '.join(f'{enum.__name__}.{w.name}' for w in enum)}")


def read_state_dict(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The backbone state_dict of `source` and a word saying what it was."""
    if TORCHVISION_NAME.match(source) and not Path(source).exists():
        cached, url = torchvision_cache_path(source)
        if not cached.is_file():
            raise WeightsError(
                f"model.weights {source}: not in torch.hub's cache, and nothing is downloaded here. "
                f"Download {url} (on any machine with internet) and put it at {cached} "
                f"(torch.hub.get_dir() is $TORCH_HOME/hub, by default ~/.cache/torch/hub)."
            )
        obj, kind = safe_load(cached, f"torchvision weights {source}"), "torchvision weights"
        if source.startswith("DenseNet") and isinstance(obj, dict):
            obj = {_DENSENET_OLD_KEY.sub(r"\1\2", k): v for k, v in obj.items()}
    else:
        obj, kind = safe_load(source, "model.weights file"), "state_dict"
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        # A Lightning checkpoint: keep the backbone's tensors (not metrics, EMA copies, ...).
        kind = "checkpoint"
        full = obj["state_dict"]
        obj = {k[len("backbone."):]: v for k, v in full.items() if k.startswith("backbone.")} or full
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"model.weights {source} holds no state_dict (a dict of tensors); got {type(obj).__name__}.")
    return {strip_prefixes(k): v for k, v in obj.items()}, kind


def strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key.replace("._orig_mod.", ".")


def head_names(backbone: nn.Module) -> list[str]:
    """The classifier head(s). A timm model names its own: ``pretrained_cfg['classifier']``, the layer(s) timm sizes
    with num_classes and drops from pretrained weights of another class count (timm/models/_builder.py,
    ``load_pretrained``); a tuple for distilled models (deit ``head``, ``head_dist``), a nested name where the head
    is more than a Linear (``head.fc`` after ConvNeXt's norm, Swin's pooling; levit's ``head.linear`` after a
    BatchNorm). Where the cfg names no module of the model, ``get_classifier()``: the module(s) timm's
    ``reset_classifier`` replaces. Every other model: the last nn.Linear (``head_name``)."""
    cfg = getattr(backbone, "pretrained_cfg", None)
    if isinstance(cfg, dict) and callable(getattr(backbone, "get_classifier", None)):
        named = cfg.get("classifier")
        modules = dict(backbone.named_modules())
        found = [n for n in ([named] if isinstance(named, str) else list(named or [])) if n in modules]
        if not found:
            heads = backbone.get_classifier()
            heads = heads if isinstance(heads, tuple) else (heads,)
            found = [n for n, m in modules.items() if n and any(m is h for h in heads)]
        if found and all(list(modules[n].parameters()) for n in found):
            return found
    return [_last_linear(backbone)]


def head_name(backbone: nn.Module) -> str:
    """The (first) classifier head: a timm model's own (``head_names``), else the last nn.Linear in module order,
    which is the layer torchvision's builders size with num_classes (fc for resnet/resnext/regnet and conv11,
    classifier.N for VGG, efficientnet, mobilenet, convnext, head for swin, heads.head for ViT, classifier.5 for
    maxvit). Without any Linear, the last Conv2d (squeezenet's 1x1 classifier.1)."""
    return head_names(backbone)[0]


def _last_linear(backbone: nn.Module) -> str:
    name = conv = None
    for n, m in backbone.named_modules():
        if isinstance(m, nn.Linear):
            name = n
        elif isinstance(m, nn.Conv2d):
            conv = n
    if name is None and conv is None:
        raise WeightsError(f"{type(backbone).__name__} has no nn.Linear head to replace.")
    return name if name is not None else conv


@dataclass
class LoadReport:
    source: str
    kind: str
    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    head_replaced: bool = False
    head: str = ""  # the head's module name
    head_classes: tuple[int, int] = (0, 0)  # (the source's class count, this model's) when replaced

    def __str__(self) -> str:
        head = (f"; head {self.head} replaced ({self.head_classes[0]} classes there, {self.head_classes[1]} here)"
                if self.head_replaced else "")
        return (f"model.weights {self.source} ({self.kind}): loaded {len(self.loaded)} tensors, "
                f"new {len(self.new)}{_names(self.new)}, ignored {len(self.ignored)}{_names(self.ignored)}{head}")

    def untrained(self) -> str:
        """What of the model the weights leave at its random init ('' when nothing): for evaluation only."""
        parts = [f"the head {self.head} ({self.head_classes[1]} classes; the weights have {self.head_classes[0]})"
                 ] if self.head_replaced else []
        if self.new:
            parts.append(f"{len(self.new)} tensor(s){_names(self.new)}")
        return " and ".join(parts)


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:LISTED]) + (f", ... (+{len(keys) - LISTED})" if len(keys) > LISTED else "")
    return f" ({shown})" if keys else ""


def _shape_fix(key: str, theirs: torch.Tensor, ours: torch.Tensor) -> str:
    if key == "conv1.weight" and theirs.ndim == ours.ndim == 4 and theirs.shape[-1] == 7 and ours.shape[-1] == 3:
        # models/resnet.py: below SMALL_INPUT px ResNet-50 gets a 3x3 stride-1 stem instead of the 7x7/2 one
        from models.resnet import SMALL_INPUT

        return (f"These weights need ResNet-50's standard 7x7 stem, which the model gets with --data.image_size "
                f"{SMALL_INPUT} or more (below that it builds a 3x3 stem for small images). Pass --data.image_size "
                "224 (the size ImageNet weights were trained at), or at least 64.")
    return "Check model.arch and model.arch_kwargs."


def load_weights(backbone: nn.Module, source: str) -> LoadReport:
    """Copy `source`'s tensors into `backbone` in place (memory format and device kept).

    The head is left new when its shape differs (another class count); any other shape
    mismatch is an error naming the layer. Keys only the source has are ignored, keys only
    the model has stay as initialised; both are listed in the report.
    """
    weights, kind = read_state_dict(source)
    own = backbone.state_dict()
    heads = tuple(n + "." for n in head_names(backbone))
    head = heads[0]
    report = LoadReport(source=source, kind=kind, head=", ".join(h[:-1] for h in heads))
    head_keys = [k for k in own if k.startswith(heads)]
    report.head_replaced = any(k in weights and weights[k].shape != own[k].shape for k in head_keys)
    if report.head_replaced:
        weight = head + "weight"
        report.head_classes = (int(weights[weight].shape[0]) if weight in weights else 0, int(own[weight].shape[0]))
    for key, value in weights.items():
        if key.startswith(heads) and report.head_replaced:
            continue  # reported once, as the replaced head: neither loaded, nor new, nor ignored
        if key not in own:
            report.ignored.append(key)
        elif value.shape != own[key].shape:
            raise WeightsError(f"model.weights {source}: layer {key} has shape {tuple(value.shape)} there but "
                               f"{tuple(own[key].shape)} in this model. {_shape_fix(key, value, own[key])}")
        else:
            report.loaded.append(key)
    if not report.loaded:
        raise WeightsError(
            f"model.weights {source}: none of its {len(weights)} tensors matches a layer of this model "
            f"(its first: {_first_tensor(weights)}; this model's first: {_first_tensor(own)}); is it another "
            "architecture? Check model.arch and model.arch_kwargs."
        )
    loaded = set(report.loaded)
    report.new = [k for k in own if k not in loaded and not (report.head_replaced and k.startswith(heads))]
    with torch.no_grad():
        for key in report.loaded:
            own[key].copy_(weights[key])  # state_dict() tensors share storage with the module's
    return report
