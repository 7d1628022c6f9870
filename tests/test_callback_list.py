"""The callbacks a fit runs are the list in configs/callbacks/default.yaml, plus the few a setting asks for (named in
that file's comments): dropping one from the list drops it from the run, except the stop-signal save, and a user's
own is added to the list with `+`."""
from __future__ import annotations

import re

import pytest
import yaml

from lightning_app.cli import ClassifierCLI, main
from lightning_app.runs.identity import read_run
from tests.helpers import REPO
from tests.helpers.cli import quick_args

LIST_FILE = REPO / "configs" / "callbacks" / "default.yaml"
SIGTERM_SAVE = "lightning_app.callbacks.checkpoints.CheckpointOnSigterm"
USER_CALLBACK = "pytorch_lightning.callbacks.LearningRateMonitor"


def listed() -> list[str]:
    return [item["class_path"] for item in yaml.safe_load(LIST_FILE.read_text())]


def added_by_settings() -> set[str]:
    """The classes the list's comments name as added by code where a setting asks for them ('# - Name / Name: ...')."""
    names = set()
    for line in LIST_FILE.read_text().splitlines():
        found = re.match(r"# - ([\w /]+):", line)
        if found:
            names |= {n.strip() for n in found.group(1).split("/")}
    return names


def names(callbacks) -> set[str]:
    return {type(c).__name__ for c in callbacks}


@pytest.mark.slow
def test_every_callback_a_plain_fit_attaches_is_named_in_the_config_it_read(tiny_data, tmp_path):
    """A plain fit (progress bar, model summary, pictures on, as the defaults have them) of one short epoch."""
    cli = main(["fit", "--data.data_dir", str(tiny_data), "--data.batch_size", "32", "--data.num_workers", "0",
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu",
                "--model.arch_kwargs", "{width: 8}", "--trainer.log_every_n_steps", "1"])
    saved = yaml.safe_load((tmp_path / "version_0" / "config.yaml").read_text())  # the config the run read
    in_config = {c["class_path"].rpartition(".")[2] for c in saved["trainer"]["callbacks"]}
    assert in_config == {p.rpartition(".")[2] for p in listed()}
    attached = names(cli.trainer.callbacks)
    assert in_config <= attached
    assert "checkpoint" in saved and type(cli.trainer.checkpoint_callback).__name__ == "ResumableCheckpoint"
    by_code = attached - in_config - {"ResumableCheckpoint"}
    assert by_code <= added_by_settings(), f"attached in code but named nowhere in {LIST_FILE}: " \
                                           f"{sorted(by_code - added_by_settings())}"
    assert "PredictionsCSV" not in attached  # it writes in predict only
    # none of the list is a training setting `--ckpt_path last` compares: runs made before the list record none
    assert read_run(tmp_path / "version_0")["training"]["trainer"]["callbacks"] == []


def test_dropping_a_callback_from_the_list_drops_it_from_the_run(tiny_data, tmp_path):
    kept = [SIGTERM_SAVE, "lightning_app.callbacks.reseed.ReseedEveryEpoch"]
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [{"class_path": p} for p in kept]}}))
    cli = ClassifierCLI(args=["--config", str(config), *quick_args(tiny_data, tmp_path / "runs")], run=False)
    attached = names(cli.trainer.callbacks)
    assert {"CheckpointOnSigterm", "ReseedEveryEpoch"} <= attached
    dropped = {p.rpartition(".")[2] for p in listed()} - {p.rpartition(".")[2] for p in kept}
    assert dropped and not dropped & attached, dropped & attached


@pytest.mark.parametrize("how", ["config", "flag"])
def test_dropping_the_stop_signal_save_is_refused_in_one_paragraph(how, tiny_data, tmp_path, capsys):
    if how == "config":  # a user's own list, replacing the default one, without the stop-signal save
        config = tmp_path / "mine.yaml"
        config.write_text(yaml.safe_dump({"trainer": {"callbacks": [{"class_path": USER_CALLBACK}]}}))
        args = ["--config", str(config)]
    else:  # --trainer.callbacks without + replaces the list too
        args = [f"--trainer.callbacks={USER_CALLBACK}"]
    with pytest.raises(SystemExit) as stop:
        main(["fit", *quick_args(tiny_data, tmp_path / "runs"), *args])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "trainer.callbacks has no CheckpointOnSigterm" in err and "callbacks+:" in err, err
    assert "--trainer.callbacks+=" in err and SIGTERM_SAVE in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was built


def test_a_users_callback_is_added_to_the_list_with_plus(tiny_data, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks+": [{"class_path": USER_CALLBACK}]}}))
    for args in (["--config", str(config)], [f"--trainer.callbacks+={USER_CALLBACK}"]):
        cli = ClassifierCLI(args=[*args, *quick_args(tiny_data, tmp_path / "runs")], run=False)
        paths = [c["class_path"] for c in cli.config.trainer.callbacks]
        assert paths == [*listed(), USER_CALLBACK], paths
        assert "LearningRateMonitor" in names(cli.trainer.callbacks)
