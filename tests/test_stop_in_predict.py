"""A stop signal during `predict`: it stops at the next batch, as validate and test do, with exit status 130 after
Ctrl-C (one line) and 143 after SIGTERM, and leaves nothing half-written: no predictions.csv, no part or temp file.

Lightning's predict loop reads no stop flag (pytorch_lightning/loops/prediction_loop.py): SIGTERM's default action
ended the process with its rank's part file left behind (a second Ctrl-C, which ends the process at once, too), and
Ctrl-C took Lightning's KeyboardInterrupt path
("attempting graceful shutdown", exit status 1, the lost peer's). Two processes, as `predict --trainer.devices 2`
runs (tests/test_predict.py): a terminal's Ctrl-C and a container stop reach every process.
"""
from __future__ import annotations

import pytest

from tests.helpers.cli import train_checkpoint
from tests.helpers.processes import finish, free_port, start_main
from tests.test_stop_in_validation import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def checkpoint(tiny_data, tmp_path_factory):
    return train_checkpoint(tiny_data, tmp_path_factory.mktemp("stop_in_predict"), epochs=1, batch=32)[3]


@pytest.mark.parametrize("devices", [1, 2], ids=["one-process", "two-processes"])
@pytest.mark.parametrize(("sig", "again", "status"), [("SIGINT", -1, 130), ("SIGTERM", -1, 143), ("SIGINT", 1, 130)],
                         ids=["ctrl-c", "sigterm", "ctrl-c-twice"])
def test_a_stop_signal_during_predict_stops_at_the_next_batch_leaving_no_predictions(
        checkpoint, tiny_data, tmp_path, sig, again, status, devices):
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"] if devices == 2 else []
    args = ["predict", "--ckpt_path", str(checkpoint), "--data.predict_dir", str(tiny_data / "val"),
            "--data.batch_size", "8", "--data.num_workers", "0", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "logs"), *ddp,
            "--trainer.callbacks+=tests.helpers.callbacks.SignalDuringPredict", "--trainer.callbacks.batch=1",
            f"--trainer.callbacks.sig={sig}", f"--trainer.callbacks.again={again}"]
    code, out = finish(start_main(args, {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}),
                       timeout=300)
    assert code == status, out[-4000:]
    assert "Traceback" not in out and "graceful shutdown" not in out, out[-4000:]
    assert "predict: wrote" not in out, out[-4000:]
    if sig == "SIGINT":
        assert out.count("Ctrl-C: stopping at the next batch, saving nothing") == 1, out[-4000:]
    if again != -1:  # the second Ctrl-C ends every process at once; the part files go first
        assert "Ctrl-C again: stopped at once, without saving" in out, out[-4000:]
    assert not list((tmp_path / "logs").rglob("*predictions.csv*")), sorted((tmp_path / "logs").rglob("*"))
