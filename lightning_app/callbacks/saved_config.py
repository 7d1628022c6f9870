"""config.yaml without credentials.

LightningCLI's SaveConfigCallback writes the parsed configuration as it is, so a secret given in
`--data.storage_options` would land in logs/version_N/config.yaml. This subclass writes a copy in
which every value under a key that names a credential (datamodules/credentials.py, `is_secret`)
reads "<redacted>". The run keeps the real values; `--print_config` shows the parsed ones.
"""
from __future__ import annotations

from pytorch_lightning.cli import SaveConfigCallback

from datamodules.credentials import REDACTED, is_secret, redact


def redacted(config):
    """A copy of a jsonargparse Namespace with every credential replaced."""
    out = config.clone()
    for key, value in list(out.items()):
        if is_secret(str(key).rsplit(".", 1)[-1]) and value is not None:
            out[key] = REDACTED
        elif isinstance(value, (dict, list, tuple)):
            out[key] = redact(value)
    return out


class RedactedSaveConfigCallback(SaveConfigCallback):
    def setup(self, trainer, pl_module, stage: str) -> None:
        original = self.config
        self.config = redacted(original)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.config = original
