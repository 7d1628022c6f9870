"""The typical mistakes on the command line each end in a few lines of stderr, exit status 2, naming the fix."""
from __future__ import annotations

import os

import pytest
import torch

from lightning_app.cli import ClassifierCLI, main
from lightning_app.cpu_processes import OVERSUBSCRIBED, check_cpu_processes
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main, train_checkpoint


def _fails(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) <= 5, err
    return err


@pytest.mark.parametrize(("typed", "said"), [
    (["--trainer.max_epoks", "3"], "did you mean --trainer.max_epochs?"),
    (["--trainer.max_epoch", "3"], "did you mean --trainer.max_epochs?"),  # no abbreviation is taken
    (["--data.batch_sise", "8"], "did you mean --data.batch_size?"),
    (["--model.learning_rate", "0.1"], "did you mean --model.lr?"),  # another tool's name for it
])
def test_a_mistyped_option_names_the_closest_one(typed, said, tiny_data, tmp_path, capsys):
    err = _fails(["fit", *quick_args(tiny_data, tmp_path), *typed], capsys)
    lines = err.splitlines()
    assert lines[0].startswith("error: unrecognized argument") and typed[0] in lines[0]
    assert said in err and "python main.py fit --help" in lines[-1] and len(lines) <= 3
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("typed", "said"), [
    (["--model.lr", "-1"], "--model.lr -1.0 must be > 0"),
    (["--model.lr", "0"], "--model.lr 0.0 must be > 0"),  # trained silently for nothing
    (["--model.weight_decay", "-0.1"], "--model.weight_decay -0.1 must be >= 0"),
    (["--model.momentum", "1.2"], "--model.momentum 1.2 must be in [0, 1)"),
    (["--trainer.max_epochs", "0"], "--trainer.max_epochs 0 must be an integer >= 1"),
    (["--data.batch_size", "0"], "--data.batch_size 0 must be an integer >= 1"),
    (["--data.image_size", "-32"], "--data.image_size -32 must be an integer >= 1"),
    (["--data.val_image_size", "0"], "--data.val_image_size 0 must be an integer >= 1"),
    (["--model.mixup_alpha", "-0.2", "--model.cutmix_alpha", "-1"], "--model.mixup_alpha -0.2 must be >= 0"),
    (["--model.arch", "resnet18", "--model.weights", "DEFAULT"],  # torchvision's weights="DEFAULT"
     "--model.weights DEFAULT is no file here and no weights name: it takes a weights file"),
    (["--model.arch", "resnet18", "--model.weights", "default"],
     "for --model.arch resnet18 that is ResNet18_Weights.IMAGENET1K_V1"),
    (["--model.arch", "timm/resnet10t", "--model.weights", "imagenet"],
     "for --model.arch timm/resnet10t, timm's pretrained weights are --model.weights timm"),
])
def test_a_bad_value_stops_at_parse_time_in_one_paragraph(typed, said, tiny_data, tmp_path, capsys):
    err = _fails(["fit", *quick_args(tiny_data, tmp_path), *typed], capsys)
    assert len(err.splitlines()) == 1 and said in err and "Fix " in err
    assert not list(tmp_path.iterdir())  # nothing was built or written


@pytest.mark.parametrize("subcommand", ["predict", "validate", "test"])
def test_evaluating_an_untrained_model_is_refused(subcommand, tiny_data, tmp_path, capsys):
    err = _fails([subcommand, *quick_args(tiny_data, tmp_path), "--data.predict_dir", str(tiny_data / "val")], capsys)
    assert len(err.splitlines()) == 1 and "--ckpt_path" in err and "--model.weights" in err
    assert not list(tmp_path.iterdir())  # no predictions.csv of noise, no folder


