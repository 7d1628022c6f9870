"""Runs that survive a cluster (issue #19), simulated with environment variables, folders and real processes:
SLURM jobs sharing one root with requeues, an `srun --pty` shell in which Lightning launches 2 devices, two
"nodes" on 127.0.0.1 with their own roots (real gloo), SIGTERM in validate, kills during a checkpoint write."""
from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from datamodules.index import load_index
from datamodules.sample.augment import make_train_augment
from lightning_app.cli import ClassifierCLI, main
from lightning_app.errors import UserError
from lightning_app.runs import identity, launch, lock
from lightning_app.runs.plan import write_new_run
from lightning_app.runs.resolve import Resolved, resolve
from lightning_app.runs.signature import ModelSignature
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main
from tests.helpers.event_files import scalars
from tests.helpers.processes import finish, free_port, in_processes, start_main, start_nodes

pytestmark = pytest.mark.timeout(600)
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_PROCID",
              "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_JOB_NAME", "RANK", "LOCAL_RANK", "NODE_RANK",
              "GROUP_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def _run_of_job(root: Path, job: str) -> Path:
    (run,) = [d for d in root.glob("version_*") if launch.job_key(identity.read_run(d)["slurm"]) == job]
    return run


# -- two SLURM jobs in one root, each requeued ---------------------------------------------
@pytest.mark.slow
def test_two_slurm_jobs_in_one_root_each_resume_their_own_run(tiny_data, tmp_path):
    root = tmp_path / "logs"

    def job(lr: str, *extra: str) -> list[str]:  # 240 images, global batch 40: 6 steps per epoch
        return ["fit", *quick_args(tiny_data, root, epochs=2, batch=40), "--trainer.num_sanity_val_steps", "0",
                "--trainer.log_every_n_steps", "1", "--model.lr", lr, *extra]

    def signal_at(epoch: int, batch: int, sig: str) -> list[str]:
        return ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", f"--trainer.callbacks.epoch={epoch}",
                f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.sig={sig}"]

    # first attempts, side by side: A is preempted with SIGTERM before its first checkpoint; B is killed
    # mid-epoch, 4 steps after its checkpoint, with those steps' events already on disk
    a0 = start_main(job("0.1", *signal_at(0, 2, "SIGTERM")), _env(SLURM_JOB_ID="101", SLURM_RESTART_COUNT="0"))
    b0 = start_main(job("0.2", *signal_at(1, 4, "SIGKILL"), "--trainer.callbacks+=tests.helpers.callbacks.FlushLogs"),
                _env(SLURM_JOB_ID="202", SLURM_RESTART_COUNT="0"))
    (rc_a, out_a), (rc_b, out_b) = finish(a0), finish(b0)
    assert rc_a == 0 and "SIGTERM: saved" in out_a, out_a[-3000:]
    assert rc_b == -9, out_b[-3000:]
    run_a, run_b = _run_of_job(root, "101"), _run_of_job(root, "202")
    os.utime(run_b / "checkpoints" / "last.ckpt")  # B's checkpoint is the newest in the root

    # all requeued at once, beside a requeued job that has no run here: that one stops with one paragraph
    a1 = start_main(job("0.1", "--ckpt_path", "last"), _env(SLURM_JOB_ID="101", SLURM_RESTART_COUNT="1"))
    b1 = start_main(job("0.2", "--ckpt_path", "last"), _env(SLURM_JOB_ID="202", SLURM_RESTART_COUNT="1"))
    c1 = start_main(job("0.3", "--ckpt_path", "last"), _env(SLURM_JOB_ID="303", SLURM_RESTART_COUNT="2"))
    (rc_a, out_a), (rc_b, out_b), (rc_c, out_c) = finish(a1), finish(b1), finish(c1)
    assert rc_a == 0 and f"SLURM job 101 requeued (restart 1): its run {run_a}" in out_a, out_a[-3000:]
    assert rc_b == 0 and f"SLURM job 202 requeued (restart 1): its run {run_b}" in out_b, out_b[-3000:]
    assert rc_c == 2 and "SLURM job 303 was requeued (restart 2), but no run under" in out_c, out_c[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]

    for run, lr, key, procs in ((run_a, 0.1, "101", (a0, a1)), (run_b, 0.2, "202", (b0, b1))):
        pids = {p.pid for p in procs}
        assert yaml.safe_load((run / "config.yaml").read_text())["model"]["lr"] == lr
        record = identity.read_run(run)
        assert record["training"]["model"]["lr"] == lr and identity.jobs_of(record) == {key}
        # nothing of the other job in this run: its attempts, event files and checkpoints are this job's
        assert {a["pid"] for a in record["attempts"]} == pids
        assert {int(p.name.split(".")[-2]) for p in run.glob("events.out.tfevents.*")} <= pids
        for ckpt in run.glob("checkpoints/*.ckpt"):
            assert torch.load(ckpt, weights_only=False)["hyper_parameters"]["lr"] == lr, ckpt
        assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 12
        assert not list(run.glob("checkpoints/last-v*.ckpt"))  # one last.ckpt, whoever saved it first
        # every step logged exactly once, in order; one val/acc1 (and confusion matrix) per epoch
        assert [s for s, _ in scalars(run, "train/loss")] == list(range(12)), run
        val_steps = [s for s, _ in scalars(run, "val/acc1")]
        assert len(val_steps) == 2 and [s for s, _ in scalars(run, "images/confusion_matrix", "images")] == val_steps


