"""Every command in README.md and docs/*.md runs as written, in a short form.

The commands of every ```bash block run in document order (README first, then docs/ by name) in a
scratch folder that looks like a fresh clone (the code linked in, `logs/` and outputs its own), so a
later command finds what an earlier one made (`logs/version_0/...`, the packed LMDB). Placeholders
(`/path/to/imagenet`, `/data/...`) become the tiny built-in tree; `SHRINK` cuts the work (a 1-epoch,
2-batch fit, 200 files to scan). Each command matches one rule of `RULES`, which says how it runs:

- run: for real, as a user types it (plus SHORT_* flags for main.py);
- parse: `main.py ... --print_config` in-process, or a benchmark's argparse: every flag and config
  file must exist; for what cannot run here (ResNet-50 at 224 px, ImageNet weights, a second node);
- dry-run: the launch scripts with DRY_RUN=1; the main.py command they print (netsim: node 0's) is parsed as above;
- script: a shell script run as written (netsim's `down`, which finds nothing to remove here).

A command no rule matches fails the test: a new command in the docs needs a rule saying how it runs.

A ```bash script block (a walk-through with a server in the background and exported variables) is not
split into commands: it runs whole, as written, in bash -e (`test_script_blocks_run_as_written`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.processes import free_port

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE = ["main.py", "lightning_app", "datamodules", "models", "bench", "netsim", "configs", "scripts", "constraints",
        "requirements.txt", "requirements-dev.txt", "requirements-dali-cu13.txt", "requirements-dali-cu12.txt"]
SHORT_FIT = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
             "--data.builtin", "tiny", "--data.batch_size", "32", "--data.num_workers", "0",
             "--trainer.enable_progress_bar", "false"]
SHORT_EVAL = ["--trainer.limit_val_batches", "2", "--trainer.limit_predict_batches", "2", "--data.builtin", "tiny",
              "--data.batch_size", "32", "--data.num_workers", "0", "--trainer.enable_progress_bar", "false"]
# a sweep's trials: the built-in small data (lr_wd.yaml's batches reach 256; tiny has 240 images), 2 steps each
SHORT_SWEEP = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
               "--data.num_workers", "0", "--trainer.enable_progress_bar", "false"]
SHRINK = [(r"--files \d+", "--files 200"), (r"--preset small", "--preset tiny"), (r"--workers \d+", "--workers 2"),
          (r" --drop-caches", ""), (r"--trials \d+", "--trials 2")]
# (pattern, mode, why): the first that matches the whole command wins
RULES = [
    (r"pip install -r (\S+) && (.*)", "install", "CI installs the requirements; the rest runs"),
    (r"python -m pytest.*", "skip", "this is the suite itself"),
    (r"(\w+=\S+ )+python -m pytest.*", "skip", "the suite itself, pointed at a folder the test data does not have"),
    (r"git clone --depth 1 https://github\.com/\S+ \S+", "skip", "downloads from GitHub: tests reach no other host"),
    (r"python main\.py fit .*(resnet50|imagenet|recipes/|dali\.yaml|--model\.weights).*", "parse",
     "ResNet-50 / DALI / pretrained weights: too slow or absent on a CPU test machine (their own tests run them)"),
    (r"python main\.py fit .*s3://.*", "parse",
     "object storage: tests/test_streaming.py trains from a real S3 endpoint"),
    (r"python -m datamodules\.shards .*s3://.*", "parse",
     "object storage: tests/test_streaming.py packs to a real S3 endpoint (moto's ThreadedMotoServer)"),
    (r"export (AWS_\w+=\S+ ?)+", "skip", "a store's endpoint and credentials: tests/test_streaming.py sets its own"),
    (r"python main\.py .*--print_config.*", "run", ""),
    (r"python main\.py (fit|validate|test|predict) .*", "run", ""),
    (r"(\w+=\S+ )+python main\.py .*", "parse", "a second node at another address cannot start here"),
    (r"(\w+=\S+ )*scripts/torchrun\.sh .*", "dry-run", "torchrun across machines"),
    (r"scripts/netsim\.sh run .*", "dry-run", "two network namespaces need root: each node's command is parsed"),
    (r"scripts/netsim\.sh down", "script", "removes only pairs whose run is gone: none here"),
    (r"scripts/wheelhouse\.sh \S+( --python [\d.]+)?", "skip",
     "downloads from the package index: CI's second end runs it as written (.ci/run)"),
    (r"sbatch scripts/slurm/train\.sbatch .*", "dry-run", "no SLURM here"),
    (r"sbatch --array=\S+ scripts/slurm/sweep\.sbatch .*", "dry-run", "no SLURM here"),
    (r"python -m lightning_app\.sweep .*", "run", ""),
    (r"srun .* python -m lightning_app\.sweep .*", "parse", "a sweep on a SLURM GPU node: its trials' flags parse"),
    (r"python -m bench(\.progressive)? .*", "parse",
     "benchmarks time the machine (tests/test_bench.py runs them small)"),
    (r"python -m (datamodules\.\w+|bench\.scanbench|lightning_app\.export)( .*)?", "run", ""),
    (r"tensorboard --logdir (\S+)", "tensorboard", ""),
    (r"python -m lightning_app\.mlflow_runs( \S+)?", "run", ""),
]


def doc_commands() -> list[tuple[str, str]]:
    """(file name, command) for every command line of every bash block, continuations joined, comments cut."""
    out = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append((path.name, re.sub(r"\s+", " ", line)))
    return out


def test_every_doc_command_has_a_rule():
    unmatched = [c for _, c in doc_commands() if not any(re.fullmatch(p, c) for p, _, _ in RULES)]
    assert not unmatched, f"commands in the docs with no rule in tests/test_docs.py: {unmatched}"


@pytest.fixture
def clone(tmp_path, tiny_data) -> tuple[Path, dict[str, str]]:
    work = tmp_path / "clone"
    work.mkdir()
    for name in CODE:
        (work / name).symlink_to(REPO / name)
    places = {
        "/data/imagenet.lmdb": str(work / "imagenet.lmdb"), "/data/imagenet-160": str(work / "imagenet-160"),
        "/path/to/root": str(tiny_data), "/path/to/imagenet": str(tiny_data), "/data/imagenet": str(tiny_data),
        "/data/my_classes": str(tiny_data), "path/to/images": str(tiny_data / "val"),
        "/tmp/scan-tree": str(work / "scan-tree"), "/path/to/300-images": str(tiny_data),
    }
    return work, places


def _concrete(command: str, places: dict[str, str]) -> str:
    for placeholder in sorted(places, key=len, reverse=True):
        command = command.replace(placeholder, places[placeholder])
    for pattern, repl in SHRINK:
        command = re.sub(pattern, repl, command)
    return command


def _run(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (f"{shlex.join(argv)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def _parse_main(args: list[str], cwd: Path, monkeypatch) -> None:
    """`python main.py ARGS --print_config`, in-process: parses every flag and reads every config file."""
    from lightning_app.cli import main

    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exit_:
        main(args + ["--print_config"])
    assert exit_.value.code in (0, None), f"main.py {shlex.join(args)} does not parse"


def _parse_bench(argv: list[str]) -> None:
    from bench.__main__ import build_parser
    from bench.progressive import build_parser as progressive_parser
    from datamodules.shards.pack import build_parser as shards_parser

    parsers = {"bench.progressive": progressive_parser, "datamodules.shards": shards_parser}
    parsers.get(argv[0], build_parser)().parse_args(argv[1:])


def _sweep_trial_args(command: str) -> list[str]:
    """`fit` and what a sweep's command passes to each trial (lightning_app/sweep/__main__.py)."""
    from lightning_app.sweep.__main__ import build_parser, split_pass_through

    words = shlex.split(command)
    args, extra = build_parser().parse_known_args(words[words.index("lightning_app.sweep") + 1:])
    return ["fit", *(w for c in args.config for w in ("--config", c)), *split_pass_through(extra)]


