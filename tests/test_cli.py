"""The CLI end to end: configs, --print_config, real short fits, TensorBoard, resume, DDP, nodes."""
from __future__ import annotations

import importlib.util
import re
import socket
from pathlib import Path

import pytest
import torch
import yaml

from datamodules.index import load_indexes
from lightning_app.cli import ClassifierCLI
from tests.helpers import REPO
from tests.helpers.callbacks import recorded_samples
from tests.helpers.cli import quick_args, run_main
from tests.helpers.event_files import event_file_scalars
from tests.helpers.optional import needs_dali
from tests.helpers.processes import finish_all, start_nodes

# configs/sweeps/ holds search spaces for python -m lightning_app.sweep (tests/test_sweep.py), configs/callbacks/ the
# trainer.callbacks list configs/default.yaml includes (tests/test_callback_list.py): not main.py configs
CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml")
                 if p.parent.name not in ("sweeps", "callbacks"))


def _needs(config: str):
    """DALI's config needs DALI; configs/logger/{mlflow,wandb}.yaml their optional package (requirements-extras.txt,
    absent at CI's oldest end)."""
    if "dali" in config:
        return needs_dali
    package = {"configs/logger/mlflow.yaml": "mlflow", "configs/logger/wandb.yaml": "wandb"}.get(config)
    missing = package is not None and importlib.util.find_spec(package) is None
    return pytest.mark.skipif(missing, reason=f"needs {package} (requirements-extras.txt), not installed here")


@pytest.mark.parametrize("config", [pytest.param(c, marks=_needs(c)) for c in CONFIGS])
def test_every_config_parses_and_instantiates(config, tiny_data, tmp_path):
    args = ["--config", config, *quick_args(tiny_data, tmp_path, batch=16, width=None)]
    cli = ClassifierCLI(args=args, run=False)
    assert cli.model.hparams.num_classes == 10  # linked from the data
    assert cli.model.hparams.global_batch_size == 16
    assert cli.model.hparams.image_size == cli.datamodule.image_size
    assert type(cli.datamodule).__name__.endswith("DataModule")


def test_print_config_round_trips(tmp_path):
    first = run_main(["fit", "--config", "configs/ddp_amp.yaml", "--model.lr", "0.123", "--print_config"]).stdout
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    second = run_main(["fit", "--config", str(saved), "--print_config"]).stdout
    assert yaml.safe_load(first) == yaml.safe_load(second)
    cfg = yaml.safe_load(first)
    assert cfg["model"]["lr"] == 0.123 and cfg["trainer"]["precision"] == "16-mixed"
    assert cfg["data"]["class_path"] == "datamodules.ImageFolderDataModule"


def test_short_fit_beats_chance_and_logs_everything(learnable_data, tmp_path):
    args = ["fit", *quick_args(learnable_data, tmp_path, epochs=8, batch=32, width=16)]
    args += ["--trainer.log_every_n_steps", "5"]
    cli = ClassifierCLI(args=args)
    best = float(cli.trainer.checkpoint_callback.best_model_score)
    assert best > 0.4, f"val/acc1 {best} is not clearly above chance (0.1)"
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert Path(cli.trainer.checkpoint_callback.best_model_path).is_file()
    run_dir = tmp_path / "version_0"
    assert (run_dir / "config.yaml").is_file()
    acc = event_file_scalars(run_dir)
    tags = set(acc.Tags()["scalars"])
    for tag in ["train/loss", "train/acc1", "val/loss", "val/acc1", "val/acc5", "train/lr",
                "perf/train_img_s", "perf/data_wait_frac"]:
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warm-up, then decay
    assert cli.model.hparams.lr is None and cli.model.optim[:3] == ("sgd", 0.4, 5e-4)  # conv11's recipe
    assert max(lrs) == pytest.approx(0.4 * 32 / 256, rel=0.05)  # scaled by the global batch
    # HPARAMS tab: the hparams summary names val/acc1 as its metric
    from tensorboard.plugins.hparams import plugin_data_pb2

    plugin = acc.PluginTagToContent("hparams")
    metrics = set()
    for content in plugin.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("experiment"):
            metrics |= {m.name.tag for m in data.experiment.metric_infos}
    assert "val/acc1" in metrics
    # a rerun into the same root gets its own run folder
    again = ClassifierCLI(args=["fit", *quick_args(learnable_data, tmp_path, epochs=1, batch=32)])
    assert Path(again.trainer.log_dir) == tmp_path / "version_1"
    assert (tmp_path / "version_1" / "checkpoints" / "last.ckpt").is_file()