# -- what `last` and `hpc` resolve to, on fabricated runs ------------------------------------
def _training(lr: float = 0.1) -> dict:
    return identity.training_settings({"arch": "conv11", "num_classes": 10, "lr": lr, "pictures": []},
                                      "datamodules.ImageFolderDataModule", {"data_dir": "/d", "num_workers": 4},
                                      {"max_epochs": 2, "devices": 4}, seed=1)


def _ckpt(path: Path, step: int = 6) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"hyper_parameters": {"arch": "conv11", "num_classes": 10}, "state_dict": {}, "global_step": step,
                "loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": step}}}}, path)
    return path


def _resolve(ckpt_path: str, root: Path, training: dict, subcommand: str) -> Resolved:
    """`--ckpt_path` resolved in this process's environment, for the model _ckpt saves."""
    return resolve(ckpt_path, root, training, subcommand, launch.this_process(), ModelSignature("conv11", 10, {}))


def _made_run(root: Path, n: int, training: dict, job: str | None = None, ckpt: bool = True) -> Path:
    run = root / f"version_{n}"
    run.mkdir(parents=True)
    record = write_new_run(run, training)
    if job:
        record["slurm"] = {"job_id": job, "restart_count": 0}
        (run / identity.RUN_JSON).write_text(json.dumps(record))
    if ckpt:
        _ckpt(run / "checkpoints" / "last.ckpt")
    return run


