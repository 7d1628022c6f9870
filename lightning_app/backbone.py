"""The backbone ImageClassifier wraps: built from the registry for the class count and train size, compiled with
static shapes, and what fine-tuning freezes (everything but the head)."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn

from lightning_app import weights as weights_lib
from models import create_model, own_kwargs

MIN_PATCH_GRID = 4  # patches a side below which a ViT is said to see too few tokens (a 224-px ViT sees 14x14)


def build_backbone(hparams, num_classes: int) -> torch.nn.Module:
    """`hparams.arch` from the `models` registry, its head for `num_classes`, channels-last if asked; a ViT cut
    into too few patches at this image size is warned about, naming the settings that fix it."""
    h = hparams
    backbone = create_model(h.arch, num_classes=num_classes, image_size=h.image_size,
                            **own_kwargs(h.arch, h.arch_kwargs))
    grid = getattr(getattr(backbone, "patch_embed", None), "grid_size", None)  # timm's ViTs and kin
    if grid and min(grid) < MIN_PATCH_GRID:
        patch = h.image_size // grid[0]
        rank_zero_warn(f"--model.arch {h.arch} at --data.image_size {h.image_size} cuts each image into "
                       f"{grid[0]}x{grid[1]} patches of {patch} px: {grid[0] * grid[1]} tokens, too few for its "
                       "attention to learn from. Pass --model.arch_kwargs '{patch_size: 4}' (for this arch: "
                       f"{{{h.arch}: {{patch_size: 4}}}}) or a larger --data.image_size.")
    if h.channels_last:
        backbone = backbone.to(memory_format=torch.channels_last)
    return backbone


def compile_static(backbone: torch.nn.Module, trainer: pl.Trainer | None) -> None:
    """torch.compile the backbone in place (checkpoint keys do not gain "_orig_mod.") with static shapes: one graph
    per input shape (each train size, the val size and its last partial batch, in train and eval mode), the
    recompile limit raised to hold them, every recompile logged by rank 0 (docs/design.md, "compile")."""
    import torch._dynamo

    sizes = getattr(getattr(trainer, "datamodule", None), "scheduled_train_sizes", None) or [None]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * (len(sizes) + 2) + 4)
    if trainer is None or trainer.global_rank == 0:
        torch._logging.set_logs(recompiles=True)
    backbone.compile(dynamic=False)


def body_modules(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    """What fine-tuning freezes, for any arch: every module holding parameters (or a leaf) except the head that
    weights_lib.head_names finds (the last nn.Linear; a timm model's own classifier, two for distilled ones) and
    their children. Modules holding parameters of their own besides children count too (ViT's class_token and
    pos_embedding, swin's position-bias tables)."""
    heads = weights_lib.head_names(backbone)
    return [m for n, m in backbone.named_modules() if (m._parameters or not list(m.children()))
            and n not in heads and not n.startswith(tuple(h + "." for h in heads))]


def head_classes(backbone: torch.nn.Module) -> int:
    """The class count the backbone's head is built for."""
    head = dict(backbone.named_modules())[weights_lib.head_name(backbone)]
    # squeezenet's head (and some of timm's) is a Conv2d; timm's NormLinear and kin have out_features too
    return head.out_features if hasattr(head, "out_features") else head.out_channels
