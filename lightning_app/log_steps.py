"""Which training steps log: the steps where a host-device sync may happen."""
from __future__ import annotations

import pytorch_lightning as pl


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the training step now running is one whose metrics go to the logger (every
    log_every_n_steps): Lightning's own test, the same before, during and after the step
    (trainer/connectors/logger_connector/logger_connector.py, `should_update_logs`). Work that needs a
    host-device sync (a .item(), a float turned into a device tensor) belongs on these steps only."""
    return bool(trainer._logger_connector.should_update_logs)
