"""What a first GPU run would break, checked on a CPU: dp + compile refused, compile + DDP warned, the launch
scripts' final argument order, and a CPU run that never touches CUDA."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import warnings

import pytest
from pytorch_lightning.plugins.environments import LightningEnvironment

from lightning_app.cli import ClassifierCLI
from lightning_app.strategies import DP_COMPILE_MESSAGE, ClusterDDPStrategy, check_compile
from tests.helpers import REPO
from tests.helpers.cli import quick_args
from tests.helpers.optional import needs_dali, needs_gpus


def test_dp_with_compile_is_refused_with_its_message(tiny_data, tmp_path):
    args = ["fit", "--config", "configs/dp.yaml", *quick_args(tiny_data, tmp_path), "--model.compile", "true"]
    with pytest.raises(ValueError, match="cannot be combined with --trainer.strategy dp") as err:
        ClassifierCLI(args=args)
    assert "--model.compile false" in str(err.value) and "ddp" in str(err.value)
    assert str(err.value) == DP_COMPILE_MESSAGE


def test_compile_with_ddp_is_not_warned_about():
    # the backbone compiles inside DistributedDataParallel.forward, where dynamo's DDPOptimizer splits the graph at
    # the buckets (torch/_dynamo/backends/distributed.py): the overlap stays, and there is nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for processes in (1, 2):
            environment = LightningEnvironment()
            environment.set_world_size(processes)
            check_compile(ClusterDDPStrategy(cluster_environment=environment))


# ---------------------------------------------------------------------------- launch scripts

def _dry_run(script: str, args: list[str], env: dict[str, str]) -> list[str]:
    proc = subprocess.run(["bash", script, *args], cwd=REPO, env={**os.environ, **env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=60, check=True)
    return shlex.split(proc.stdout)


def _main_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("main.py") + 1:]


@pytest.mark.parametrize("script,env", [
    ("scripts/torchrun.sh", {"GPUS": "4", "NNODES": "2", "NODE_RANK": "1"}),
    ("scripts/slurm/train.sbatch", {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
                                    "SLURM_CPUS_PER_TASK": "8"}),
])
def test_launch_scripts_apply_their_layout_after_the_users_config(script, env, tiny_data, tmp_path):
    user = ["--config", "configs/ddp_amp.yaml", *quick_args(tiny_data, tmp_path)[:-2]]  # devices: auto inside
    cmd = _dry_run(script, user, {**env, "SLURM_SUBMIT_DIR": str(tmp_path)})  # no last.ckpt there: no resume flag
    args = _main_args(cmd)
    assert args[0] == "fit" and args[1:1 + len(user)] == user  # the user's "$@" first, untouched
    assert args[1 + len(user):] == ["--trainer.num_nodes", "2", "--trainer.devices", "4"]  # the layout only
    if "srun" in cmd[0]:
        assert cmd[:3] == ["srun", "--cpus-per-task", "8"]  # SLURM >= 22.05 does not pass it on
    # and jsonargparse, applying left to right, ends with the script's layout, not the config's `auto`
    cli = ClassifierCLI(args=args[1:], run=False)
    assert str(cli.config["trainer"]["devices"]) == "4" and cli.config["trainer"]["num_nodes"] == 2
    assert cli.trainer.num_devices == 4 and cli.trainer.num_nodes == 2
    # the config's
    assert cli.config["trainer"]["strategy"]["class_path"] == "lightning_app.strategies.ddp.ClusterDDPStrategy"


# ---------------------------------------------------------------------------- bench gpu on a CPU

@pytest.mark.slow
def test_bench_gpu_on_cpu_skips_every_gpu_row_and_runs_the_ceiling_and_shares(tiny_data, tmp_path):
    import json

    import torch

    from bench.__main__ import main

    out = tmp_path / "out"
    rc = main(["gpu", "--allow-cpu", "--data-dir", str(tiny_data), "--arch", "conv11", "--image-size", "32",
               "--batch-size", "8",
               "--steps", "2", "--warmup", "1", "--num-workers", "0",
               "--backends", "imagefolder,dali-cpu", "--out", str(out), "--machine", "test",
               # input: test_bench_gpu_input.py; engines, trace: test_bench_gpu_trace.py; ema: test_gpu_check.py
               "--groups", "ceiling,trainer,backends,dali,precision,flags,dp,ddp,powersgd"])
    assert rc == 0
    data = json.loads((out / "test.gpu.json").read_text())
    md = (out / "test.gpu.md").read_text()
    assert (out / "test.gpu.png").read_bytes()[:4] == b"\x89PNG"
    checks = {c["name"]: c for c in data["checks"]}
    ceiling = checks["compute ceiling"]
    assert ceiling["status"] == "ok" and ceiling["images_s"] > 0 and "conv11 at 32 px" in ceiling["verdict"]
    for name in ("ImageFolder", "DALI CPU"):
        row = checks[name]
        assert row["status"] == "ok" and row["images_s"] > 0, row
        assert row["extra"]["share"] == pytest.approx(row["images_s"] / ceiling["images_s"])
    assert checks["LMDB"]["verdict"] == "not selected (--backends)"
    decoded = checks["ImageFolder, decode gpu"]  # the workers read, the training device (here the CPU) decodes
    assert decoded["status"] == "ok" and decoded["images_s"] > 0 and "--data.decode gpu" in decoded["verdict"]
    assert decoded["extra"]["decoded"]["train"]["device"] > 0
    assert {c["status"] for c in data["checks"] if c["group"] == "input"} == {"skipped"}
    not_asked = ("input", "engines", "trace", "ema")
    assert {c["verdict"] for c in data["checks"] if c["group"] in not_asked} == {"not selected (--groups)"}
    gpu_rows = [c for c in data["checks"] if c["group"] not in ("compute ceiling", "backend", *not_asked)]
    assert {c["group"] for c in gpu_rows} == {"trainer", "DALI mixed", "precision", "speed flag", "dp", "DDP",
                                             "PowerSGD"}
    if not torch.cuda.is_available():
        assert all(c["status"] == "skipped" and "no CUDA GPU" in c["verdict"] for c in gpu_rows)
        assert "needs a CUDA GPU" in checks["DALI GPU (mixed)"]["verdict"] or \
            checks["DALI GPU (mixed)"]["verdict"] == "not selected (--backends)"
        assert "none (every GPU row is skipped)" in md
    else:  # on a GPU: no row fails, and a row skipped names what this GPU (or torch build) lacks
        assert [c for c in gpu_rows if c["status"] == "FAIL"] == []
        assert all(c["status"] == "ok" or (c["verdict"] and "no CUDA GPU" not in c["verdict"]) for c in gpu_rows)
        ran = {c["group"] for c in gpu_rows if c["status"] == "ok"}
        assert {"trainer", "precision", "speed flag"} <= ran, gpu_rows
        if torch.cuda.device_count() >= 2:
            assert {"dp", "DDP"} <= ran, gpu_rows
        assert "none (every GPU row is skipped)" not in md
    assert "Share of the compute ceiling" in md and "| compile |" in md and "- Versions: python" in md


@needs_dali
def test_spawned_dali_lmdb_worker_does_not_import_lightning(tiny_data, tmp_path):
    """What a spawned DALI worker runs: unpickle the source, read one sample. Lightning stays out of it."""
    db = tmp_path / "t.lmdb"
    subprocess.run([sys.executable, "-m", "datamodules.lmdb", "--src", str(tiny_data), "--dst", str(db)],
                   cwd=REPO, capture_output=True, timeout=300, check=True)
    code = (
        "import pickle, sys\n"
        "from nvidia.dali.types import SampleInfo\n"
        "from datamodules.dali.pipelines import LMDBSampleSource\n"
        f"src = pickle.loads(pickle.dumps(LMDBSampleSource({str(db)!r}, 'train', 240, 0, 1, 8, 30, True, 0)))\n"
        "data, index, label = src(SampleInfo(0, 0, 0, 0))\n"
        "assert data[:2].tolist() == [0xFF, 0xD8], data[:2]\n"
        "print('lightning imported:', 'pytorch_lightning' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True)
    assert "lightning imported: False" in proc.stdout


@pytest.mark.slow
def test_bench_ddp_check_logic_on_gloo():
    """`bench gpu`'s NCCL check, run over gloo on 2 CPU processes: a DDP step equals one process's step."""
    from bench.gpu.checks import Workload
    from bench.gpu.parallel import ddp_check

    w = Workload(arch="conv11", image_size=32, batch_size=8, device="cpu")
    check = ddp_check(w, mb=1, processes=2, backend="gloo")
    assert check.status == "ok", check.verdict
    assert check.extra["grad_rel_diff"] < 1e-5 and check.extra["busbw_gb_s"] > 0
    assert check.name == "GLOO DDP x2"


@needs_gpus(1, "a CPU run beside it")
@pytest.mark.parametrize("data", [pytest.param("configs/data/dali.yaml", marks=needs_dali),
                                  "configs/data/imagefolder.yaml"])
def test_cpu_run_on_a_gpu_machine_creates_no_cuda_context(tiny_data, tmp_path, data):
    """--trainer.accelerator cpu on a GPU box: no synchronize, no pinned memory, DALI auto on the CPU."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"  # absolute: jsonargparse enters config dirs
        "import torch\n"
        "from lightning_app.cli import ClassifierCLI\n"
        f"ClassifierCLI(args=['fit', '--config', {data!r}, *{quick_args(tiny_data, tmp_path)!r},"
        " '--trainer.limit_train_batches', '2', '--trainer.limit_val_batches', '1'])\n"
        "print('cuda initialized:', torch.cuda.is_initialized())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cuda initialized: False" in proc.stdout, proc.stdout[-3000:]