def test_not_a_checkpoint_a_pickled_object_and_a_plain_state_dict_get_their_own_message(tiny_data, tmp_path, capsys):
    args = ["validate", *quick_args(tiny_data, tmp_path / "logs")]
    text = tmp_path / "notes.ckpt"
    text.write_text("# my notes\n")
    err = _fails([*args, "--ckpt_path", str(REPO / "README.md")], capsys)
    assert "is not a checkpoint" in err and "pickle" not in err and "weights_only" not in err
    err = _fails([*args, "--ckpt_path", str(text)], capsys)
    assert f"{text} is not a checkpoint" in err and "b'# my notes" in err

    pickled = tmp_path / "module.ckpt"
    torch.save(torch.nn.Linear(2, 2), pickled)  # a whole module object: needs full pickle
    err = _fails([*args, "--ckpt_path", str(pickled)], capsys)
    assert "needs full pickle" in err and "torch.nn.modules.linear.Linear" in err
    assert err.splitlines()[-1].strip().startswith("python -c '")  # the conversion, shell-quoted

    plain = tmp_path / "r50.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, plain)
    err = _fails([*args, "--ckpt_path", str(plain)], capsys)
    assert "is a plain state_dict" in err and "conv1.weight [64, 3, 7, 7]" in err and f"--model.weights {plain}" in err
    assert not (tmp_path / "logs").exists()


def test_imagenet_weights_at_32_px_name_data_image_size(imagenet_weights_in_cache, tiny_data, tmp_path, capsys):
    err = _fails(["fit", *quick_args(tiny_data, tmp_path, width=None), "--config", "configs/model/resnet50.yaml",
                  "--model.weights", "ResNet50_Weights.IMAGENET1K_V2"], capsys)
    assert "layer conv1.weight" in err and "--data.image_size 224" in err and "7x7 stem" in err


@pytest.mark.slow
def test_evaluating_from_weights_needs_every_layer_of_these_classes(tiny_data, tmp_path, capsys):
    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "run", epochs=1, batch=40)
    args = ["validate", *quick_args(tiny_data, tmp_path / "logs"), "--trainer.enable_model_summary", "false"]
    cli = ClassifierCLI(args=[*args, "--model.weights", str(ckpt)])  # a checkpoint of ours as weights: complete
    by_weights = float(cli.trainer.callback_metrics["val/acc1"])
    cli = ClassifierCLI(args=[*args, "--ckpt_path", str(ckpt)])
    assert by_weights == float(cli.trainer.callback_metrics["val/acc1"])

    five = {k[len("backbone."):]: v[:5] if k.startswith("backbone.fc.") else v
            for k, v in torch.load(ckpt, weights_only=True)["state_dict"].items() if k.startswith("backbone.")}
    other = tmp_path / "five_classes.pth"
    torch.save(five, other)
    err = _fails([*args, "--model.weights", str(other)], capsys)
    assert "the head fc (10 classes; the weights have 5)" in err and "random initialisation" in err


def test_a_mistyped_subcommand_names_the_closest_one(capsys):
    err = _fails(["predcit", "--ckpt_path", "x.ckpt"], capsys)
    assert "invalid choice: 'predcit'" in err and "did you mean predict?" in err and len(err.splitlines()) == 3


def test_a_rendezvous_port_another_process_holds_is_named_not_taken_for_a_lost_peer(tiny_data, tmp_path):
    """MASTER_PORT held by another process: rank 0's TCPStore cannot listen (EADDRINUSE). One paragraph naming the
    port and the setting, exit 2; before, it was "lost a peer ... lost the master", exit 1 (the sweep retries a
    trial on this, sweep/runner.py)."""
    import socket

    from tests.helpers.cli import run_main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = run_main(["fit", *quick_args(tiny_data, tmp_path), "--trainer.strategy", "ddp",
                        "--trainer.devices", "1", "--trainer.limit_train_batches", "1"],
                       env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout=120, check=False)
    err = run.stderr.strip()
    assert run.returncode == 2, run.stdout[-2000:] + err
    assert f"could not listen on its rendezvous 127.0.0.1:{port}" in err and "Set MASTER_PORT" in err, err
    assert "lost" not in err and "Traceback" not in err, err


