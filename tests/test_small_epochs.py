"""An epoch shorter than --trainer.log_every_n_steps is said in our words, naming the flag; the logging steps (where
the ranks agree on stops) stay where the setting puts them."""
from __future__ import annotations

import csv
import logging
import warnings

from lightning_app.cli import main
from tests.helpers.cli import quick_args


def test_a_short_epoch_is_said_naming_the_flag_and_keeps_its_logging_steps(tiny_data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"), \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # what main() does not silence itself is recorded
        main(["fit", *quick_args(tiny_data, tmp_path, epochs=3, batch=48), "--trackers", "csv",
              "--model.pictures", "[]", "--trainer.num_sanity_val_steps", "0"])  # 240 images: 5 steps an epoch
    out = caplog.text
    assert "An epoch has 5 training steps, fewer than --trainer.log_every_n_steps 10: train/loss, train/acc1 and " \
           "train/lr are logged every 10 steps, not in every epoch" in out, out
    assert "Pass --trainer.log_every_n_steps 5 or less" in out, out
    assert not [w for w in seen if "smaller than the logging interval" in str(w.message)], \
        [str(w.message) for w in seen]
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == [9], rows  # Lightning's 10th step only