def test_a_cpu_run_creates_no_cuda_context_where_torch_sees_a_gpu(tiny_data, tmp_path):
    """The same CPU fit where torch is made to see one GPU (its device count) and any CUDA initialization raises
    with its stack: on the H200, Lightning's isolate_rng() around the sanity check made a context on GPU 0."""
    code = (
        f"import sys, traceback; sys.path.insert(0, {str(REPO)!r})\n"
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch._C._cuda_getDeviceCount = lambda: 1\n"
        "def init():\n"
        "    raise RuntimeError('CUDA initialized from:\\n' + ''.join(traceback.format_stack()))\n"
        "torch._C._cuda_init = init\n"
        "from lightning_app.cli import ClassifierCLI\n"
        f"ClassifierCLI(args=['fit', '--config', 'configs/data/imagefolder.yaml', *{quick_args(tiny_data, tmp_path)!r},"
        " '--trainer.limit_train_batches', '2', '--trainer.limit_val_batches', '1'])\n"
        "print('cuda initialized:', torch.cuda.is_initialized())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cuda initialized: False" in proc.stdout


@pytest.mark.slow
def test_bench_powersgd_rows_run_the_hooks_path_on_a_group_of_one():
    """`bench gpu`'s PowerSGD rows on a CPU (gloo, one process): each case trains, and the PowerSGD rows are
    a share of the step without a hook."""
    from bench.gpu.checks import Workload
    from bench.gpu.powersgd import powersgd_rows

    w = Workload(arch="conv11", image_size=32, batch_size=8, warmup=3, steps=2, device="cpu")
    rows = powersgd_rows(w, backend="gloo")
    assert [r.name for r in rows] == ["no hook", "PowerSGD, 25 MB buckets", "PowerSGD, 100 MB buckets"]
    assert all(r.status == "ok" and r.images_s > 0 for r in rows), rows
    assert "x the step without a hook" in rows[1].verdict and "100 MB buckets" in rows[2].verdict