def test_an_empty_or_truncated_checkpoint_says_so(tiny_data, tmp_path, capsys):
    # what a save stopped by a full disk or a killed copy leaves, not torch's "mmap can only be used with files
    # saved with ..." or "failed finding central directory"
    args = ["validate", *quick_args(tiny_data, tmp_path / "logs")]
    empty, cut = tmp_path / "empty.ckpt", tmp_path / "cut.ckpt"
    empty.write_bytes(b"")
    torch.save({"state_dict": {"w": torch.zeros(4096)}}, cut)
    cut.write_bytes(cut.read_bytes()[:5000])
    err = _fails([*args, "--ckpt_path", str(empty)], capsys)
    assert f"{empty} is empty (0 bytes)" in err and "mmap" not in err, err
    err = _fails([*args, "--ckpt_path", str(cut)], capsys)
    assert f"{cut} is truncated: 5,000 bytes" in err and "central directory" not in err, err
    assert "is not a checkpoint" not in err


@pytest.mark.slow
@pytest.mark.parametrize("size", [0, 3000], ids=["empty", "truncated"])
def test_resuming_a_run_whose_last_ckpt_was_cut_short_names_its_size_and_its_best_checkpoint(size, tiny_data, tmp_path):
    args = ["fit", *quick_args(tiny_data, tmp_path), "--data.image_size", "32"]
    run_main(args)
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:size])
    proc = run_main([*args, "--ckpt_path", "last"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = "empty (0 bytes);" if size == 0 else "truncated: 3,000 bytes, without the zip directory"
    assert f"ends with {last}, which is {said}" in proc.stderr and "its best checkpoint is" in proc.stderr, \
        proc.stderr[-3000:]
    assert "mmap" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("env", "said"), [
    ({"SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 without SLURM_NTASKS_PER_NODE (an `sbatch --ntasks 4` script"),
    ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4"}, ("SLURM_NTASKS_PER_NODE=4 tasks per node, but "
                                                         "--trainer.devices 1")),
    ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2"}, ("SLURM_NNODES=2 nodes, but "
                                                                              "--trainer.num_nodes 1")),
], ids=["ntasks-without-srun", "tasks-per-node", "nodes"])
def test_contradictory_slurm_variables_are_one_paragraph(env, said, tiny_data, tmp_path, capsys, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": env["SLURM_NTASKS"]}  # srun's: python is its step
    for key, value in {**SLURM_TASK, **step, **env}.items():
        monkeypatch.setenv(key, value)
    err = _fails(["fit", *quick_args(tiny_data, tmp_path), "--trainer.devices", "1"], capsys)
    assert err.startswith("SLURM's variables do not fit this run: ") and said in err, err
    assert "Read: SLURM_JOB_NAME=train, SLURM_NTASKS=" in err and "scripts/slurm/train.sbatch" in err
    assert not list(tmp_path.iterdir())


SLURM_TASK = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node1", "SLURM_PROCID": "0",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # a batch script's own process has these too (slurmstepd's)


@pytest.mark.slow
@pytest.mark.parametrize(("step", "said"), [
    ({}, "SLURM_NTASKS=4 tasks, but this python is not an srun step (SLURM_STEP_ID and SLURM_STEP_NUM_TASKS unset"),
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"},
     "SLURM_NTASKS_PER_NODE=4 tasks per node, but --trainer.devices auto (1 device here)"),
], ids=["sbatch-without-srun", "srun-step"])
def test_slurm_tasks_that_devices_auto_cannot_match_are_one_paragraph(step, said, tiny_data, tmp_path):
    """`sbatch --ntasks-per-node 4` with `python main.py fit` (no srun) and --trainer.devices auto, on a CPU: `auto`
    is one device here, Lightning's check of the tasks runs only with its DDP launcher, and SLURM starts no other
    process, so one process trained alone (exit 0) while the job held 4 tasks; on a 4-GPU node the one process
    would wait for 3 ranks that never start. Under srun each of the 4 tasks trained a run of its own. In a real
    process, with the variables SLURM sets (the batch script's own process has SLURM_PROCID=0 too)."""
    env = {**SLURM_TASK, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1", **step}
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path), "--trainer.devices", "auto"], env=env, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert err.startswith("SLURM's variables do not fit this run: ") and said in err, err
    assert "Read: SLURM_JOB_NAME=train, SLURM_NTASKS=4, SLURM_NTASKS_PER_NODE=4, SLURM_NNODES=1, SLURM_STEP_ID" in err
    assert "scripts/slurm/train.sbatch" in err and "Traceback" not in err and err.count("\n") == 0, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("env", [
    {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"},  # srun's step: every task is a process
    {"TORCHELASTIC_RUN_ID": "7"},  # torchrun inside the job starts the processes: Lightning takes TorchElastic first
    {"SLURM_JOB_NAME": "interactive"},  # Lightning ignores SLURM for these job names
], ids=["srun-step", "torchrun-in-the-job", "interactive"])
def test_slurm_variables_of_processes_that_all_start_pass(env):
    from lightning_app.strategies.slurm_variables import check_slurm_variables

    check_slurm_variables(4, 1, {**SLURM_TASK, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", **env}, "cpu")


@pytest.mark.parametrize(("devices", "step", "said"), [
    ("auto", {}, "with --trainer.devices auto (1 device here) one process would train alone while the job holds 4"),
    (4, {}, "with --trainer.devices 4 it would wait for ranks that never start"),
    ("auto", {"SLURM_STEP_ID": "0"}, "SLURM_NTASKS_PER_NODE=4 tasks per node, but --trainer.devices auto (1 device"),
], ids=["auto-without-srun", "four-without-srun", "auto-in-an-srun-step"])
def test_slurm_tasks_that_cannot_all_start_are_refused(devices, step, said):
    """The quick check of the rules the slow test above runs in a real process (a CPU: `auto` is one device)."""
    from lightning_app.errors import UserError
    from lightning_app.strategies.slurm_variables import check_slurm_variables

    with pytest.raises(UserError, match="SLURM's variables do not fit this run") as refused:
        check_slurm_variables(devices, 1, {**SLURM_TASK, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", **step},
                              "cpu")
    assert said in str(refused.value), refused.value


def test_a_few_more_cpu_processes_than_cpus_are_said_in_one_line_and_run():
    """4 gloo processes on 2 CPUs is how DDP is tried on a laptop (test_comm_hooks does): said, not refused."""
    cpus = len(os.sched_getaffinity(0))
    line = check_cpu_processes("cpu", cpus + 1, env={})
    assert line and f"--trainer.devices {cpus + 1} on the CPU: {cpus + 1} training processes share" in line, line
    assert check_cpu_processes("cpu", OVERSUBSCRIBED * cpus, env={})
    assert check_cpu_processes("cpu", cpus, env={}) is None
    assert check_cpu_processes("cpu", OVERSUBSCRIBED * cpus + 1, env={"LOCAL_RANK": "0"}) is None  # a launcher's


def test_far_more_cpu_processes_than_cpus_are_refused_before_any_starts(tiny_data, tmp_path, capsys):
    """--trainer.devices 64 on a 2-CPU machine started 64 processes and nothing past 'MEMBER: 1/64' in 5 minutes."""
    cpus = len(os.sched_getaffinity(0))
    many = OVERSUBSCRIBED * cpus + 1
    err = _fails(["fit", *quick_args(tiny_data, tmp_path), "--trainer.devices", str(many)], capsys)
    assert f"--trainer.devices {many} on the CPU starts {many} training processes" in err, err
    assert f"pass --trainer.devices {many - 1} or fewer" in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())
