"""Run folders, `--ckpt_path last`, run locks, one-paragraph errors and logs a person can read."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_app import runs
from lightning_app.cli import ClassifierCLI, main
from lightning_app.errors import UserError
from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main
from tests.helpers.trees import make_tree


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory) -> Path:
    """A second dataset with another class count: a different configuration for the same model."""
    return make_tree(tmp_path_factory.mktemp("three") / "tree", {"a": 16, "b": 16, "c": 16}, size=(32, 32))


def _fit(data: Path, root: Path, *extra: str) -> ClassifierCLI:
    return ClassifierCLI(args=["fit", *quick_args(data, root, batch=16), "--trainer.num_sanity_val_steps", "0", *extra])


def _run_of(cli: ClassifierCLI) -> str:
    return Path(cli.trainer.log_dir).name


@pytest.mark.slow
def test_last_resumes_the_newest_run_of_each_config_in_its_own_folder(tiny_data, three_classes, tmp_path):
    a1 = _fit(tiny_data, tmp_path)             # version_0: 10 classes
    b = _fit(three_classes, tmp_path)          # version_1: 3 classes
    a2 = _fit(tiny_data, tmp_path)             # version_2: 10 classes again, the newest of that config
    assert [_run_of(c) for c in (a1, b, a2)] == ["version_0", "version_1", "version_2"]
    for run in ("version_0", "version_1", "version_2"):
        assert (tmp_path / run / "checkpoints" / "last.ckpt").is_file()
        assert (tmp_path / run / "config.yaml").is_file()
    assert not (tmp_path / "checkpoints").exists()
    steps_a, steps_b = a2.trainer.global_step, b.trainer.global_step

    # `last` compares the training settings (max_epochs included): the same config finds its newest run
    resumed_a = _fit(tiny_data, tmp_path, "--ckpt_path", "last")
    assert _run_of(resumed_a) == "version_2"
    assert resumed_a.trainer.global_step == steps_a  # it had finished its epochs
    assert Path(resumed_a.trainer.checkpoint_callback.dirpath) == (tmp_path / "version_2" / "checkpoints").resolve()
    assert len(runs.read_run(tmp_path / "version_2")["attempts"]) == 2
    # more epochs for a run: name its checkpoint
    last_b = tmp_path / "version_1" / "checkpoints" / "last.ckpt"
    resumed_b = _fit(three_classes, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", str(last_b))
    assert _run_of(resumed_b) == "version_1"
    assert resumed_b.trainer.global_step == 2 * steps_b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0", "version_1", "version_2"]
    # the other runs' checkpoints are untouched
    assert len(list((tmp_path / "version_0" / "checkpoints").glob("*.ckpt"))) == 2

    # validate logs into a subfolder of the checkpoint's run, never a new version_N
    ckpt = tmp_path / "version_1" / "checkpoints" / "last.ckpt"
    val = ClassifierCLI(args=["validate", *quick_args(three_classes, tmp_path, batch=16), "--ckpt_path", str(ckpt)])
    assert Path(val.trainer.log_dir) == tmp_path / "version_1" / "validate_0"  # each validate its own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0", "version_1", "version_2"]


def test_last_without_a_matching_run_starts_fresh_and_a_foreign_checkpoint_is_one_paragraph(
        tiny_data, three_classes, tmp_path, capsys, caplog):
    _fit(three_classes, tmp_path)
    with caplog.at_level("INFO"):
        fresh = _fit(tiny_data, tmp_path, "--ckpt_path", "last")
    assert _run_of(fresh) == "version_1" and fresh.trainer.global_step > 0
    assert "has this config's training settings (the nearest, version_0, differs in data.data_dir" in caplog.text
    assert "starting a fresh run" in caplog.text

    ckpt = tmp_path / "version_0" / "checkpoints" / "last.ckpt"  # 3 classes, into a 10-class config
    with pytest.raises(SystemExit) as exit_:
        main(["validate", *quick_args(tiny_data, tmp_path, batch=16), "--ckpt_path", str(ckpt)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "3 classes" in err and "10 classes" in err and str(ckpt) in err
    assert "Traceback" not in err and "state_dict" not in err and "size mismatch" not in err


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    mine = runs.RunLock(run).acquire()
    with pytest.raises(UserError, match=rf"in use by process {os.getpid()} on "):
        runs.RunLock(run).acquire()
    mine.release()
    assert not (run / runs.LOCK_NAME).exists()

    (run / runs.LOCK_NAME).write_text(f'{{"pid": {_dead_pid()}, "host": "{os.uname().nodename}"}}')
    lock = runs.RunLock(run).acquire()
    assert lock.took_over is not None
    assert runs.RunLock(run).read()["pid"] == os.getpid()
    lock.release()


@pytest.mark.slow
def test_a_second_fit_into_a_live_run_is_refused(tiny_data, tmp_path, capsys):
    _fit(tiny_data, tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "version_0" / runs.LOCK_NAME
        lock.write_text(f'{{"pid": {sleeper.pid}, "host": "{os.uname().nodename}", '
                        f'"started": "now", "command": "python main.py fit"}}')
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *quick_args(tiny_data, tmp_path, batch=16), "--trainer.num_sanity_val_steps", "0",
                  "--ckpt_path", "last"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"in use by process {sleeper.pid}" in err and "Traceback" not in err
    finally:
        sleeper.kill()
        sleeper.wait()
    # the owner is gone now: its stale lock is taken over and the run resumes
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    resumed = _fit(tiny_data, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", str(last))
    assert _run_of(resumed) == "version_0" and resumed.trainer.current_epoch == 2
    assert not lock.exists()  # released at the end


def test_val_image_size_follows_image_size(tiny_data, tmp_path):
    cli = ClassifierCLI(args=[*quick_args(tiny_data, tmp_path), "--data.image_size", "48"], run=False)
    assert cli.datamodule.val_image_size == 48
    cli = ClassifierCLI(args=[*quick_args(tiny_data, tmp_path), "--data.image_size", "48",
                              "--data.val_image_size", "56"], run=False)
    assert cli.datamodule.val_image_size == 56


@pytest.mark.slow
@pytest.mark.parametrize("case", ["data_dir", "arch", "batch", "trainer", "typo"])
def test_user_errors_are_one_paragraph_with_status_2(case, tiny_data, tmp_path):
    args = quick_args(tiny_data, tmp_path)
    expected = {
        "data_dir": ["--data.data_dir", str(tmp_path / "missing")],
        "arch": ["--model.arch", "resnet5"],
        "batch": ["--data.batch_size", "1000"],
        "trainer": ["--trainer.devices", "0"],
        "typo": ["--trainer.max_epochz", "2"],
    }[case]
    proc = run_main(["fit", *args, *expected], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert "Traceback" not in err and "[rank" not in err
    if case == "typo":  # jsonargparse's own message, its error line first
        assert err.splitlines()[0].startswith("error:") and "max_epochz" in err.splitlines()[0]
        return
    assert len(err.splitlines()) == 1, err  # the paragraph alone
    assert {"data_dir": str(tmp_path / "missing"), "arch": "'resnet5'", "batch": "lower --data.batch_size",
            "trainer": "Check --trainer.accelerator, --trainer.devices"}[case] in err
    assert not list(tmp_path.glob("version_*"))  # a run that never started leaves no folder


@pytest.mark.slow
def test_a_fit_logged_to_a_file_has_one_line_per_epoch_and_no_escapes(tiny_data, tmp_path):
    proc = run_main(["fit", *quick_args(tiny_data, tmp_path, epochs=2), "--trainer.enable_progress_bar", "true",
                     "--trainer.limit_train_batches", "2"])
    log = proc.stdout + proc.stderr
    assert "\x1b" not in log and "\r" not in log
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all("train/loss" in line and "val/acc1" in line and "images/s" in line for line in lines)
    # 4 steps, fewer than the 5 the fit's figure leaves out as start-up: it counts them all rather than say n/a
    assert re.search(r"Done: best val/acc1 [0-9.]+; 2 epochs; [0-9,]+ images/s \(1 process\)", log), log[-2000:]
    for noise in ("litlogger", "LeafSpec", "is not supported by the model summary", "exists and is not empty"):
        assert noise not in log


@pytest.mark.slow
def test_bench_loaders_leaves_the_repository_clean(tiny_data):
    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout

    before = status()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "loaders", "--data-dir", str(tiny_data), "--backends",
         "imagefolder", "--batch-size", "8", "--num-workers", "0", "--rounds", "1", "--warm-epochs", "1",
         "--max-batches", "2", "--no-ceilings", "--note", "test run"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert status() == before
    assert "bench/out/" in proc.stdout
    assert "\x1b" not in proc.stdout + proc.stderr and "\r" not in proc.stdout + proc.stderr


def test_a_data_tool_logged_to_a_file_prints_plain_lines(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "datamodules.builtin", "--dst", str(tmp_path / "tiny"),
                           "--preset", "tiny", "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    log = proc.stdout + proc.stderr
    assert "\x1b" not in log and "\r" not in log
    assert "builtin/tiny: 320/320 img (100%)" in proc.stderr


def test_a_lock_from_another_host_is_refused_unless_slurm_requeued_this_job(tmp_path, monkeypatch):
    run = tmp_path / "version_0"
    run.mkdir()
    (run / runs.LOCK_NAME).write_text('{"pid": 4242, "host": "node-a", "started": "then", '
                                      '"slurm_job_id": "77", "slurm_restart_count": 0}')
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(UserError, match=r"locked by process 4242 on host node-a.*delete"):
        runs.RunLock(run).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued job: its previous run is over
    lock = runs.RunLock(run).acquire()
    assert lock.took_over["host"] == "node-a"
    assert runs.RunLock(run).read()["slurm_restart_count"] == 1
    lock.release()


def test_temp_files_of_dead_writers_on_this_host_are_removed_and_said_once(tmp_path):
    from lightning_app.runs.lock import remove_dead_writers_files

    run, host, dead = tmp_path / "version_0", os.uname().nodename, _dead_pid()
    (run / runs.CHECKPOINTS).mkdir(parents=True)
    gone = [run / runs.CHECKPOINTS / f".last.ckpt.{dead}@{host}.tmp",  # killed inside its save
            run / runs.CHECKPOINTS / f".last.ckpt.{dead}.tmp",  # the name before the host was in it
            run / f".run.json.{dead}@{host}.tmp"]
    kept = [run / runs.CHECKPOINTS / f".last.ckpt.{os.getppid()}@{host}.tmp",  # a live writer
            run / runs.CHECKPOINTS / f".last.ckpt.{dead}@elsewhere.tmp",  # another host: cannot be checked
            run / runs.CHECKPOINTS / "last.ckpt"]
    for path in gone + kept:
        path.write_bytes(b"x" * 1000)
    said = remove_dead_writers_files(run, previous_owner_host=host)
    assert [p for p in gone + kept if p.exists()] == kept
    assert said.startswith("removed 3 temp files of writes whose process ended before renaming them into place")
    assert f".last.ckpt.{dead}@{host}.tmp (pid {dead})" in said
    assert remove_dead_writers_files(run, previous_owner_host=host) is None  # said once
    assert remove_dead_writers_files(run, previous_owner_host="elsewhere") is None


@pytest.mark.slow
def test_a_resume_removes_the_temp_checkpoints_its_killed_attempt_left(tiny_data, tmp_path):
    args = ["fit", *quick_args(tiny_data, tmp_path, batch=16), "--trainer.num_sanity_val_steps", "0"]
    run_main(args)
    run, host, dead = tmp_path / "version_0", os.uname().nodename, _dead_pid()
    last = run / runs.CHECKPOINTS / "last.ckpt"
    complete = run / runs.CHECKPOINTS / f".last.ckpt.{dead}@{host}.tmp"  # a whole save, newer than last.ckpt
    complete.write_bytes(last.read_bytes())
    (run / runs.LOCK_NAME).write_text(f'{{"pid": {dead}, "host": "{host}"}}')  # its writer held the lock
    proc = run_main([*args, "--ckpt_path", "last"])  # a finished run: resumed, it trains no further
    assert not complete.exists()
    assert proc.stdout.count("removed 1 temp file of writes whose process ended") == 1, proc.stdout[-3000:]
    assert f"--ckpt_path last: resuming {last}" in proc.stdout


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_run_root_that_cannot_be_written_is_one_paragraph_and_exit_2(fault, tiny_data, tmp_path, capsys):
    from tests.helpers.filesystems import fill, small_filesystem

    with small_filesystem(tmp_path / "disk", read_only=fault == "read-only") as disk:
        if fault == "full":
            fill(disk)
        root = disk / "logs"
        if fault == "full":
            root.mkdir()
        with pytest.raises(SystemExit) as stop:
            main(["fit", *quick_args(tiny_data, root, batch=16)])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
        said = "it is on a read-only filesystem" if fault == "read-only" else "its filesystem is full ("
        assert err.startswith(f"Cannot start the run under {root}: writing ") and said in err, err
        assert "--trainer.default_root_dir DIR" in err
        assert not list(root.glob("version_*"))  # nothing half-made


def test_resume_or_fail_stops_a_fit_that_finds_no_run_to_resume(tiny_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", *quick_args(tiny_data, tmp_path, batch=16), "--ckpt_path", "last", "--resume_or_fail", "true"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"--ckpt_path last: no run under {tmp_path} has this config's training settings. "
                          "--resume_or_fail true: ") and "starting a fresh run" not in err, err
    assert not list(tmp_path.iterdir())  # no fresh run


def test_runs_loads_no_torch_and_imports_nothing_from_callbacks():
    """runs/ is file logic (folders, run.json, locks, checkpoints' bytes): a script that only resolves or inspects
    runs (scripts/chaos_requeue.py) must not pay for torch and Lightning, and no arrow runs back up to callbacks/
    (the result file's name, predictions.csv, lives in runs/folders.py)."""
    from tests.helpers.imports import import_graph

    code = ("import sys, lightning_app.runs; "
            "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning_fabric') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    upward = {m: sorted(t for t in targets if t.startswith("lightning_app.callbacks"))
              for m, targets in import_graph(("lightning_app",)).items() if m.startswith("lightning_app.runs")}
    assert not {m: targets for m, targets in upward.items() if targets}


def test_planning_a_run_enters_each_file_of_runs_once_but_the_folders_leaf():
    """`--ckpt_path` is resolved to a plain answer, then the folder is planned from it: a reader follows it top to
    bottom, each file of runs/ entered once (tests/helpers/runs_trace.py). folders.py, the leaf of paths and atomic
    writes, is entered once by each step that touches the disk: find runs, make a folder, lock it, write run.json."""
    from tests.helpers.runs_trace import cases, trace

    for case in cases():
        counts, order = trace(case)
        assert {"plan", "launch", "resolve", "identity"} <= set(counts), (case, order)
        assert not {name: n for name, n in counts.items() if n > 1 and name != "folders"}, (case, order)
        assert counts["folders"] <= 4, (case, order)
