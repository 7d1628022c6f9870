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
from tests.helpers.processes import finish, start_command

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


def start_sweep(space: Path, trials: int, flags: list[str], *extra: str, log: Path | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return start_command([sys.executable, "-m", "lightning_app.sweep", "--space", str(space), "--trials", str(trials),
                          *extra, *flags], env, log=log, session=True)


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
                        **({"value": trial.value} if trial.value is not None else {})}
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
    """lr 50-100 wrecks the net; a threshold pruner (val/acc1 below 0.5 prunes) must stop it at epoch 0 of 3."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    space = space_file(tmp_path, **{"model.lr": "uniform 50 100", "pruner": {"kind": "threshold", "lower": 0.5}})
    code, out = finish(start_sweep(space, 1, trial_flags(tiny_data, root, epochs=3), "--study", str(folder)), 240)
    assert code == 0, out
    (trial,) = load(folder).get_trials()
    assert trial.state.name == "PRUNED", out
    assert list(trial.intermediate_values) == [0] and trial.user_attrs["pruned_at_epoch"] == 0
    log = (folder / "trials" / "trial_0.log").read_text()
    assert "Sweep trial 0: pruned after epoch 0" in log, log
    assert "; 1 epoch (pruned by the sweep after epoch 0);" in next(x for x in log.splitlines() if "Done:" in x), log
    said = json.loads((Path(trial.user_attrs["run_dir"]) / "run.json").read_text())["sweep"]
    assert said == {"folder": str(folder), "trial": 0, "state": "pruned", "pruned_at_epoch": 0}


@pytest.mark.slow
def test_resume_finishes_the_interrupted_trial_from_its_last_checkpoint(tiny_data, tmp_path):
    """Ctrl-C in a terminal (SIGINT to the sweep and its trial, one process group) stops the sweep; the trial saves
    last.ckpt and stays RUNNING. The same command with --resume finishes that trial (same number, same run folder)
    from that checkpoint, where a plain restart would leave it or fail it."""
    root, folder = tmp_path / "logs", tmp_path / "study"
    space = space_file(tmp_path)
    flags = trial_flags(tiny_data, root, epochs=4)
    proc = start_sweep(space, 1, flags, "--study", str(folder))
    deadline = time.monotonic() + 120
    while not (root / "version_0" / "checkpoints" / "last.ckpt").is_file():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "no ckpt"
        time.sleep(0.05)
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


# -- bad input: one paragraph, exit status 2 -------------------------------------------------------------------
@pytest.mark.parametrize("changes, said", [
    ({"model.lrr": "loguniform 0.01 1"}, ("model.lrr is not a setting of `python main.py fit` with this config "
                                         "(did you mean model.lr?)")),
    ({"model.learning_rate": "loguniform 0.01 1"}, "(did you mean model.lr?)"),  # an alias, not a spelling
    ({"model.lr": "lognormal 0.01 1"}, "model.lr: 'lognormal 0.01 1' names no known distribution"),
    ({"model.lr": "uniform 1 0.5"}, "LOW 1.0 is not below HIGH 0.5"),
    ({"model.lr": "loguniform 0 1"}, "a log scale needs LOW > 0"),
    ({"data.batch_size": "choice 64"}, "choice needs a non-empty list"),
])
def test_a_bad_space_is_one_paragraph_and_exit_2(changes, said, tiny_data, tmp_path, capsys):
    from lightning_app.sweep.__main__ import main

    code = main(["--space", str(space_file(tmp_path, **changes)), "--trials", "1",
                 *trial_flags(tiny_data, tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "logs").exists(), "nothing ran"


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


def test_workers_on_a_machine_with_gpus_never_share_one():
    from lightning_app.sweep.runner import split_gpus

    assert split_gpus(["0", "1", "2", "3"], 2) == ["0,2", "1,3"]
    assert split_gpus(["4", "7"], 2) == ["4", "7"]
    assert split_gpus(["0"], 2) == [None, None]  # fewer GPUs than workers: what the sweep sees
    assert split_gpus(["0", "1"], 1) == [None]


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
    from lightning_app.sweep.runner import crowded_workers

    assert crowded_workers(1, 0, 2) is None and crowded_workers(2, 2, 16) is None and crowded_workers(2, 4, 8) is None
    assert "--workers 3 without a GPU" in crowded_workers(3, 0, 2) and "every CPU here (2)" in crowded_workers(3, 0, 2)
    assert "share them" in crowded_workers(4, 2, 32) and "--workers 2 gives each" in crowded_workers(4, 2, 32)