def test_last_compares_training_settings_and_a_requeued_job_takes_only_its_own_run(tmp_path, clean_env):
    mine, other = _made_run(tmp_path, 0, _training(), job="101"), _made_run(tmp_path, 1, _training(), job="202")
    _made_run(tmp_path, 2, _training(lr=0.3), job="303")  # the newest, another lr
    # only ignored settings differ (workers, devices, pictures): still the same training
    same = identity.training_settings({"arch": "conv11", "num_classes": 10, "lr": 0.1, "pictures": ["mistakes"]},
                                      "datamodules.ImageFolderDataModule", {"data_dir": "/d", "num_workers": 0},
                                      {"max_epochs": 2, "devices": 1}, seed=1)
    assert _resolve("last", tmp_path, same, "fit").run_dir == other  # the newest with equal settings
    # the strategy is ignored, its gradient compression is not: PowerSGD learns another network
    ddp = {"class_path": "lightning_app.strategies.ddp.ClusterDDPStrategy",
           "init_args": {"timeout_s": 60, "comm_hook": "none"}}
    compressed = {**ddp, "init_args": {**ddp["init_args"], "comm_hook": "powersgd", "powersgd_rank": 2}}
    layout = ("datamodules.ImageFolderDataModule", {"data_dir": "/d"})
    on_ddp = identity.training_settings({"arch": "conv11", "num_classes": 10, "lr": 0.1}, *layout,
                                        {"max_epochs": 2, "strategy": ddp}, seed=1)
    assert _resolve("last", tmp_path, on_ddp, "fit").run_dir == other
    with_powersgd = identity.training_settings({"arch": "conv11", "num_classes": 10, "lr": 0.1}, *layout,
                                               {"max_epochs": 2, "strategy": compressed}, seed=1)
    fresh = _resolve("last", tmp_path, with_powersgd, "fit")
    assert fresh.run_dir is None and "trainer.gradient_compression.comm_hook unset -> powersgd" in fresh.lines[0]
    # validate/test/predict evaluate a network: how long it trained does not matter to them
    longer = identity.training_settings({"arch": "conv11", "num_classes": 10, "lr": 0.1},
                                        "datamodules.ImageFolderDataModule",
                                        {"data_dir": "/d"}, {"max_epochs": 9}, seed=1)
    assert _resolve("last", tmp_path, longer, "validate").run_dir == other
    assert _resolve("last", tmp_path, longer, "fit").run_dir is None
    clean_env.setenv("SLURM_JOB_ID", "101")
    clean_env.setenv("SLURM_RESTART_COUNT", "1")
    assert _resolve("last", tmp_path, same, "fit").run_dir == mine  # requeued: its own, not the newer equal one
    clean_env.setenv("SLURM_JOB_ID", "404")
    with pytest.raises(UserError, match=r"SLURM job 404 was requeued \(restart 1\), but no run under"):
        _resolve("last", tmp_path, same, "fit")
    # an array task is named ARRAYJOB_TASK
    clean_env.setenv("SLURM_ARRAY_JOB_ID", "77")
    clean_env.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert launch.job_key(launch.slurm_job()) == "77_3"

    clean_env.delenv("SLURM_JOB_ID")
    fresh = _resolve("last", tmp_path, _training(lr=0.5), "fit")
    assert fresh.checkpoint is None and fresh.run_dir is None
    assert ("the nearest, version_2, differs in model.lr 0.3 -> 0.5" in fresh.lines[0]
            and "starting a fresh run" in fresh.lines[0])


def test_a_matching_run_without_a_readable_checkpoint_is_named_and_no_older_run_is_taken(tmp_path, clean_env):
    _made_run(tmp_path, 0, _training())  # an older run of the same config, with a good last.ckpt
    newest = _made_run(tmp_path, 1, _training())
    best = _ckpt(newest / "checkpoints" / "best-epoch000-acc0.5000.ckpt")
    (newest / "checkpoints" / "last.ckpt").write_bytes(b"torn")
    with pytest.raises(UserError) as error:
        _resolve("last", tmp_path, _training(), "fit")
    assert str(newest / "checkpoints" / "last.ckpt") in str(error.value) and str(best) in str(error.value)
    assert "No older run is resumed instead" in str(error.value)

    # killed before its first checkpoint: started again in its own folder, not the run before it
    shutil.rmtree(newest / "checkpoints")
    again = _resolve("last", tmp_path, _training(), "fit")
    assert (again.run_dir, again.checkpoint) == (newest, None) and "before its first checkpoint" in again.lines[0]
    with pytest.raises(UserError, match="has no last.ckpt"):
        _resolve("last", tmp_path, _training(), "validate")


def test_hpc_resolves_to_lightnings_requeue_checkpoint_in_the_run_folder(tmp_path, clean_env):
    run = _made_run(tmp_path, 0, _training())
    hpc = _ckpt(run / "hpc_ckpt_2.ckpt", step=9)
    os.utime(run / "checkpoints" / "last.ckpt", (1, 1))
    resolved = _resolve("hpc", tmp_path, _training(), "fit")
    assert (resolved.checkpoint, resolved.run_dir) == (str(hpc), run)
    assert _resolve("last", tmp_path, _training(), "fit").checkpoint == str(hpc)  # the newer of the two


# -- ranks and locks ---------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "zero"), [
    ({}, True),
    ({"RANK": "0", "SLURM_PROCID": "3"}, True),
    ({"RANK": "2"}, False),
    ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),  # srun --pty bash: Lightning's child of local rank 1
    ({"SLURM_PROCID": "0"}, True),  # ... and its parent
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),
    ({"NODE_RANK": "1"}, False),  # a second node started by hand, before Lightning launches
    ({"NODE_RANK": "0", "SLURM_PROCID": "5"}, False),  # an exported NODE_RANK=0 under srun: the task decides
    ({"GROUP_RANK": "1", "LOCAL_RANK": "0"}, False),
    ({"OMPI_COMM_WORLD_RANK": "1"}, False),
])
def test_the_launch_rank_comes_from_the_right_variables(env, zero, clean_env):
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert launch.is_launch_rank_zero() is zero


