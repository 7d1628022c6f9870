"""timm's pretrained weights for a ``timm/NAME`` arch, loaded by timm's own code, offline.

`--model.weights` takes, with ``--model.arch timm/NAME``:
  * ``timm``: timm's default pretrained weights of NAME (the tag ``timm.models.get_pretrained_cfg(NAME).tag``);
  * ``timm/NAME.TAG``: one pretrained tag of NAME (``timm.list_pretrained('NAME.*')``), spelled as its Hugging Face
    repository, as a torchvision weights name spells arch and tag (ResNet18_Weights.IMAGENET1K_V1);
  * a file of timm weights (``.safetensors``, ``.pth``, ``.bin``): e.g. a model.safetensors copied by hand.
A checkpoint of this template (its ``state_dict`` under ``backbone.``) still goes through lightning_app/weights.py.

The named weights are read from the Hugging Face cache, where timm keeps them (timm/models/_builder.py,
``_resolve_pretrained_source``: with huggingface_hub installed the hub is its source; _hub.py,
``load_state_dict_from_hf``, tries ``model.safetensors``, then ``pytorch_model.bin``). Nothing is downloaded: the
cached file is handed to timm as ``pretrained_cfg_overlay=dict(file=PATH)``, the documented way to load a local file,
so timm's loader does the rest: its per-model filter (a ViT's position embeddings resampled to the img_size it was
built for), the input-conv adaptation, and the head: when the class count differs from the weights', ``load_pretrained``
drops the tensors of ``pretrained_cfg['classifier']`` and loads the rest, so the head stays new (and the load
strict otherwise). The model is built that way beside ours and its loaded tensors copied in, so the backbone keeps
its memory format, BlurPool and device.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_app.weights import LoadReport, WeightsError, head_names, safe_load

SOURCE = "timm"
PREFIX = "timm/"
HF_FILES = ("model.safetensors", "pytorch_model.bin")  # the order timm's load_state_dict_from_hf tries them
_KEYS_LOGGED = re.compile(r"^(Missing|Unexpected) keys \((.*)\) (?:discovered|found) while loading")


def is_timm_name(source: str) -> bool:
    """``timm`` or ``timm/NAME.TAG`` (not a file of that name)."""
    return (source == SOURCE or source.startswith(PREFIX)) and not Path(source).exists()


def _is_our_checkpoint(path: Path) -> bool:
    obj = safe_load(path, "model.weights file")  # also refuses a file that needs full pickle, in one paragraph
    return isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict)


def applies(arch: str, source: str) -> bool:
    """Whether timm's loader reads `source` for `arch`: timm's names, and any weights file for a timm arch except a
    checkpoint of this template."""
    if is_timm_name(source):
        return True
    if not str(arch).startswith(PREFIX):
        return False
    path = Path(source).expanduser()
    return path.suffix == ".safetensors" or (path.is_file() and not _is_our_checkpoint(path))


def tagged_name(arch: str, source: str) -> str:
    """NAME.TAG of the weights `source` names for timm `arch`."""
    from timm.models import get_pretrained_cfg

    name = arch[len(PREFIX):]
    if source != SOURCE:
        return source[len(PREFIX):]
    cfg = get_pretrained_cfg(name)
    return f"{name}.{cfg.tag}" if cfg is not None and cfg.tag else name


def source_problem(arch: str, source: str) -> str | None:
    """Why timm weights `source` cannot load into `arch` (None when they can, or when `source` is not timm's)."""
    if not is_timm_name(source):
        return None
    if not str(arch).startswith(PREFIX):
        return (f"--model.weights {source} are timm's pretrained weights: they need a timm arch, --model.arch "
                f"timm/NAME (for --model.arch {arch}, pass a weights file or a torchvision weights name)")
    import timm

    name = arch[len(PREFIX):]
    tags = timm.list_pretrained(f"{name}.*")
    if source == SOURCE:
        return None if tags else (f"--model.weights timm: timm has no pretrained weights for {arch}; pick a model "
                                  "of timm.list_pretrained()")
    wanted = source[len(PREFIX):]
    if wanted in tags:
        return None
    which = f"its tags are {', '.join(PREFIX + t for t in tags)}" if tags else "timm has none for it"
    return f"--model.weights {source} are not timm's pretrained weights of --model.arch {arch}: {which}"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub/constants.py resolves it (HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub), read now: huggingface_hub reads the variables
    once, when it is imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_file(tagged: str) -> Path:
    """The cached weights file of timm's NAME.TAG, or a WeightsError saying how to put it there."""
    from huggingface_hub import try_to_load_from_cache
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(tagged)
    if cfg is None or not cfg.hf_hub_id:
        raise WeightsError(f"model.weights timm/{tagged}: timm has no Hugging Face copy of these weights"
                           f"{f' (only {cfg.url})' if cfg is not None and cfg.url else ''}; download them and pass "
                           "the file with --model.weights PATH.")
    repo, _, revision = cfg.hf_hub_id.partition("@")  # timm/models/_hub.py, hf_split
    cache = hf_cache_dir()
    for filename in ((cfg.hf_hub_filename,) if cfg.hf_hub_filename else HF_FILES):
        found = try_to_load_from_cache(repo, filename, cache_dir=cache, revision=revision or None)
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    raise WeightsError(
        f"model.weights timm/{tagged}: not in the Hugging Face cache ({cache}), and nothing is downloaded here. On "
        f"any machine with internet run `hf download {repo} {(cfg.hf_hub_filename or HF_FILES[0])}` (or "
        f"`python -c \"import timm; timm.create_model('{tagged}', pretrained=True)\"`) and copy its cache folder "
        f"models--{repo.replace('/', '--')} into {cache} (set HF_HUB_CACHE or HF_HOME to use another cache).")


@contextlib.contextmanager
def _keys_timm_reports() -> Iterator[dict[str, list[str]]]:
    """The missing and unexpected keys timm's load_pretrained logs (it returns nothing; timm/models/_builder.py
    logs them at INFO and WARNING), caught here instead of printed: the report lists them."""
    found: dict[str, list[str]] = {"Missing": [], "Unexpected": []}

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = _KEYS_LOGGED.match(record.getMessage())
            if match:
                found[match.group(1)] += [k.strip() for k in match.group(2).split(",") if k.strip()]

    logger = logging.getLogger("timm.models._builder")
    handler, level, propagate = Catch(logging.INFO), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def load(backbone: nn.Module, source: str, arch: str, image_size: int, arch_kwargs: dict[str, Any]) -> LoadReport:
    """Load timm weights `source` into `backbone` (timm `arch` built with `image_size` and `arch_kwargs`) in place."""
    from models.timm_zoo import build  # imports timm

    if is_timm_name(source):
        problem = source_problem(arch, source)
        if problem:
            raise WeightsError(problem.removeprefix("--") + ".")
        tagged = tagged_name(arch, source)
        path, kind = cached_file(tagged), f"timm pretrained weights, {PREFIX}{tagged}"
    else:
        path, tagged, kind = Path(source).expanduser(), arch[len(PREFIX):], "timm weights file"
        if not path.is_file():
            raise WeightsError(f"model.weights file {path} does not exist (or is not a file).")
    num_classes = int(getattr(backbone, "num_classes", 0)) or None
    with _keys_timm_reports() as logged:
        try:
            fresh = build(tagged, num_classes=num_classes, image_size=image_size, pretrained_file=str(path),
                          **arch_kwargs)
        except (RuntimeError, ValueError, KeyError, AssertionError, OSError) as e:
            detail = " ".join(str(e).split())  # torch's load_state_dict lists the keys on further lines
            detail = (detail[:300] + "...") if len(detail) > 300 else detail or type(e).__name__
            raise WeightsError(f"model.weights {source}: timm could not load {path} into {arch} ({detail}). "
                               "Check model.arch, model.arch_kwargs and that the file holds this model's "
                               "weights.") from None
    cfg = fresh.pretrained_cfg
    heads = tuple(n + "." for n in head_names(fresh))
    replaced = cfg.get("num_classes") is not None and num_classes != cfg["num_classes"]
    own, theirs = backbone.state_dict(), fresh.state_dict()
    missing = set(logged["Missing"])
    report = LoadReport(source=source, kind=kind, head=", ".join(h[:-1] for h in heads), head_replaced=replaced,
                        head_classes=(int(cfg["num_classes"] or 0), int(num_classes or 0)) if replaced else (0, 0),
                        ignored=list(logged["Unexpected"]))
    report.loaded = [k for k in own if k not in missing and not (replaced and k.startswith(heads))]
    report.new = [k for k in own if k in missing and not (replaced and k.startswith(heads))]
    if not report.loaded:
        raise WeightsError(f"model.weights {source}: none of its tensors matches a layer of {arch}; is it another "
                           "architecture? Check model.arch and model.arch_kwargs.")
    with torch.no_grad():
        for key in report.loaded:
            own[key].copy_(theirs[key])  # state_dict() tensors share storage with the module's
    return report