def test_resume_continues_at_the_right_epoch_and_step(tiny_data, tmp_path):
    base = quick_args(tiny_data, tmp_path, batch=40)
    first = ClassifierCLI(args=["fit", *base, "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1"])
    steps_per_epoch = first.trainer.num_training_batches
    assert first.trainer.global_step == 2 * steps_per_epoch
    # more epochs are another training setting: `last` would start a fresh run, so name the checkpoint
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    second = ClassifierCLI(args=["fit", *base, "--trainer.max_epochs", "3", "--trainer.log_every_n_steps", "1",
                                 "--ckpt_path", str(last)])
    assert second.trainer.current_epoch == 3
    assert second.trainer.global_step == 3 * steps_per_epoch
    # the resumed run continued in the same run folder, and trained only the third epoch: its curve
    # continues the first run's, with no step logged twice
    assert Path(second.trainer.log_dir) == tmp_path / "version_0"
    assert not (tmp_path / "version_1").exists()
    steps = [e.step for e in event_file_scalars(tmp_path / "version_0").Scalars("train/loss")]
    assert len(steps) == len(set(steps)) == 3 * steps_per_epoch
    assert max(steps) == 3 * steps_per_epoch - 1
    ckpt = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 3 * steps_per_epoch
    sched = ckpt["lr_schedulers"][0]
    assert sched["last_epoch"] == 3 * steps_per_epoch  # the LR schedule continued, not restarted


@pytest.mark.slow
def test_ddp_two_processes_see_disjoint_data(tiny_data, tmp_path):
    out = tmp_path / "samples"
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=2, batch=32), "--trainer.log_every_n_steps", "1",
            "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder", f"--trainer.callbacks.out_dir={out}"]
    proc = run_main(args)
    assert "Done: best val/acc1" in proc.stdout + proc.stderr
    runs = recorded_samples(out)  # what each rank's loader delivered
    assert set(runs) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    n = 240
    truth = load_indexes(tiny_data)["train"].labels
    for (_rank, epoch), run in runs.items():
        assert run["sampler_epoch"] == epoch  # Lightning's set_epoch reached the loader's sampler
        assert run["labels"] == [[truth[i] for i in batch] for batch in run["batches"]]
    for epoch in (0, 1):
        a, b = set(runs[0, epoch]["indices"]), set(runs[1, epoch]["indices"])
        steps = (n // 2) // 16  # global 32 = 2 x 16; each rank's 120 samples make 7 full batches
        assert runs[0, epoch]["steps"] == runs[1, epoch]["steps"] == steps
        assert all(len(batch) == 16 for r in (0, 1) for batch in runs[r, epoch]["batches"])
        assert not a & b, "ranks share samples"
        assert len(a | b) == 2 * 16 * steps and a | b <= set(range(n))
        assert runs[0, epoch]["world_size"] == 2
    assert runs[0, 0]["indices"] != runs[0, 1]["indices"]  # reshuffled each epoch
    # One process with the same config and seed trains on the same global batches, in the same order.
    one_out = tmp_path / "one"
    one = run_main(["fit", *quick_args(tiny_data, tmp_path / "one_run", epochs=2, batch=32),
                    "--trainer.log_every_n_steps", "1",
                    "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder",
                    f"--trainer.callbacks.out_dir={one_out}"])
    assert "Done: best val/acc1" in one.stdout + one.stderr
    single = recorded_samples(one_out)
    for epoch in (0, 1):
        steps = runs[0, epoch]["steps"]
        assert single[0, epoch]["steps"] == steps and single[0, epoch]["sampler_epoch"] == epoch
        for k in range(steps):
            union = set(runs[0, epoch]["batches"][k]) | set(runs[1, epoch]["batches"][k])
            assert union == set(single[0, epoch]["batches"][k]), f"epoch {epoch} step {k} differs"
    # ... with the same learning rate at every step (that of the global batch, warm-up and decay included)
    lrs = [[(e.step, round(e.value, 9)) for e in event_file_scalars(root / "version_0").Scalars("train/lr")]
           for root in (tmp_path, tmp_path / "one_run")]
    assert len(lrs[0]) == 2 * steps and lrs[0] == lrs[1]


@pytest.mark.slow
def test_two_nodes_on_one_machine_finish_together(tiny_data, tmp_path):
    out = tmp_path / "samples"
    args = ["fit", *quick_args(tiny_data, tmp_path, epochs=1, batch=32),
            "--trainer.strategy", "ddp", "--trainer.devices", "1", "--trainer.num_nodes", "2",
            "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder", f"--trainer.callbacks.out_dir={out}"]
    codes, outputs = finish_all(start_nodes(args), timeout=300)
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    host = socket.gethostname()  # each rank says where it runs, in its own log; rank 0 adds the table
    for rank, output in enumerate(outputs):
        said = rf"^rank {rank} of 2: host {re.escape(host)} \(127\.0\.0\.1\), pid \d+, CPU$"
        assert re.search(said, output, re.MULTILINE), output[-3000:]
    assert f"ranks by host: {host} (127.0.0.1) 0-1" in outputs[0] and "ranks by host" not in outputs[1]
    runs = recorded_samples(out)
    assert runs[0, 0]["num_nodes"] == 2 and runs[0, 0]["world_size"] == 2
    assert not set(runs[0, 0]["indices"]) & set(runs[1, 0]["indices"])
