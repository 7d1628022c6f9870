"""What a checkpoint holds, read without running code from it and without reading its weights.

Checkpoints are only ever read with `torch.load(..., weights_only=True)`: reading a folder of
checkpoints must never run code from one of them. `mmap=True` maps the file instead of reading it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_app.checkpoint_files import damage
from lightning_app.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass
class ModelSignature:
    arch: str | None
    num_classes: int | None
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ModelSignature:
        hp = getattr(module, "hparams", {})
        if not hp.get("num_classes"):  # predicting a folder without the training tree: the checkpoint's count
            return cls(hp.get("arch"), None, {})
        return cls(hp.get("arch"), hp.get("num_classes"),
                   {k: tuple(v.shape) for k, v in module.state_dict().items()})

    @classmethod
    def of_checkpoint(cls, path: str | os.PathLike) -> ModelSignature:
        """Read with weights_only=True (no code from the file runs) and mmap (no weights read)."""
        return cls._of_dict(load_light(path))

    @classmethod
    def _of_dict(cls, ckpt: dict) -> ModelSignature:
        hp = ckpt.get("hyper_parameters") or {}
        state = ckpt.get("state_dict") or {}
        return cls(hp.get("arch"), hp.get("num_classes"),
                   {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")})

    def describe(self) -> str:
        return f"arch {self.arch or 'unknown'} with {self.num_classes if self.num_classes is not None else '?'} classes"


def mismatch(saved: ModelSignature, config: ModelSignature) -> str | None:
    """Why a checkpoint with `saved` cannot load into the model of `config`, or None when it can."""
    classes_differ = config.num_classes is not None and saved.num_classes != config.num_classes
    if saved.arch != config.arch or classes_differ:
        return f"it holds {saved.describe()}, this config builds {config.describe()}"
    for key, shape in config.shapes.items():
        if key in saved.shapes and saved.shapes[key] != shape:
            return (f"same arch and classes, but layer {key} is {list(saved.shapes[key])} there and "
                    f"{list(shape)} here (a different --model.arch_kwargs or --data.image_size)")
    missing = [k for k in config.shapes if k not in saved.shapes]
    if saved.shapes and missing:
        return f"same arch and classes, but it lacks {len(missing)} of this model's weights, e.g. {missing[0]}"
    return None


def check_compatible(ckpt_path: str | os.PathLike, config: ModelSignature) -> None:
    """Raise a one-paragraph UserError when ckpt_path cannot load into this config's model."""
    _refuse_mismatch(ckpt_path, ModelSignature.of_checkpoint(ckpt_path), config)


def _refuse_mismatch(ckpt_path: str | os.PathLike, saved: ModelSignature, config: ModelSignature) -> None:
    why = mismatch(saved, config)
    if why is not None:
        raise UserError(
            f"--ckpt_path {ckpt_path} does not fit this config: {why}. Pass the config the checkpoint was "
            "trained with (its run folder holds config.yaml), or --ckpt_path last to resume the newest run "
            "of this config."
        )


@dataclass
class Inspected:
    """What resolving `--ckpt_path` needs of the checkpoint it loads, read once (inspect_checkpoint)."""
    hyper_parameters: dict
    fingerprint: str  # every rank must load the same file (runs/guard.py)


def inspect_checkpoint(ckpt_path: str | os.PathLike, config: ModelSignature) -> Inspected:
    """The checkpoint read once: Unreadable when it cannot be read, a UserError when it does not fit `config`."""
    ckpt = load_light(ckpt_path)
    _refuse_mismatch(ckpt_path, ModelSignature._of_dict(ckpt), config)
    return Inspected(ckpt.get("hyper_parameters") or {}, fingerprint(ckpt_path))


class Unreadable(UserError):
    """The checkpoint cannot be read: cut short, not a checkpoint, or unreadable."""


def load_light(path: str | os.PathLike) -> dict:
    """The checkpoint's dict, weights memory-mapped (not read); Unreadable when it cannot be read."""
    import torch  # here, not at the top: `import lightning_app.runs` loads no torch (tests/test_runs.py)

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise Unreadable(f"cannot read checkpoint {path}: {damage(path) or f'{type(e).__name__}: {first}'}") from e


def fingerprint(path: str | os.PathLike) -> str:
    """Size and a hash of the file's last 64 KiB: a torch checkpoint ends with its zip directory, which
    holds the CRC of every record, so two different checkpoints under the same path differ here."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 65536))
        return f"{size}:{hashlib.sha1(f.read()).hexdigest()[:16]}"
