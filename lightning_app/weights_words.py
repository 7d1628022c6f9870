"""A --model.weights value that is no file and no weights name (torchvision's `weights="DEFAULT"` idiom, a bare
`imagenet`), said at parse time with the name that means it for the arch; before, it reached the loader as a file
name after the trainer's banner ('model.weights file DEFAULT does not exist')."""
from __future__ import annotations

import re
from pathlib import Path

from lightning_app import timm_weights

BARE_WORD = re.compile(r"^[A-Za-z0-9_-]+$")  # no '.' or '/': not a path, nor a torchvision (Enum.MEMBER) name


def bare_word_problem(arch: str, source: str) -> str | None:
    """Why `source` names no weights (None when it may: a path, a torchvision or timm name, a file that is there).
    Only a bare word is judged here: a path that is missing now may not be needed (a resume loads no weights)."""
    if not BARE_WORD.match(source) or timm_weights.is_timm_name(source) or Path(source).exists():
        return None
    takes = "a weights file (a state_dict or a checkpoint, by its path)"
    if str(arch).startswith(timm_weights.PREFIX):
        meant = f"for --model.arch {arch}, timm's pretrained weights are --model.weights timm"
    else:
        meant = _torchvision_name(arch, source)
    return (f"--model.weights {source} is no file here and no weights name: it takes {takes}, a torchvision weights "
            f"name (Enum.MEMBER) or, for a timm/ arch, timm or timm/NAME.TAG" + (f"; {meant}" if meant else ""))


def _torchvision_name(arch: str, source: str) -> str | None:
    from torchvision.models import get_model_weights

    try:
        enum = get_model_weights(arch)
    except (ValueError, KeyError):
        return None  # not a torchvision arch (conv11): no names to give
    members = {name.upper(): name for name in enum.__members__}
    if source.upper() in members:  # DEFAULT, IMAGENET1K_V1: torchvision's short forms of an enum member
        member = enum[members[source.upper()]]
        return f"for --model.arch {arch} that is {enum.__name__}.{member.name}"
    return f"--model.arch {arch}'s are {', '.join(f'{enum.__name__}.{m.name}' for m in enum)}"
