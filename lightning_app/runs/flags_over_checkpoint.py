"""Flags win over a checkpoint, except what builds the network.

LightningCLI would merge a checkpoint's saved hyperparameters over the command line (docs/design.md, "Flags
over a checkpoint"). Here only NETWORK_KEYS come from the checkpoint (the class count comes from the data and is
checked against the checkpoint's weights in runs.signature). A configured value that differs from both the
defaults and the checkpoint's contradicts it: that is an error naming both.
"""
from __future__ import annotations

import json
from typing import Any

from lightning_app.errors import UserError

NETWORK_KEYS = ("arch", "arch_kwargs")


def _norm(key: str, value: Any) -> str:
    if key == "arch_kwargs" and not value:
        value = {}
    return json.dumps(value, sort_keys=True, default=str)


def network_settings(saved: dict, configured: dict, defaults: dict, ckpt_path: str) -> dict:
    """{key: the checkpoint's value} for each network key the config left at its default."""
    updates = {}
    for key in NETWORK_KEYS:
        if key not in saved:
            continue
        theirs, ours = _norm(key, saved[key]), _norm(key, configured.get(key))
        if theirs == ours:
            continue
        if ours == _norm(key, defaults.get(key)):
            updates[key] = saved[key]
            continue
        raise UserError(
            f"--model.{key} {ours} contradicts --ckpt_path {ckpt_path}, whose network was built with "
            f"{key} {theirs}: a checkpoint's network cannot change. Leave --model.{key} out (the checkpoint's is "
            "used), or pass a checkpoint of that network.")
    return updates