def _main_args(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("main.py") + 1:]


@pytest.mark.slow
def test_every_doc_command_runs_as_written_in_short_form(clone, monkeypatch, capsys):
    work, places = clone
    ran = []
    for doc, written in doc_commands():
        command = _concrete(written, places)
        pattern, mode, _ = next(r for r in RULES if re.fullmatch(r[0], written))
        if mode == "install":
            requirements, command = re.fullmatch(pattern, command).groups()
            assert (REPO / requirements).is_file(), f"{doc}: {requirements} is missing"
            pattern, mode, _ = next(r for r in RULES if re.fullmatch(r[0], command))
        if mode == "skip":
            continue
        words = shlex.split(command)
        if mode == "run" and words[:2] == ["python", "main.py"]:
            short = [] if "--print_config" in words else (SHORT_FIT if words[2] == "fit" else SHORT_EVAL)
            _run([sys.executable, *words[1:], *short], work)
        elif mode == "run" and words[1:3] == ["-m", "lightning_app.sweep"]:
            _run([sys.executable, *words[1:], *SHORT_SWEEP], work)
        elif mode == "run":
            _run([sys.executable, *words[1:]], work)
        elif mode == "parse" and "lightning_app.sweep" in words:
            _parse_main(_sweep_trial_args(command), work, monkeypatch)
        elif mode == "parse" and "main.py" in words:
            _parse_main(_main_args(command), work, monkeypatch)
        elif mode == "parse":
            _parse_bench(words[2:])
        elif mode == "dry-run":
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"\w+=\S+", w))
            script = next(w for w in words if w.startswith("scripts/"))
            args = words[words.index(script) + 1:]
            slurm = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "8",
                     "SLURM_SUBMIT_DIR": str(work)}
            printed = _run(["bash", script, *args], work,
                           {**env, **slurm, "DRY_RUN": "1", "PYTHON": sys.executable}).stdout
            first = printed.strip().splitlines()[0]  # netsim: a line per node
            _parse_main(_sweep_trial_args(first) if "lightning_app.sweep" in first else _main_args(first), work,
                        monkeypatch)
        elif mode == "script":
            _run(["bash", *words], work, {"PYTHON": sys.executable})
        elif mode == "tensorboard":
            logdir = work / re.fullmatch(pattern, command).group(1)
            tensorboard = shutil.which("tensorboard") or str(Path(sys.executable).with_name("tensorboard"))
            listing = _run([tensorboard, "--inspect", "--logdir", str(logdir)], work).stdout
            assert "val/acc1" in listing, f"{doc}: tensorboard finds no val/acc1 under {logdir}"
        ran.append(written)
        capsys.readouterr()  # print_config's YAML: not needed once parsed
    assert len(ran) >= 25, ran


def doc_scripts() -> list[tuple[str, str]]:
    """(file name, text) of every ```bash script block, in document order."""
    return [(path.name, block) for path in DOCS for block in re.findall(r"```bash script\n(.*?)```", path.read_text(),
                                                                        re.DOTALL)]


@pytest.mark.slow
@pytest.mark.parametrize("doc, script", [pytest.param(d, s, id=f"{d}-{i}") for i, (d, s) in enumerate(doc_scripts())])
def test_script_blocks_run_as_written(doc, script, clone, tmp_path):
    """The block in a session of its own, port 9000 made a free port: the block's own last line must stop what
    it started (the port answers no more), and the whole session is killed after it on every path."""
    work, _ = clone
    port = free_port()
    script = re.sub(r"\b9000\b", str(port), script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only what the block exports
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", HOME=str(tmp_path / "home"),
               PYTHONUNBUFFERED="1")
    log = tmp_path / "script.log"
    with open(log, "w") as out:  # a file, not a pipe: a server left running would hold a pipe open
        proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=400)
        assert proc.returncode == 0, f"{doc}'s script block exited {proc.returncode}:\n{log.read_text()[-5000:]}"
        with pytest.raises(ConnectionRefusedError):  # stopped by the block itself
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
