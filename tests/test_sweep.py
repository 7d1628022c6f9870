"""python -m lightning_app.sweep: real Optuna studies of real trials (conv11 width 8 at 16 px on the tiny data)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import run_main
from tests.helpers.event_files import scalars
from tests.helpers.optional import needs_gpus
from tests.helpers.processes import finish, free_port, start_command
from tests.helpers.slurm import fake_scontrol

optuna = pytest.importorskip("optuna")

from lightning_app.sweep.storage import journal_storage  # noqa: E402

SPACE = {"objective": "val/acc1", "direction": "maximize", "pruner": "none", "sampler": {"kind": "random", "seed": 0},
         "model.lr": "loguniform 0.05 0.5", "model.weight_decay": "loguniform 1e-5 1e-3",
         "data.batch_size": "choice [8, 16]"}


def space_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / f"space{len(list(tmp_path.glob('space*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({**SPACE, **changes}, sort_keys=False))
    return path


def trial_flags(data: Path, root: Path, epochs: int = 1) -> list[str]:
    return ["--config", "configs/ddp_amp.yaml", "--data.data_dir", str(data), "--data.num_workers", "0",
            "--data.image_size", "16", "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
            "--model.arch_kwargs", "{width: 8}"]


def start_sweep(space: Path, trials: int, flags: list[str], *extra: str, log: Path | None = None,
                env: dict[str, str] | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return start_command([sys.executable, "-m", "lightning_app.sweep", "--space", str(space), "--trials", str(trials),
                          *extra, *flags], env, log=log, session=True)


def wait_for_last_ckpt(run: Path, proc, timeout: float = 120) -> None:
    """Until the trial in `run` has saved its first last.ckpt (its first epoch done), while the sweep runs."""
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / "last.ckpt").is_file():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "no ckpt"
        time.sleep(0.05)


def load(folder: Path):
    return optuna.load_study(study_name=folder.name, storage=journal_storage(folder))


def states(study) -> list[str]:
    return [t.state.name for t in study.get_trials()]


@pytest.mark.slow
def test_a_sigkilled_sweep_process_is_failed_by_the_other_and_best_yaml_reproduces_the_best(tiny_data, tmp_path):
    """Two sweep processes (two SLURM array tasks) share a 4-trial study. One is SIGKILLed alone in the middle of
    its trial's fit: the trial gets SIGTERM as its parent dies (PDEATHSIG), saves and ends, no orphan; the other
    fails that trial (its owner's pid is dead on this host) and runs the study to 4 complete trials.
    Each trial's config.yaml holds its own sampled settings, and best.yaml trains the best trial again: every run
    is seeded (configs/default.yaml, seed_everything 42) and a CPU fit with num_workers 0 is bit-deterministic, so
    its val/acc1 and val/loss are the best trial's exactly, epoch by epoch, as are its training settings."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    flags = [*trial_flags(tiny_data, root, epochs=2), "--trainer.limit_train_batches", "6"]
    space = space_file(tmp_path)
    logs = [tmp_path / f"sweep{i}.log" for i in range(2)]
    procs = [start_sweep(space, 4, flags, "--study", str(folder), log=log) for log in logs]
    try:
        deadline = time.monotonic() + 120
        while not (saved := sorted(root.glob("version_*/checkpoints/last.ckpt"))):  # epoch 0 done, epoch 1 runs
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no trial got to epoch 1"
            time.sleep(0.02)
        number = json.loads((saved[0].parents[1] / "run.json").read_text())["sweep"]["trial"]
        victim = next(i for i, log in enumerate(logs) if f"sweep: trial {number}: starting" in log.read_text())
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()  # reaped, as its shell or slurmstepd would: a zombie's pid still answers kill(0)
        survivor = procs[1 - victim]
        code, _ = finish(survivor, timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = logs[1 - victim].read_text()
    assert code == 0, out
    study = load(folder)
    trials = study.get_trials()
    assert [t.state.name for t in trials].count("COMPLETE") == 4 and len(trials) == 5, out
    (failed,) = [t for t in trials if t.state.name == "FAIL"]
    assert failed.number == number and failed.user_attrs["owner"]["pid"] == procs[victim].pid, out
    assert list(failed.intermediate_values) == [0], "killed in its epoch 1, after epoch 0's report"
    orphan = (folder / "trials" / f"trial_{number}.log").read_text()
    assert "SIGTERM" in orphan and ": saved " in orphan, f"the dead sweep's trial ran on:\n{orphan[-2000:]}"
    assert {t.user_attrs["owner"]["pid"] for t in trials if t.state.name == "COMPLETE"} == {survivor.pid}
    table = (folder / "trials.md").read_text()
    assert "| fail |" in next(row for row in table.splitlines() if row.startswith(f"| {number} |")), table
    for trial in trials:
        run = Path(trial.user_attrs["run_dir"])
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert (config["model"]["lr"], config["model"]["weight_decay"], config["data"]["init_args"]["batch_size"]) \
            == (trial.params["model.lr"], trial.params["model.weight_decay"], trial.params["data.batch_size"])
        said = json.loads((run / "run.json").read_text())["sweep"]
        assert said == {"folder": str(folder), "trial": trial.number, "state": trial.state.name.lower(),
                        "world_size": 1, **({"value": trial.value} if trial.value is not None else {})}
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    again = tmp_path / "again"
    done = run_main(["fit", "--config", "configs/ddp_amp.yaml", "--config", str(folder / "best.yaml"),
                     "--trainer.default_root_dir", str(again)], env={"OMP_NUM_THREADS": "1"}).stdout
    assert "Done:" in done, done
    assert scalars(again / "version_0", "val/acc1")[-1][1] == pytest.approx(best.value, abs=1e-6), done
    trained = Path(best.user_attrs["run_dir"])  # val/acc1 misses a lost weight decay; the bit-exact loss does not
    assert [scalars(again / "version_0", tag) for tag in ("val/acc1", "val/loss")] == \
        [scalars(trained, tag) for tag in ("val/acc1", "val/loss")], done
    assert json.loads((again / "version_0" / "run.json").read_text())["training"] == \
        json.loads((trained / "run.json").read_text())["training"], "the settings `--ckpt_path last` compares"


@pytest.mark.slow
def test_the_pruner_stops_a_collapsing_trial_after_its_first_epoch(tiny_data, tmp_path):
    """lr 50-100 wrecks the net; a threshold pruner (val/acc1 below 0.5 prunes) must stop it after its first epoch
    of 3 (epochs counted from 1, as the epoch lines count them; optuna's steps from 0)."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    space = space_file(tmp_path, **{"model.lr": "uniform 50 100", "pruner": {"kind": "threshold", "lower": 0.5}})
    code, out = finish(start_sweep(space, 1, trial_flags(tiny_data, root, epochs=3), "--study", str(folder)), 240)
    assert code == 0, out
    (trial,) = load(folder).get_trials()
    assert trial.state.name == "PRUNED", out
    assert list(trial.intermediate_values) == [0] and trial.user_attrs["pruned_at_epoch"] == 1
    log = (folder / "trials" / "trial_0.log").read_text()
    assert "Sweep trial 0: pruned after epoch 1 " in log and "epoch 2/3" not in log, log
    assert "; 1 epoch (pruned by the sweep after epoch 1);" in next(x for x in log.splitlines() if "Done:" in x), log
    said = json.loads((Path(trial.user_attrs["run_dir"]) / "run.json").read_text())["sweep"]
    assert said == {"folder": str(folder), "trial": 0, "state": "pruned", "pruned_at_epoch": 1, "world_size": 1}
    assert "sweep: trial 0: pruned after epoch 1." in out, out


@pytest.mark.slow
def test_a_diverged_trial_is_pruned_and_the_sweep_goes_on(tiny_data, tmp_path):
    """lr 1e6: each trial's loss diverges and its fit exits 3 (lightning_app/callbacks/finite_loss.py). Each is
    PRUNED, not FAIL: three failures in a row would stop the sweep, and a diverged lr is an outcome, not a fault."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    space = space_file(tmp_path, **{"model.lr": "uniform 1e6 2e6"})
    code, out = finish(start_sweep(space, 4, trial_flags(tiny_data, root), "--study", str(folder)), 400)
    assert code == 0, out
    assert states(load(folder)) == ["PRUNED"] * 4, out
    assert out.count("diverged (a non-finite loss, exit status 3): pruned; the sweep goes on.") == 4, out
    run_json = json.loads((root / "version_0" / "run.json").read_text())
    assert run_json["sweep"]["state"] == "pruned" and run_json["sweep"]["diverged"] is True


@pytest.mark.slow
def test_resume_finishes_the_interrupted_trial_from_its_last_checkpoint(tiny_data, tmp_path):
    """Ctrl-C in a terminal (SIGINT to the sweep and its trial, one process group) stops the sweep; the trial saves
    last.ckpt and stays RUNNING. The same command with --resume finishes that trial (same number, same run folder)
    from that checkpoint, where a plain restart would leave it or fail it."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    space = space_file(tmp_path)
    flags = trial_flags(tiny_data, root, epochs=4)
    proc = start_sweep(space, 1, flags, "--study", str(folder))
    wait_for_last_ckpt(root / "version_0", proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, 120)
    assert code == 128 + signal.SIGINT, out
    assert states(load(folder)) == ["RUNNING"], out
    saved = [line for line in (folder / "trials" / "trial_0.log").read_text().splitlines() if ": saved " in line]
    assert saved and "version_0/checkpoints/last.ckpt in epoch" in saved[0], out
    code, out = finish(start_sweep(space, 1, flags, "--study", str(folder), "--resume"), 240)
    assert code == 0, out
    (trial,) = load(folder).get_trials()
    assert trial.state.name == "COMPLETE" and "--resume: finishing interrupted trial(s) [0] first" in out, out
    assert sorted(trial.intermediate_values) == list(range(4))
    record = json.loads((root / "version_0" / "run.json").read_text())
    assert [a["checkpoint"] for a in record["attempts"]] == [None, str(root / "version_0/checkpoints/last.ckpt")]
    assert not (root / "version_1").exists()


@pytest.mark.slow
def test_slurms_warning_signal_saves_the_trial_and_the_sweep_requeues_its_own_task(tiny_data, tmp_path):
    """SLURM's `--signal=SIGUSR1@120` reaches every process of the array task's step: the sweep and its trial. The
    trial, which does not see the SLURM task, saves last.ckpt and stops as on SIGTERM; the sweep then runs
    `scontrol requeue` for its own array task (a recording stand-in: SLURM cannot run here), and the requeued task
    (SLURM_RESTART_COUNT 1, --resume, as scripts/slurm/sweep.sbatch runs it) finishes that trial."""
    root, folder, bin_dir = tmp_path / "logs", tmp_path / "study", fake_scontrol(tmp_path / "bin")
    task = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2", "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "fic-sweep",
            "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    space, flags = space_file(tmp_path), trial_flags(tiny_data, root, epochs=4)
    proc = start_sweep(space, 1, flags, "--study", str(folder), env=task)
    wait_for_last_ckpt(root / "version_0", proc)
    os.killpg(proc.pid, signal.SIGUSR1)
    code, out = finish(proc, 120)
    assert code == 128 + signal.SIGUSR1 and "requeued this SLURM task" in out, out
    assert (bin_dir / "calls.txt").read_text() == "requeue 4240_2\n"
    assert states(load(folder)) == ["RUNNING"], out
    saved = [x for x in (folder / "trials" / "trial_0.log").read_text().splitlines() if ": saved " in x]
    assert saved and "version_0/checkpoints/last.ckpt in epoch" in saved[0], "the trial ended unsaved"
    code, out = finish(start_sweep(space, 1, flags, "--study", str(folder), "--resume",
                                   env={**task, "SLURM_RESTART_COUNT": "1"}), 240)
    assert code == 0 and "--resume: finishing interrupted trial(s) [0] first" in out, out
    assert states(load(folder)) == ["COMPLETE"], out


# -- bad input: one paragraph, exit status 2 -------------------------------------------------------------------
@pytest.mark.parametrize("changes, said", [
    ({"model.lrr": "loguniform 0.01 1"}, ("model.lrr is not a setting of `python main.py fit` with this config "
                                         "(did you mean model.lr?)")),
    ({"model.learning_rate": "loguniform 0.01 1"}, "(did you mean model.lr?)"),  # an alias, not a spelling
    ({"model.lr": "lognormal 0.01 1"}, "model.lr: 'lognormal 0.01 1' names no known distribution"),
    ({"model.lr": "uniform 1 0.5"}, "LOW 1.0 is not below HIGH 0.5"),
    ({"model.lr": "loguniform 0 1"}, "a log scale needs LOW > 0"),
    ({"data.batch_size": "choice 64"}, "choice needs a non-empty list"),
    ({"objective": "val/accuracy"}, ("objective val/accuracy is not a metric the model logs at every validation "
                                    "epoch (val/acc1, val/acc5, val/loss, train/loss)")),
])
def test_a_bad_space_is_one_paragraph_and_exit_2(changes, said, tiny_data, tmp_path, capsys):
    from lightning_app.sweep.__main__ import main

    code = main(["--space", str(space_file(tmp_path, **changes)), "--trials", "1",
                 *trial_flags(tiny_data, tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "logs").exists(), "nothing ran"


def test_a_trial_on_several_nodes_is_refused_in_one_paragraph(tiny_data, tmp_path, capsys):
    from lightning_app.sweep.__main__ import main

    code = main(["--space", str(space_file(tmp_path)), "--trials", "1", *trial_flags(tiny_data, tmp_path / "logs"),
                 "--trainer.num_nodes", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--trainer.num_nodes 2: a sweep's trial runs on the host of its sweep process" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()


def test_a_study_of_another_space_is_refused(tiny_data, tmp_path, capsys):
    from lightning_app.sweep.__main__ import main
    from lightning_app.sweep.space import read_space
    from lightning_app.sweep.storage import open_study

    folder = tmp_path / "study"
    open_study(folder, read_space(space_file(tmp_path)))
    other = space_file(tmp_path, **{"model.lr": "loguniform 0.01 0.2"})
    code = main(["--space", str(other), "--trials", "1", "--study", str(folder), *trial_flags(tiny_data, tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"--study {folder} holds a study of another space" in err, err


def test_without_optuna_the_sweep_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    from lightning_app.sweep.__main__ import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    assert main(["--space", str(space_file(tmp_path)), "--trials", "1"]) == 2
    assert "pip install 'optuna>=4.2'" in capsys.readouterr().err


def test_the_command_line_exits_2_on_bad_input(tmp_path):
    proc = start_command([sys.executable, "-m", "lightning_app.sweep", "--space",
                          str(space_file(tmp_path, **{"model.lr": "uniform 1 1"})), "--trials", "2"])
    code, out = finish(proc, 60)
    assert code == 2 and "sweep: " in out and "Traceback" not in out, out


def test_the_shipped_space_names_settings_the_cli_knows(tiny_data, tmp_path):
    from lightning_app.sweep.__main__ import fit_config
    from lightning_app.sweep.space import locate, read_space

    places = locate(read_space("configs/sweeps/lr_wd.yaml"), fit_config(["--config", "configs/ddp_amp.yaml"]))
    assert places == {"model.lr": ("model", "lr"), "model.weight_decay": ("model", "weight_decay"),
                      "data.batch_size": ("data", "init_args", "batch_size")}


def test_each_worker_gets_an_equal_block_of_adjacent_gpus_and_the_rest_are_named():
    from lightning_app.errors import UserError
    from lightning_app.sweep.placement import split_gpus

    gpus = [str(i) for i in range(8)]
    assert split_gpus(gpus, 2) == (["0,1,2,3", "4,5,6,7"], None)
    shares, unused = split_gpus(gpus, 3)
    assert shares == ["0,1", "2,3", "4,5"] and "GPU(s) 6,7 stay unused" in unused and "--workers 2 or 4" in unused
    assert split_gpus(["4", "7"], 2) == (["4", "7"], None)  # CUDA_VISIBLE_DEVICES's names, in its order
    assert split_gpus(["0", "1"], 1) == ([None], None) and split_gpus([], 3) == ([None] * 3, None)
    with pytest.raises(UserError, match=r"--workers 2 with 1 GPU\(s\) visible \(0\).*--workers 1 .*--share-gpus"):
        split_gpus(["0"], 2)
    assert split_gpus(["0"], 2, share=True) == ([None, None], None)  # meant: both trials see GPU 0
    from lightning_app.sweep.placement import split_cpus

    assert split_cpus(list(range(64)), 4) == [list(range(16 * i, 16 * (i + 1))) for i in range(4)]
    assert split_cpus([0, 1, 2], 2) == [[0], [1]] and split_cpus([0, 1], 1) == [None]
    assert split_cpus([0], 2) == [None, None]


def test_a_trial_sees_neither_the_slurm_task_nor_the_jobs_rendezvous(monkeypatch):
    """What Lightning detects in a trial's environment: its own launcher (LightningEnvironment) on the port the sweep
    gave it, not SLURM's task (world size SLURM_NTASKS, port from the job id) nor an exported MASTER_PORT."""
    from lightning_fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from lightning_app.sweep.placement import Ports, trial_environment

    task = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2", "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "fic-sweep",
            "SLURM_STEP_ID": "0", "MASTER_PORT": "29500", "RANK": "0", "PATH": os.environ["PATH"]}
    monkeypatch.setattr(os, "environ", dict(task))  # what srun gives the sweep's task
    assert SLURMEnvironment.detect(), "the sweep's own process is the SLURM task"
    ports = Ports()
    first, second = ports.take(), ports.take()
    assert first != second
    monkeypatch.setattr(os, "environ", trial_environment(task, "0,1", first))
    assert not SLURMEnvironment.detect()
    assert LightningEnvironment().main_port == first and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and "RANK" not in os.environ
    assert {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")} == \
        {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}  # run.json's job


@pytest.mark.slow
def test_two_trials_at_once_inside_a_slurm_task_each_train_on_their_own_two_ranks(tiny_data, tmp_path):
    """--workers 2, each trial a 2-process DDP fit on CPU, in a sweep started as srun starts a task (SLURM's task
    variables and an exported MASTER_PORT set): both finish, each trial on 2 ranks on a port of its own."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    flags = [*trial_flags(tiny_data, root), "--trainer.devices", "2", "--trainer.strategy", "ddp",
             "--trainer.limit_train_batches", "4"]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "fic-sweep",
             "MASTER_PORT": str(free_port())}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **slurm}
    proc = start_command([sys.executable, "-m", "lightning_app.sweep", "--space", str(space_file(tmp_path)),
                          "--trials", "2", "--workers", "2", "--study", str(folder), *flags], env, session=True)
    code, out = finish(proc, 400)
    assert code == 0, out
    trials = load(folder).get_trials()
    assert states(load(folder)) == ["COMPLETE", "COMPLETE"], out
    starts = [json.loads((Path(t.user_attrs["run_dir"]) / "run.json").read_text()) for t in trials]
    assert [s["sweep"]["world_size"] for s in starts] == [2, 2], out
    assert [s["slurm"]["job_id"] for s in starts] == ["4242", "4242"], "the trials still name their SLURM job"
    logs = [(folder / "trials" / f"trial_{t.number}.log").read_text() for t in trials]
    assert all("Done:" in log for log in logs), logs
    if len(os.sched_getaffinity(0)) >= 2:  # each trial on its own half of the CPUs, and its loader planned for it
        assert all(f"its affinity mask holds {len(os.sched_getaffinity(0)) // 2} of the node's" in log
                   for log in logs), logs


@needs_gpus(1, "trials on a CUDA GPU")
def test_two_trials_at_once_share_one_gpu_each_with_a_rendezvous_of_its_own(tiny_data, tmp_path):
    """--workers 2 --share-gpus on one GPU: both trials train on it at once, each a DDP fit of one rank on NCCL
    whose TCPStore takes a port of its own (the same port twice: the second fails at 'address in use')."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    flags = [*trial_flags(tiny_data, root), "--trainer.accelerator", "gpu", "--trainer.devices", "1",
             "--trainer.strategy", "ddp", "--trainer.precision", "16-mixed", "--trainer.limit_train_batches", "4"]
    proc = start_sweep(space_file(tmp_path), 2, flags, "--workers", "2", "--share-gpus", "--study", str(folder))
    code, out = finish(proc, 300)
    assert code == 0, out
    study = load(folder)
    assert states(study) == ["COMPLETE", "COMPLETE"], out
    logs = [(folder / "trials" / f"trial_{t.number}.log").read_text() for t in study.get_trials()]
    for log in logs:
        assert "GPU available: True (cuda), used: True" in log and "CUDA_VISIBLE_DEVICES: [0]" in log, log[-3000:]
        assert "Done:" in log, log[-3000:]


# -- no trial drawn twice ---------------------------------------------------------------------------------------
DRAW = """
import sys
from pathlib import Path
from lightning_app.sweep import storage
from lightning_app.sweep.space import read_space
space, folder = read_space(sys.argv[1]), Path(sys.argv[2])
session = storage.session()
seed = space.sampler_seed(session)
study = storage.open_study(folder, space, space.make_sampler(seed), space.make_pruner())
storage.record_session(study, session, seed)
for _ in range(4):
    trial = study.ask({k: d.to_optuna() for k, d in space.parameters.items()})
    study.tell(trial, 0.5)
"""


def test_sweep_processes_of_one_seeded_study_each_draw_their_own_trials(tmp_path):
    """What each sweep process does before its first trial, in two processes and then a third on the same study
    (a resumed one): the space's seed is the study's, each process's seed its own, recorded in the journal."""
    space, folder = space_file(tmp_path), tmp_path / "study"
    for _ in range(3):
        code, out = finish(start_command([sys.executable, "-c", DRAW, str(space), str(folder)]), 120)
        assert code == 0, out
    study = load(folder)
    drawn = [tuple(sorted(t.params.items())) for t in study.get_trials()]
    assert len(drawn) == 12 and len(set(drawn)) == 12, drawn
    seeds = [v["seed"] for k, v in study.user_attrs.items() if k.startswith("session:")]
    assert len(seeds) == 3 and len(set(seeds)) == 3 and all(isinstance(s, int) for s in seeds), seeds


def test_a_trial_with_a_finished_trials_settings_is_not_run_again(tmp_path, monkeypatch):
    from lightning_app.sweep import storage
    from lightning_app.sweep.runner import Sweep
    from lightning_app.sweep.space import read_space

    space = read_space(space_file(tmp_path, **{"model.lr": "choice [0.1]", "model.weight_decay": "choice [0.0001]",
                                              "data.batch_size": "choice [8]"}))  # one point: every draw repeats
    folder = tmp_path / "study"
    study = storage.open_study(folder, space, space.make_sampler(), space.make_pruner())
    first = study.ask({k: d.to_optuna() for k, d in space.parameters.items()})
    study.tell(first, 0.75)
    ran = []
    monkeypatch.setattr(Sweep, "run_trial", lambda self, number, params, ckpt: (ran.append(number), self.stop.set()))
    Sweep(folder, space, [], trials=3, stale_s=60.0, study=study)._work()
    trials = load(folder).get_trials()
    assert ran == [] and [t.state.name for t in trials] == ["COMPLETE"] * 3, (ran, trials)
    assert [t.value for t in trials] == [0.75] * 3
    assert [t.user_attrs.get(storage.DUPLICATE_OF) for t in trials[1:]] == [0, 0]
    from lightning_app.sweep.report import table

    assert table(load(folder), space).count("not run: repeats trial 0") == 2


def test_continuing_a_study_with_other_fixed_settings_is_one_paragraph(tiny_data, tmp_path, capsys):
    """The flags a study's trials get are recorded with it: another set would mix trials that do not compare, and
    best.yaml (built from them) would not train the best trial again."""
    from lightning_app.sweep import storage
    from lightning_app.sweep.__main__ import main
    from lightning_app.sweep.space import read_space

    space, folder = space_file(tmp_path), tmp_path / "study"
    first = trial_flags(tiny_data, tmp_path / "logs", epochs=2)
    storage.check_fixed(storage.open_study(folder, read_space(space)), folder, first)  # what its first process did
    code = main(["--space", str(space), "--trials", "1", "--study", str(folder),
                 *trial_flags(tiny_data, tmp_path / "logs", epochs=1)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--study {folder} gives its trials" in err and "--trainer.max_epochs 2" in err, err
    assert "--trainer.max_epochs 1" in err and "another --study" in err, err
    assert not (tmp_path / "logs").exists(), "no trial ran"
    assert load(folder).user_attrs[storage.FIXED] == first


def test_workers_that_would_slow_every_trial_are_said_once():
    from lightning_app.sweep.placement import crowded_workers

    assert crowded_workers(1, 0, 2) is None and crowded_workers(2, 2, 16) is None and crowded_workers(2, 4, 8) is None
    assert "--workers 3 without a GPU" in crowded_workers(3, 0, 2) and "every CPU here (2)" in crowded_workers(3, 0, 2)
    shared = crowded_workers(4, 2, 32, share=True)
    assert "--share-gpus" in shared and "share them" in shared and "--workers 2 gives each" in shared


@pytest.mark.slow
def test_an_objective_the_fit_does_not_log_stops_both_ranks_of_a_trial_in_one_paragraph(tiny_data, tmp_path):
    """A trial's 2-rank fit whose space names a metric it never logs (a module of the user's own; the sweep's own
    check knows ImageClassifier's): rank 0 finds it missing at the first validation's end, and both ranks stop with
    the paragraph, exit 2, none left waiting in the broadcast of the pruning decision."""
    from lightning_app.sweep import storage
    from lightning_app.sweep.pruning import DIR_ENV, SPACE_COPY, TRIAL_ENV
    from lightning_app.sweep.space import read_space

    folder, space = tmp_path / "study", space_file(tmp_path, objective="val/acc9")
    study = storage.open_study(folder, read_space(space))
    trial = study.ask({k: d.to_optuna() for k, d in read_space(space).parameters.items()})
    (folder / SPACE_COPY).write_bytes(space.read_bytes())
    env = {**os.environ, "OMP_NUM_THREADS": "1", DIR_ENV: str(folder), TRIAL_ENV: str(trial.number)}
    proc = start_command([sys.executable, "main.py", "fit", *trial_flags(tiny_data, tmp_path / "logs", epochs=2),
                          "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.limit_train_batches", "2",
                          "--data.batch_size", "8",
                          "--trainer.callbacks+=lightning_app.sweep.pruning.ReportToStudy"], env, session=True)
    code, out = finish(proc, 240)
    said = "The sweep's objective val/acc9"
    assert code == 2 and said in out and "Traceback" not in out, out
    assert "lost" not in out.lower() and "epoch 2/2" not in out, out


@pytest.mark.slow
def test_a_trial_whose_port_was_taken_before_it_listened_starts_again_on_another(tiny_data, tmp_path, capsys):
    """The sweep draws a free port for each trial (placement.Ports), but another process may take it before the
    trial's rank 0 listens on it. That trial failed (and 3 such in a row stopped the sweep); it now starts again on a
    new port, and only its own failures count."""
    import socket

    from lightning_app.sweep import storage
    from lightning_app.sweep.placement import Ports
    from lightning_app.sweep.pruning import SPACE_COPY
    from lightning_app.sweep.runner import Sweep
    from lightning_app.sweep.space import read_space

    class HeldFirst(Ports):
        """Hands out `held` first: the port another process took after the sweep drew it."""

        def __init__(self, held: int) -> None:
            super().__init__()
            self.first, self.handed = held, []

        def take(self) -> int:
            self.handed.append(super().take() if self.handed else self.first)
            return self.handed[-1]

    path, folder = space_file(tmp_path), tmp_path / "study"
    space = read_space(path)
    study = storage.open_study(folder, space, space.make_sampler(), space.make_pruner())
    (folder / SPACE_COPY).write_bytes(path.read_bytes())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = HeldFirst(held.getsockname()[1])
        sweep = Sweep(folder, space, trial_flags(tiny_data, tmp_path / "logs"), trials=1, stale_s=60.0, study=study,
                      ports=ports)
        sweep._work()
    out = capsys.readouterr().out
    assert len(ports.handed) == 2, ports.handed
    assert f"another process took port {ports.handed[0]} before the trial's rank 0 listened on it" in out, out
    assert states(load(folder)) == ["COMPLETE"] and sweep.fails_in_a_row == 0, out


@pytest.mark.slow
def test_slurms_warning_signal_while_a_trial_starts_its_ranks_leaves_no_process_behind(tiny_data, tmp_path):
    """SLURM's warning signal to the task's processes while a 2-rank trial starts: the trial's processes ignore it
    until their fit handles it (main.py), the sweep sends the trial's rank 0 SIGTERM, which ends it unsaved (it had
    nothing to save). Its rank 1, which rank 0 started, waited for it until the rendezvous timeout; it now ends with
    it (strategies/launched_ranks.py). The sweep requeues its task at once, the trial stays RUNNING, and --resume
    runs it from its start."""
    from tests.helpers.processes import process_tree

    root, folder, bin_dir = tmp_path / "logs", tmp_path / "study", fake_scontrol(tmp_path / "bin")
    task = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2", "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "fic-sweep",
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "FIC_DDP_TIMEOUT_S": "200"}
    space, flags = space_file(tmp_path), [*trial_flags(tiny_data, root), "--trainer.devices", "2",
                                          "--trainer.strategy", "ddp", "--trainer.limit_train_batches", "2"]
    proc = start_sweep(space, 1, flags, "--study", str(folder), env=task)
    log, deadline = folder / "trials" / "trial_0.log", time.monotonic() + 180
    while not (log.is_file() and "GLOBAL_RANK: 0" in log.read_text()):  # rank 1 started, in the rendezvous soon
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "no start"
        time.sleep(0.05)
    trial = [p for p in process_tree(proc.pid) if b"main.py" in _cmdline(p)]
    os.killpg(proc.pid, signal.SIGUSR1)
    code, out = finish(proc, 120)
    assert code == 128 + signal.SIGUSR1 and "requeued this SLURM task" in out, out
    deadline = time.monotonic() + 30
    try:
        while [p for p in trial if _cmdline(p)]:
            assert time.monotonic() < deadline, (f"trial processes outlived the sweep: {trial}\n"
                                                 f"{log.read_text()[-3000:]}")
            time.sleep(0.1)
    finally:
        for pid in (p for p in trial if _cmdline(p)):
            os.kill(pid, signal.SIGKILL)
    assert states(load(folder)) == ["RUNNING"], out
    code, out = finish(start_sweep(space, 1, flags, "--study", str(folder), "--resume",
                                   env={**task, "SLURM_RESTART_COUNT": "1"}), 240)
    assert code == 0 and "--resume: finishing interrupted trial(s) [0] first" in out, out
    assert states(load(folder)) == ["COMPLETE"], out


def _cmdline(pid: int) -> bytes:
    """The command line of a live process; b"" once it has ended (or is a zombie, whose cmdline is empty)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
