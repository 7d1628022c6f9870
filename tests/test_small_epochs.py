"""An epoch shorter than --trainer.log_every_n_steps still logs train/loss every epoch, and says so in our words."""
from __future__ import annotations

import csv
import logging
import warnings

from lightning_app.cli import main
from tests.helpers.cli import quick_args


def test_a_short_epoch_logs_its_loss_every_epoch(tiny_data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"), \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # what main() does not silence itself is recorded
        main(["fit", *quick_args(tiny_data, tmp_path, epochs=2, batch=48), "--trackers", "csv",
              "--model.pictures", "[]", "--trainer.num_sanity_val_steps", "0"])  # 240 images: 5 steps an epoch
    out = caplog.text
    assert "An epoch has 5 training steps, fewer than --trainer.log_every_n_steps 10: train/loss is logged every 5 " \
           "instead." in out, out
    assert not [w for w in seen if "smaller than the logging interval" in str(w.message)]
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert sorted({r["epoch"] for r in rows if r.get("train/loss")}) == ["0", "1"], rows
