"""Which settings are credentials, and a copy of any value with them replaced by "<redacted>". A leaf (the standard
library only): the data side (datamodules/shards/: S3 storage_options in hparams), the run record
(lightning_app/runs/identity.py: the command line in run.json) and the saved config.yaml
(lightning_app/callbacks/saved_config.py) all import it."""
from __future__ import annotations

from typing import Any

SECRET_KEYS = frozenset({"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "password", "token",
                         "secret", "key", "access_key", "secret_key", "session_token"})
REDACTED = "<redacted>"


def is_secret(key: str) -> bool:
    key = str(key).lower()
    return key in SECRET_KEYS or key.endswith(("_secret", "_token", "_password", "secret_access_key"))


def redact(value: Any) -> Any:
    """A copy of `value` with every credential replaced by "<redacted>" (dicts and lists, recursively)."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret(k) and v is not None else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