def test_a_lock_is_never_seen_half_written_and_a_stale_one_is_taken_from_any_host(tmp_path, clean_env):
    run = tmp_path / "version_0"
    run.mkdir()
    # what a create-then-write lock shows for an instant: an empty file. It is someone's, not stale.
    (run / lock.LOCK_NAME).write_text("")
    with pytest.raises(UserError, match="locked by an unreadable lock"):
        lock.RunLock(run).acquire()
    (run / lock.LOCK_NAME).write_text('{"pid": 4242, "host": "node-b", "started": "then"}')
    with pytest.raises(UserError, match=r"locked by process 4242 on host node-b .*heartbeat 0 s ago"):
        lock.RunLock(run).acquire()
    old = time.time() - lock.STALE_S - 60
    os.utime(run / lock.LOCK_NAME, (old, old))  # its heartbeat stopped (a restarted pod)
    taken = lock.RunLock(run).acquire()
    assert taken.took_over["host"] == "node-b" and "heartbeat stopped 6 min ago" in taken.took_over_because
    taken.release()


def _race_for_the_lock(rank: int, run: Path) -> str:
    try:
        lock.RunLock(run).acquire()
    except UserError:
        return "refused"
    time.sleep(1)  # held while the others try
    return "held"


def test_processes_starting_at_once_get_one_lock(tmp_path, clean_env):
    run = tmp_path / "version_0"
    run.mkdir()
    # real processes, released at the same instant
    outcomes = sorted(in_processes(_race_for_the_lock, 4, run, timeout=60))
    assert outcomes == ["held", "refused", "refused", "refused"]


def test_the_heartbeat_keeps_a_live_lock_fresh(tmp_path, clean_env):
    clean_env.setattr(lock, "HEARTBEAT_S", 0.05)
    held = lock.RunLock(tmp_path).acquire()
    try:
        os.utime(held.path, (1, 1))
        time.sleep(0.5)
        assert time.time() - held.path.stat().st_mtime < 5
    finally:
        held.release()
    assert not held.path.exists()


# -- one trained run, then validate, predict and resume against it ---------------------------
@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained") / "logs"
    ClassifierCLI(args=["fit", *quick_args(tiny_data, root, batch=40), "--trainer.num_sanity_val_steps", "0"])
    return root / "version_0"


def _validate(data: Path, root: Path, ckpt: Path, *extra: str) -> tuple[float, Path, float]:
    cli = ClassifierCLI(args=["validate", *quick_args(data, root, batch=16, width=None),
                              "--ckpt_path", str(ckpt), *extra])
    metrics = cli.trainer.callback_metrics
    return float(metrics["val/acc1"]), Path(cli.trainer.log_dir), float(metrics["val/loss"])


