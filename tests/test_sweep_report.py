"""The sweep's summary line: a best trial that only ties the others is said to."""
from __future__ import annotations

import pytest

from lightning_app.sweep.report import best_line
from lightning_app.sweep.space import read_space
from tests.helpers import REPO

optuna = pytest.importorskip("optuna")


def _study(values: list[float]):
    study = optuna.create_study(direction="maximize")
    lr = optuna.distributions.FloatDistribution(0.01, 1.0, log=True)
    for i, value in enumerate(values):
        study.add_trial(optuna.trial.create_trial(params={"model.lr": 0.1 * (i + 1)}, distributions={"model.lr": lr},
                                                  value=value))
    return study


def test_a_sweep_whose_trials_all_tie_says_so():
    space = read_space(REPO / "configs" / "sweeps" / "lr_wd.yaml")
    assert "every trial tied at 0.1000" in best_line(_study([0.1, 0.1, 0.1]), space)
    assert "2 trials tied at 0.5000; trial 1 is the first" in best_line(_study([0.2, 0.5, 0.5]), space)
    assert "tied" not in best_line(_study([0.2, 0.5, 0.3]), space)


@pytest.mark.parametrize(("trials", "fails", "stops"), [(1, 1, True), (2, 1, False), (2, 2, True), (10, 2, False),
                                                         (10, 3, True)])
def test_a_sweep_stops_after_as_many_failed_trials_in_a_row_as_it_was_asked_for_at_most_3(trials, fails, stops,
                                                                                          tmp_path):
    from lightning_app.sweep.runner import Sweep

    sweep = Sweep(tmp_path, read_space(REPO / "configs" / "sweeps" / "lr_wd.yaml"), [], trials, 60.0)
    sweep.fails_in_a_row = fails
    assert sweep.gave_up is stops
