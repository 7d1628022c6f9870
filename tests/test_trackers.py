"""Experiment trackers (lightning_app/trackers/) with the real packages: a fit stopped by SIGTERM, then resumed with
`--ckpt_path last`, logging to TensorBoard, CSV, MLflow (local file store) and W&B (offline) at once; each tracker's
files are read back. Nothing may reach the network: the first fit runs under strace when it is there."""
from __future__ import annotations

import csv
import glob
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import quick_args

pytestmark = pytest.mark.timeout(300)

LOGGERS = ["--config", "configs/logger/tensorboard.yaml", "--config", "configs/logger/csv.yaml",
           "--config", "configs/logger/mlflow.yaml", "--config", "configs/logger/wandb.yaml"]
# offline and quiet, as docs/trackers.md says; no W&B system-metrics sampling (WANDB_X_* sets the x_ settings:
# wandb/sdk/wandb_settings.py); no MLflow server inherited from the environment
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_X_DISABLE_STATS": "true", "MLFLOW_TRACKING_URI": ""}
STEPS = 6  # tiny: 240 train images, batch 40


def _args(data: Path, root: Path, extra: list[str] = ()) -> list[str]:
    return ["fit", *quick_args(data, root, epochs=2, batch=40), "--data.image_size", "16",
            "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "2", *LOGGERS, *extra]


@pytest.fixture(scope="module")
def resumed_run(tiny_data, tmp_path_factory):
    """(root, stdout of the stopped fit, stdout of the resume, strace's connect lines or None)."""
    root = tmp_path_factory.mktemp("trackers")
    stop = ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=1",
            "--trainer.callbacks.batch=1", "--trainer.callbacks.sig=SIGTERM"]
    trace = root / "connect.trace"
    strace = shutil.which("strace")
    # strace -f follows every process (wandb-core too); only connect() calls are recorded
    wrap = [strace, "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect", "-o", str(trace)] if strace else []
    first = _run(wrap, _args(tiny_data, root / "logs", stop))
    second = _run([], _args(tiny_data, root / "logs", ["--ckpt_path", "last"]))
    return root / "logs", first, second, trace.read_text() if strace else None