def test_flags_win_over_an_explicit_checkpoint_except_the_network(tiny_data, trained_run, capsys):
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    plain, first, plain_loss = _validate(tiny_data, trained_run.parent, ckpt)  # width 8 comes from the checkpoint
    # the network is not mirror-symmetric, so averaging each image's logits with its mirror's changes the loss (a
    # one-epoch net near chance may predict the same classes either way: its accuracy need not move)
    flipped, second, flipped_loss = _validate(tiny_data, trained_run.parent, ckpt, "--model.test_time_flip", "true")
    assert flipped_loss != pytest.approx(plain_loss, rel=1e-6, abs=0)
    assert first.parent == second.parent == trained_run and first.name.startswith("validate_")
    assert int(second.name.split("_")[1]) == int(first.name.split("_")[1]) + 1  # a folder each
    assert scalars(first, "val/acc1")[-1][1] == pytest.approx(plain)  # each validate has its own event file
    assert scalars(second, "val/acc1")[-1][1] == pytest.approx(flipped)
    with pytest.raises(SystemExit) as exit_:
        main(["validate", *quick_args(tiny_data, trained_run.parent, batch=16, width=32), "--ckpt_path", str(ckpt)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and '--model.arch_kwargs {"width": 32} contradicts' in err
    assert 'built with arch_kwargs {"width": 8}' in err and str(ckpt) in err


@pytest.mark.slow
def test_sigterm_during_validate_leaves_last_ckpt_byte_identical(tiny_data, trained_run):
    last = trained_run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    proc = run_main(["validate", *quick_args(tiny_data, trained_run.parent, batch=16, width=None), "--ckpt_path",
                     str(last), "--trainer.callbacks+=tests.helpers.callbacks.SignalDuringValidation"], check=False)
    out = proc.stdout + proc.stderr
    assert "sending SIGTERM at validation batch 1" in out, out[-3000:]
    assert "SIGTERM: saved" not in out
    assert proc.returncode == 143  # stopped by the signal, not finished
    assert last.read_bytes() == before


def test_two_predicts_keep_both_csvs_and_any_file_name(tiny_data, trained_run, tmp_path, caplog):
    images = tmp_path / "images"
    images.mkdir()
    odd = os.fsdecode(b"caf\xe9 \xff.jpg")  # not UTF-8: Latin-1 bytes, kept as they are
    shutil.copy(tiny_data / "val" / "star" / "00000.jpg", images / odd)
    shutil.copy(tiny_data / "val" / "ring" / "00001.jpg", images / "plain.jpg")
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    outs = []
    for _ in range(2):
        with caplog.at_level("INFO"):
            cli = ClassifierCLI(args=["predict", *quick_args(tiny_data, trained_run.parent, batch=16, width=None),
                                      "--ckpt_path", str(ckpt), "--data.predict_dir", str(images)])
        outs.append(Path(cli.trainer.log_dir) / "predictions.csv")
    assert outs[0].parent != outs[1].parent and all(o.is_file() and o.parent.parent == trained_run for o in outs)
    assert f"predict: 2 images under {images} with {ckpt} -> {outs[1]}" in caplog.text
    with open(outs[0], encoding="utf-8", errors="surrogateescape", newline="") as f:
        paths = sorted(row["path"] for row in csv.DictReader(f))
    assert paths == sorted([str(images / odd), str(images / "plain.jpg")])


def test_a_resumed_fit_says_what_changed(tiny_data, trained_run, tmp_path, caplog):
    root = tmp_path / "copy"
    shutil.copytree(trained_run, root / "version_0")
    ckpt = root / "version_0" / "checkpoints" / "last.ckpt"
    with caplog.at_level("INFO"):
        ClassifierCLI(args=["fit", *quick_args(tiny_data, tmp_path / "elsewhere", batch=40, epochs=2),
                            "--trainer.num_sanity_val_steps", "0", "--model.lr", "0.2", "--ckpt_path", str(ckpt)])
    assert f"resuming {ckpt} with changed settings: model.lr unset -> 0.2, trainer.max_epochs 1 -> 2" in caplog.text
    assert identity.read_run(root / "version_0")["training"]["model"]["lr"] == 0.2
    # logs follow the checkpoint's run, wherever its root is
    assert not (tmp_path / "elsewhere").exists() and len(scalars(root / "version_0", "val/acc1")) == 2


# -- checkpoints written whole, or not at all ------------------------------------------------
KILL_MID_SAVE = """
import os, signal, sys
import pytorch_lightning as pl, torch
from lightning_app.runs.guard import use_atomic_checkpoints

class KillHere:  # pickled after the big tensor: by then a part of the file is written
    def __reduce__(self):
        folder = os.path.dirname(sys.argv[1])
        open(sys.argv[2], "w").write("\\n".join(os.listdir(folder)))
        os.kill(os.getpid(), signal.SIGKILL)

trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
use_atomic_checkpoints(trainer)
trainer.strategy.checkpoint_io.save_checkpoint({"weights": torch.ones(4_000_000), "then": KillHere()}, sys.argv[1])
"""


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_leaves_the_old_file(tmp_path):
    last = _ckpt(tmp_path / "checkpoints" / "last.ckpt")
    before = last.read_bytes()
    seen = tmp_path / "seen.txt"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, str(last), str(seen)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert last.read_bytes() == before
    # the part written so far sat beside the target (one rename away), not in the system temp folder
    assert any(name.startswith(".last.ckpt.") and name.endswith(".tmp") for name in seen.read_text().split("\n"))


# -- the Index cache and seeded augmentation -------------------------------------------------
def test_an_image_added_or_removed_in_a_nested_folder_is_seen_at_the_next_start(tiny_data, tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(tiny_data, root, ignore=shutil.ignore_patterns(".complete"))
    nested = root / "train" / "star" / "batch2"
    nested.mkdir()
    shutil.copy(root / "train" / "star" / "00000.jpg", nested / "a.jpg")
    first = load_index(root, "train")
    assert "train/star/batch2/a.jpg" in dict(first.samples)
    time.sleep(0.01)
    shutil.copy(root / "train" / "star" / "00001.jpg", nested / "b.jpg")
    (root / "train" / "star" / "batch2" / "a.jpg").unlink()
    second = dict(load_index(root, "train").samples)
    assert "train/star/batch2/b.jpg" in second and "train/star/batch2/a.jpg" not in second


def test_seeded_augmentation_does_not_depend_on_other_threads(tiny_data):
    augment = make_train_augment("randaugment", 0.5)
    image = torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8)
    serial = [augment(image, random.Random(seed)) for seed in range(24)]
    stop = threading.Event()

    def draw_from_torch() -> None:  # another thread using torch's shared generator meanwhile
        while not stop.is_set():
            torch.rand(8)

    noise = threading.Thread(target=draw_from_torch)
    noise.start()
    results: dict[int, torch.Tensor] = {}
    try:
        threads = [threading.Thread(target=lambda s=seed: results.__setitem__(s, augment(image, random.Random(s))))
                   for seed in range(24)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        stop.set()
        noise.join()
    assert all(torch.equal(results[s], serial[s]) for s in range(24))
    assert len({bytes(x.flatten().tolist()) for x in serial}) > 12  # and the seeds do choose different ops


# -- an srun --pty shell, and two nodes with their own roots ----------------------------------
@pytest.mark.slow
def test_srun_pty_shell_with_two_devices_makes_one_run_and_resumes(tiny_data, tmp_path):
    # `srun --pty bash` leaves SLURM_PROCID=0 in the shell; Lightning starts the second device's process
    # with LOCAL_RANK=1 (SLURM does not manage it: the job name is bash)
    env = _env(SLURM_JOB_ID="555", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NTASKS="1",
               SLURM_JOB_NAME="bash", MASTER_ADDR="127.0.0.1")
    args = ["fit", *quick_args(tiny_data, tmp_path, batch=40), "--trainer.num_sanity_val_steps", "0",
            "--trainer.strategy", "ddp", "--trainer.devices", "2"]
    rc, out = finish(start_main(args, {**env, "MASTER_PORT": str(free_port())}))
    assert rc == 0, out[-3000:]
    assert [p.name for p in tmp_path.glob("version_*")] == ["version_0"]
    rc, out = finish(start_main([*args, "--ckpt_path", "last"], {**env, "MASTER_PORT": str(free_port())}))
    assert rc == 0 and "--ckpt_path last: resuming" in out, out[-3000:]
    assert [p.name for p in tmp_path.glob("version_*")] == ["version_0"]
    assert len(identity.read_run(tmp_path / "version_0")["attempts"]) == 2


@pytest.mark.slow
def test_nodes_with_different_roots_stop_every_rank_with_one_paragraph(tiny_data, trained_run, tmp_path):
    roots = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(trained_run, roots[0] / "version_0")  # node 0's local disk holds the run; node 1's is empty
    start = time.monotonic()
    procs = start_nodes(lambda r: ["fit", *quick_args(tiny_data, roots[r], batch=40), "--trainer.num_sanity_val_steps",
                                   "0", "--trainer.strategy", "ddp", "--trainer.devices", "1", "--trainer.num_nodes",
                                   "2", "--ckpt_path", "last"],
                        env=_env(FIC_DDP_TIMEOUT_S="120"))
    results = [finish(p, timeout=120) for p in procs]
    assert time.monotonic() - start < 60
    last = roots[0] / "version_0" / "checkpoints" / "last.ckpt"
    for rc, out in results:
        assert rc == 2, out[-3000:]
        assert "resolved --ckpt_path differently" in out and "rank 0 on " in out and f"resumes {last}" in out
        assert "rank 1 on " in out and "found nothing to resume and starts a fresh run" in out
        assert "Traceback" not in out
    assert not roots[1].exists()  # node 1 made no run folder
