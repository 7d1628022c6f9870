"""A bad value of any setting, on the command line or in a config file, and a config file that is not what the
parser reads, each end in one paragraph naming the setting (or key), the value, what it takes and the file."""
from __future__ import annotations

import pytest

from lightning_app.cli import main


def _fails(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, err
    assert "Traceback" not in err and "Union subtypes" not in err and "Parser key" not in err, err
    assert len(err.splitlines()) <= 2, err  # the paragraph, and where --help lists every option
    return err


@pytest.mark.parametrize(("typed", "said"), [
    (["--data.worker_start", "forkserv"],
     ["--data.worker_start 'forkserv' (on the command line)", "one of forkserver, fork, spawn",
      "Did you mean forkserver?"]),
    (["--data.decode", "GPU"], ["--data.decode 'GPU'", "one of cpu, gpu", "Did you mean gpu?"]),
    (["--data.batch_size", "sixty-four"], ["--data.batch_size 'sixty-four'", "it takes an integer."]),
    (["--data.num_workers", "many"], ["--data.num_workers 'many'", "an integer or one of auto"]),
    (["--model.lr", "abc"], ["--model.lr 'abc'", "it takes a number or null"]),
    (["--trainer.max_epochs", "three"], ["--trainer.max_epochs 'three'", "an integer or null"]),
    (["--data", "ImageFolderDataModul"], ["--data 'ImageFolderDataModul'", "Did you mean ImageFolderDataModule?"]),
    (["--trainer.strategy", "ddpp"], ["--trainer.strategy 'ddpp' is no strategy name", "did you mean ddp?"]),
    (["--trainer.strategy", "ddp", "--trainer.strategy.timeout_s", "60"],
     ["--trainer.strategy.timeout_s '60'", "--trainer.strategy lightning_app.strategies.ddp.ClusterDDPStrategy"]),
    (["--trainer.strategy", "lightning_app.strategies.ClusterDDPStrategy", "--trainer.strategy.timeout_s", "soon"],
     ["--trainer.strategy.timeout_s 'soon'", "a number or null"]),
])
def test_a_bad_value_names_the_setting_the_value_what_it_takes_and_the_nearest_choice(typed, said, tmp_path, capsys):
    err = _fails(["fit", "--trainer.default_root_dir", str(tmp_path), *typed], capsys)
    for words in said:
        assert words in err
    assert not list(tmp_path.iterdir())


def test_a_config_file_s_unknown_keys_are_all_named_with_the_file_and_the_nearest_key(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  max_epoch: 2\nmodel:\n  lrr: 0.1\ndata:\n  batch_size: 8\n  decod: cpu\n")
    err = _fails(["fit", "--config", str(config)], capsys)
    for key, meant in (("trainer.max_epoch", "trainer.max_epochs"), ("model.lrr", "model.lr"),
                       ("data.decod", "data.decode")):
        assert f"{key} in {config} (did you mean {meant}?)" in err


def test_a_config_file_s_bad_value_names_the_key_the_value_the_type_and_the_file(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text('trainer:\n  max_epochs: "three"\n')
    err = _fails(["fit", "--config", str(config)], capsys)
    assert f"--trainer.max_epochs 'three' (in {config})" in err and "an integer" in err


def test_a_config_file_that_is_not_yaml_gets_its_line_and_column(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  max_epochs: 2\n   devices: 1\n")
    err = _fails(["fit", "--config", str(config)], capsys)
    assert err.startswith(f"error: {config}, line 3, column 11: the file is not valid YAML")


def test_a_strategy_s_unknown_init_arg_in_a_file_names_the_file_and_the_nearest_arg(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: lightning_app.strategies.ddp.ClusterDDPStrategy\n"
                      "    init_args:\n      timeout: 30\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert f"unknown key trainer.strategy.timeout in {config}" in err and "did you mean --trainer.strategy.timeout_s?" \
        in err, err


@pytest.mark.parametrize(("given", "meant"), [("configs/ddp_amp.yml", "configs/ddp_amp.yaml"),
                                              ("configs/ddp-amp.yaml", "configs/ddp_amp.yaml"),
                                              ("config/ddp_amp.yaml", "configs/ddp_amp.yaml")])
def test_a_config_file_that_is_not_there_is_named_with_the_nearest_one(given, meant, tmp_path, capsys):
    err = _fails(["fit", "--trainer.default_root_dir", str(tmp_path), "--config", given], capsys)
    assert err.startswith(f"error: --config {given}: no such file (did you mean {meant}?)"), err