def _run(wrap: list[str], args: list[str]) -> str:
    import os
    import subprocess

    from tests.helpers import REPO

    proc = subprocess.run([*wrap, sys.executable, "main.py", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **ENV}, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_the_run_folder_holds_its_contract_and_the_end_line_names_every_tracker(resumed_run):
    root, first, second, _ = resumed_run
    # resumed in place, no version_1; MLflow's SQLite store and its artifacts beside the runs
    assert sorted(p.name for p in root.iterdir()) == ["mlartifacts", "mlflow.db", "version_0"]
    run = root / "version_0"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert "SIGTERM: saved" in first
    trackers = json.loads((run / "run.json").read_text())["trackers"]
    done = next(line for line in second.splitlines() if line.startswith("Done: "))
    assert f"TensorBoard in {run}" in done and f"CSV in {run / 'metrics.csv'}" in done
    assert f"MLflow run {trackers['mlflow']['run_id']} in sqlite:///{root / 'mlflow.db'}" in done
    assert f"W&B offline run {trackers['wandb']['id']} in {run / 'wandb'}" in done


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_csv_holds_every_epoch_once_after_the_resume(resumed_run):
    root = resumed_run[0]
    with open(root / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    val_epochs = [int(r["epoch"]) for r in rows if r.get("val/acc1")]
    assert val_epochs == [0, 1]
    steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert len(steps) == len(set(steps)) and steps == sorted(steps) and steps[-1] >= STEPS


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_mlflow_continues_one_run_with_metrics_pictures_and_params(resumed_run):
    root = resumed_run[0]
    trackers = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["mlflow"]
    client, runs = _mlflow_runs(root)
    assert [r.info.run_id for r in runs] == [trackers["run_id"]]  # one run, continued by the resume
    run = runs[0]
    assert len(client.get_metric_history(run.info.run_id, "val/acc1")) == 2
    assert {0, 1} <= {int(m.value) for m in client.get_metric_history(run.info.run_id, "epoch")}
    assert run.info.status == "FINISHED"  # after the resume
    artifacts = [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "images")]
    for kind in ("confusion_matrix", "mistakes", "train_batch"):
        assert any(name.startswith(f"images~{kind}+") and name.endswith(".png") for name in artifacts), kind
    assert "most_confused" in artifacts
    assert str(Path(run.info.artifact_uri.removeprefix("file://"))).startswith(str(root / "mlartifacts"))
    params = set(run.data.params)
    # once per run, from one call site: the run's flat hparams only (Lightning's own call would add "lr", "arch")
    assert "model/lr" in params and "trainer/max_epochs" in params
    assert all(p.split("/")[0] in ("model", "data", "trainer") for p in params), sorted(params)


def _mlflow_runs(root: Path):
    """(client, the runs of the root's default store, oldest first): read through MLflow, as a user would."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lightning_logs")
    return client, client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_the_runs_command_lists_the_stores_runs(resumed_run, capsys):
    from lightning_app.mlflow_runs import main

    root = resumed_run[0]
    run_id = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["mlflow"]["run_id"]
    assert main([str(root)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"\| {root.name}/version_0 \| FINISHED \| 2 \| [\d.]+ \| [\d.]+ \| {run_id} \|", out), out


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_wandb_offline_run_continues_with_its_id_and_history(resumed_run):
    root = resumed_run[0]
    run_id = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["wandb"]["id"]
    folders = sorted(glob.glob(str(root / "version_0" / "wandb" / "offline-run-*")))
    assert len(folders) == 2 and all(f.endswith(f"-{run_id}") for f in folders)  # the resume kept the id
    history = [r for f in folders for r in _wandb_history(Path(f) / f"run-{run_id}.wandb")]
    val_epochs = sorted(int(r["epoch"]) for r in history if "val/acc1" in r)
    assert val_epochs == [0, 1]
    images = [Path(p).name for f in folders for p in glob.glob(f"{f}/files/media/images/images/*.png")]
    for kind in ("confusion_matrix", "mistakes", "train_batch"):
        assert any(name.startswith(kind) for name in images), kind


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_tensorboard_beside_the_others_gets_the_same_metrics(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = resumed_run[0]
    events = EventAccumulator(str(root / "version_0"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert len(events.Scalars("val/acc1")) == 2
    assert {"images/confusion_matrix", "images/mistakes", "images/train_batch"} <= set(events.Tags()["images"])


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_validate_logs_a_run_of_its_own_in_the_same_store(resumed_run, monkeypatch):
    from lightning_app.cli import main

    root = resumed_run[0]
    fitted = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["mlflow"]["run_id"]
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    main(["validate", *quick_args(Path(_data_dir(root)), root, batch=40), "--data.image_size", "16",
          "--config", "configs/logger/csv.yaml", "--config", "configs/logger/mlflow.yaml",
          "--ckpt_path", str(root / "version_0" / "checkpoints" / "last.ckpt")])
    assert (root / "version_0" / "validate_0" / "metrics.csv").is_file()
    client, found = _mlflow_runs(root)
    runs = {r.info.run_id: r for r in found}
    assert fitted in runs and len(runs) == 2, sorted(runs)  # the fit's run untouched, one more beside it
    (new,) = set(runs) - {fitted}
    assert runs[new].info.run_name == "version_0/validate_0"
    assert len(client.get_metric_history(fitted, "val/acc1")) == 2


def _data_dir(root: Path) -> str:
    import yaml

    return yaml.safe_load((root / "version_0" / "config.yaml").read_text())["data"]["init_args"]["data_dir"]


@pytest.mark.slow  # two real fits in subprocesses (the module's fixture)
def test_nothing_connects_to_the_network(resumed_run):
    trace = resumed_run[3]
    if trace is None:
        pytest.skip("strace is not installed here")
    inet = [line for line in trace.splitlines() if "AF_INET" in line]
    remote = [line for line in inet if not re.search(r'inet_addr\("127\.|inet_pton\(AF_INET6, "::1"|"::ffff:127\.',
                                                     line)]
    assert remote == [], remote[:5]


def test_default_is_tensorboard_alone_and_configs_stack_in_order(tiny_data, tmp_path):
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_app.cli import ClassifierCLI
    from lightning_app.trackers import RunCSVLogger

    default = ClassifierCLI(args=quick_args(tiny_data, tmp_path), run=False)
    assert [type(x) for x in default.trainer.loggers] == [TensorBoardLogger]
    assert default.trainer.loggers[0]._default_hp_metric is False
    stacked = ClassifierCLI(args=[*quick_args(tiny_data, tmp_path), "--config", "configs/logger/tensorboard.yaml",
                                  "--config", "configs/logger/csv.yaml", "--trackers+=csv"], run=False)
    assert [type(x) for x in stacked.trainer.loggers] == [TensorBoardLogger, RunCSVLogger]  # csv once


@pytest.mark.parametrize("missing", ["mlflow", "wandb"])
def test_a_missing_package_is_one_paragraph_with_its_pip_line(tiny_data, tmp_path, monkeypatch, capsys, missing):
    from lightning_app.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # `import mlflow` raises ImportError, as without the package
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *quick_args(tiny_data, tmp_path), "--config", f"configs/logger/{missing}.yaml"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    pip = "mlflow-skinny" if missing == "mlflow" else "wandb"
    assert f"pip install {pip}" in err and "\n" not in err and "Traceback" not in err
    assert not list(tmp_path.glob("version_*"))


def test_trackers_with_trainer_logger_is_one_paragraph(tiny_data, tmp_path, capsys):
    from lightning_app.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["fit", *quick_args(tiny_data, tmp_path), "--trainer.logger", "false", "--trackers", "[csv]"])
    assert stopped.value.code == 2 and "--trainer.logger" in capsys.readouterr().err


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log records in 32 KiB
    blocks (4-byte CRC, 2-byte length, 1-byte type: full, first, middle, last), each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, chunks, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: one record complete
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.parametrize(("value", "near"), [("mlfow", "mlflow"), ("[tensorboard, mlfow]", "mlflow"),
                                             ("[tensorbord]", "tensorboard"), ("comet", None)])
def test_an_unknown_tracker_is_one_paragraph_with_the_names(tiny_data, tmp_path, capsys, value, near):
    from lightning_app.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["fit", *quick_args(tiny_data, tmp_path), "--trackers", value])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err and "Traceback" not in err, err
    assert "no tracker is called" in err and "tensorboard, csv, mlflow, wandb" in err, err
    assert (f"did you mean {near}?" in err) if near else "did you mean" not in err, err
    assert not list(tmp_path.glob("version_*"))


@pytest.mark.parametrize(("args", "names"), [(["--trackers", "csv"], ["csv"]),
                                             (["--trackers", "[csv, tensorboard]"], ["csv", "tensorboard"]),
                                             (["--config", "configs/logger/csv.yaml", "--trackers+=tensorboard"],
                                              ["csv", "tensorboard"])])
def test_trackers_takes_one_name_or_a_list(tiny_data, tmp_path, args, names):
    from lightning_app.cli import ClassifierCLI

    cli = ClassifierCLI(args=[*quick_args(tiny_data, tmp_path), *args], run=False)
    assert cli.tracker_names == names


def test_a_run_of_an_older_file_store_resumes_there_and_a_new_one_starts_in_sqlite(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # an optional part (requirements-extras.txt): absent at CI's oldest end
    from mlflow.tracking import MlflowClient

    from lightning_app.trackers import build

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = f"file:{tmp_path / 'mlruns'}"  # the default of earlier versions of the template
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("lightning_logs")).info.run_id
    old = {"mlflow": {"run_id": run_id, "tracking_uri": store}}
    (resumed,) = build(["mlflow"], {}, tmp_path, 0, None, tmp_path / "version_0", old, tmp_path)
    assert resumed._tracking_uri == store and resumed.run_id == run_id
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLFlowLogger set it for this process (set_tracking_uri)
    (fresh,) = build(["mlflow"], {}, tmp_path, 1, None, tmp_path / "version_1", None, tmp_path)
    assert fresh._tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}" and fresh._run_id is None
    assert fresh._artifact_location == (tmp_path / "mlartifacts").as_uri()


@pytest.mark.slow  # two real fits in subprocesses
@pytest.mark.parametrize("ranks", [1, 2], ids=["one process", "two ranks, SIGTERM to rank 1"])
def test_a_resume_that_drops_mlflow_ends_its_run_and_one_that_adds_wandb_says_so(tiny_data, tmp_path, ranks):
    """A fit with MLflow stopped by SIGTERM, resumed with TensorBoard and W&B: the MLflow run ends FINISHED (not
    left as the stop left it), and the start-up line says which tracker runs continue, end and begin. With two
    ranks (gloo; the signal to rank 1 only, the stop agreed by both): all of it once, from rank 0, and no tracker
    run of rank 1's own."""
    from mlflow.tracking import MlflowClient

    root = tmp_path / "logs"
    base = ["fit", *quick_args(tiny_data, root, epochs=2, batch=40), "--data.image_size", "16",
            "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]",
            *(["--trainer.strategy", "ddp", "--trainer.devices", "2"] if ranks == 2 else [])]
    stop = ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=1",
            "--trainer.callbacks.batch=1", "--trainer.callbacks.sig=SIGTERM", f"--trainer.callbacks.rank={ranks - 1}"]
    _run([], [*base, "--trackers", "[tensorboard, mlflow]", *stop])
    run_id = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["mlflow"]["run_id"]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert client.get_run(run_id).info.status != "FINISHED"  # stopped mid-fit
    out = _run([], [*base, "--trackers", "[tensorboard, wandb]", "--ckpt_path", "last"])
    wandb_id = json.loads((root / "version_0" / "run.json").read_text())["trackers"]["wandb"]["id"]
    lines = [x for x in out.splitlines() if "trackers on resume: " in x]
    assert len(lines) == 1, out[-3000:]
    assert f"MLflow run {run_id} ends here, FINISHED (mlflow is not in --trackers now)" in lines[0], lines
    assert f"W&B begins run {wandb_id}" in lines[0], lines
    assert [r.info.run_id for r in _mlflow_runs(root)[1]] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    folders = glob.glob(str(root / "version_0" / "wandb" / "offline-run-*"))
    assert len(folders) == 1 and folders[0].endswith(f"-{wandb_id}"), folders
