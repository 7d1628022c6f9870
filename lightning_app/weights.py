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

import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from lightning_app.errors import UserError

TORCHVISION_NAME = re.compile(r"^[A-Za-z0-9_]+_Weights\.[A-Za-z0-9_]+$")
# Prefixes that wrappers add to state-dict keys: ours (the LightningModule), DDP / DataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
LISTED = 8  # names shown per list in the report


class WeightsError(UserError):
    """A weights source that cannot be used as it is (the message says why and what to do)."""


class UnsafeFileError(WeightsError):
    """A file that needs full pickle (code execution) to load."""


def convert_command(path: str | os.PathLike) -> str:
    out = f"{Path(path).with_suffix('')}.safe.pt"
    return (
        "python -c \"import torch; o = torch.load('" + str(path) + "', weights_only=False, map_location='cpu'); "
        "sd = o.get('state_dict', o) if isinstance(o, dict) else o.state_dict(); "
        "torch.save({k: v for k, v in sd.items() if torch.is_tensor(v)}, '" + out + "')\""
    )


def safe_load(path: str | os.PathLike, what: str = "weights file") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with clear errors.

    An explicit ``weights_only=True`` also wins over ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    (torch/serialization.py, torch.load: the variable only overrides an unset argument).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsError(f"{what} {path} does not exist (or is not a file).")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights only load failed" in str(e).lower() or "weights_only" in str(e).lower():
            raise UnsafeFileError(
                f"{what} {path} was refused: it needs full pickle to load, and unpickling can run any code "
                f"the file holds ({reason}). Only tensors and plain containers are read. If you trust the "
                f"file, convert it once to a plain state_dict and pass the new file instead:\n  {convert_command(path)}"
            ) from None
        raise WeightsError(f"{what} {path} is not a PyTorch file torch.load can read ({reason}).") from None
    except Exception as e:  # noqa: BLE001 - torch raises KeyError, RuntimeError, EOFError... for non-torch bytes
        raise WeightsError(f"{what} {path} is not a PyTorch file torch.load can read ({e}).") from None


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


def head_name(backbone: nn.Module) -> str:
    """The classifier head: the last nn.Linear (fc for conv11 and resnet50, classifier.1 for VGG)."""
    name = None
    for n, m in backbone.named_modules():
        if isinstance(m, nn.Linear):
            name = n
    if name is None:
        raise WeightsError(f"{type(backbone).__name__} has no nn.Linear head to replace.")
    return name


@dataclass
class LoadReport:
    source: str
    kind: str
    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    head_replaced: bool = False

    def __str__(self) -> str:
        def names(keys: list[str]) -> str:
            shown = ", ".join(keys[:LISTED]) + (f", ... (+{len(keys) - LISTED})" if len(keys) > LISTED else "")
            return f" ({shown})" if keys else ""

        head = "; head replaced (class count differs)" if self.head_replaced else ""
        return (f"model.weights {self.source} ({self.kind}): loaded {len(self.loaded)} tensors, "
                f"new {len(self.new)}{names(self.new)}, ignored {len(self.ignored)}{names(self.ignored)}{head}")


def load_weights(backbone: nn.Module, source: str) -> LoadReport:
    """Copy `source`'s tensors into `backbone` in place (memory format and device kept).

    The head is left new when its shape differs (another class count); any other shape
    mismatch is an error naming the layer. Keys only the source has are ignored, keys only
    the model has stay as initialised; both are listed in the report.
    """
    weights, kind = read_state_dict(source)
    own = backbone.state_dict()
    head = head_name(backbone) + "."
    report = LoadReport(source=source, kind=kind)
    head_keys = [k for k in own if k.startswith(head)]
    report.head_replaced = any(k in weights and weights[k].shape != own[k].shape for k in head_keys)
    for key, value in weights.items():
        if key not in own or (key.startswith(head) and report.head_replaced):
            report.ignored.append(key)
        elif value.shape != own[key].shape:
            hint = " (ImageNet weights need data.image_size >= 64 for resnet50's 7x7 stem)" if "conv1" in key else ""
            raise WeightsError(
                f"model.weights {source}: layer {key} has shape {tuple(value.shape)} there but "
                f"{tuple(own[key].shape)} in this model{hint}. Check model.arch and model.arch_kwargs."
            )
        else:
            report.loaded.append(key)
    if not report.loaded:
        raise WeightsError(
            f"model.weights {source}: none of its {len(weights)} tensors matches a layer of this model "
            f"(e.g. {next(iter(weights), 'none')}); is it another architecture?"
        )
    report.new = [k for k in own if k not in set(report.loaded)]
    with torch.no_grad():
        for key in report.loaded:
            own[key].copy_(weights[key])  # state_dict() tensors share storage with the module's
    return report


class BackboneFreeze:
    """Factory for the callback that trains only the head for the first N epochs."""

    @staticmethod
    def make(epochs: int):
        from pytorch_lightning.callbacks import BaseFinetuning

        class FreezeBackboneEpochs(BaseFinetuning):
            """Backbone (everything but the head) frozen for `epochs` epochs, BatchNorm statistics included.

            Lightning's BackboneFinetuning would add the backbone as a new optimizer param group
            when it unfreezes; our LambdaLR (warm-up + cosine) schedules only the groups it was
            built with, so the frozen parameters stay in the optimizer from the start (with no
            gradient, SGD skips them) and are only made trainable here.
            """

            def __init__(self) -> None:
                super().__init__()
                self.epochs = epochs

            def freeze_before_training(self, pl_module) -> None:
                self.freeze(pl_module.backbone_body_modules(), train_bn=False)

            def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
                if epoch >= self.epochs:  # >=: a run resumed after epoch N unfreezes too (idempotent)
                    self.make_trainable(pl_module.backbone_body_modules())

            def on_fit_start(self, trainer, pl_module) -> None:
                # BaseFinetuning.on_fit_start swaps in param groups it stored when it added some;
                # this callback adds none, so the restored optimizer state stays as it is.
                self._restarting = False

        return FreezeBackboneEpochs()
