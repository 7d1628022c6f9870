"""No silent CPU fallback: a machine with an NVIDIA driver whose torch finds no CUDA device stops in one paragraph.

The decision's inputs (the driver file, nvidia-smi's answer) point at test values; torch is this machine's real
torch, which finds no CUDA device here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_app.devices import DRIVER_FILE_ENV, SMI_ENV, nvidia_driver
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="torch uses this machine's GPU: nothing to refuse")

DRIVER_LINE = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder@U16)\n"


def _fit(env: dict, *extra: str, data, tmp_path) -> subprocess.CompletedProcess:
    args = ["fit", "--data.data_dir", str(data), "--data.batch_size", "40", "--data.num_workers", "0",
            "--trainer.max_epochs", "1", "--model.arch_kwargs", "{width: 8}",
            "--trainer.default_root_dir", str(tmp_path / "logs"), "--trainer.enable_progress_bar", "false", *extra]
    return subprocess.run([sys.executable, "main.py", *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture
def driver_file(tmp_path):
    path = tmp_path / "nvidia-version"
    path.write_text(DRIVER_LINE)
    return str(path)


@pytest.fixture
def answering_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 470.256.02\n")
    smi.chmod(0o755)
    return str(smi)


def test_the_driver_is_read_from_the_kernel_module_or_from_nvidia_smi(driver_file, answering_smi, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv(DRIVER_FILE_ENV, driver_file)
    assert nvidia_driver() == "535.104.05"
    monkeypatch.setenv(DRIVER_FILE_ENV, str(tmp_path / "absent"))
    monkeypatch.setenv(SMI_ENV, answering_smi)
    assert nvidia_driver() == "470.256.02"
    monkeypatch.setenv(SMI_ENV, str(tmp_path / "no-such-command"))
    assert nvidia_driver() is None


@pytest.mark.slow
def test_fit_on_a_gpu_machine_that_torch_cannot_use_stops_and_an_explicit_cpu_trains(driver_file, answering_smi,
                                                                                     tiny_data, tmp_path):
    for driver, env in (("535.104.05", {DRIVER_FILE_ENV: driver_file}),
                        ("470.256.02", {DRIVER_FILE_ENV: str(tmp_path / "absent"), SMI_ENV: answering_smi})):
        refused = _fit(env, data=tiny_data, tmp_path=tmp_path)
        assert refused.returncode == 2, refused.stderr[-3000:]
        text = " ".join(refused.stderr.split())
        assert f"This machine has an NVIDIA GPU (driver {driver}), but torch {torch.__version__} cannot use it" in text
        assert f"built for CUDA {torch.version.cuda}" in text
        assert "install a torch built for this driver" in text and "pass --trainer.accelerator cpu" in text
        assert "Traceback" not in refused.stderr
        assert not (tmp_path / "logs" / "version_0").exists()  # nothing trained, no run left behind
    chosen = _fit({DRIVER_FILE_ENV: driver_file}, "--trainer.accelerator", "cpu", data=tiny_data, tmp_path=tmp_path)
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "Done: best val/acc1" in chosen.stdout


@pytest.mark.slow
def test_a_machine_without_an_nvidia_driver_trains_on_the_cpu_as_before(tiny_data, tmp_path):
    plain = _fit({DRIVER_FILE_ENV: str(tmp_path / "absent"), SMI_ENV: str(tmp_path / "no-such-command")},
                 data=tiny_data, tmp_path=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "This machine has an NVIDIA GPU" not in plain.stderr


def test_bench_on_a_gpu_machine_that_torch_cannot_use_stops_before_measuring(driver_file, tmp_path):
    refused = subprocess.run([sys.executable, "-m", "bench", "memory", "--config", "configs/ddp_amp.yaml",
                              "--out", str(tmp_path / "out")], cwd=REPO,
                             env={**os.environ, DRIVER_FILE_ENV: driver_file}, capture_output=True, text=True,
                             timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "This machine has an NVIDIA GPU (driver 535.104.05)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_bench_gpu_without_a_usable_gpu_says_so_and_stops(tmp_path):
    stopped = subprocess.run([sys.executable, "-m", "bench", "gpu", "--out", str(tmp_path / "out")], cwd=REPO,
                             capture_output=True, text=True, timeout=300, check=False)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "bench gpu: no usable CUDA device here" in stopped.stderr and "--allow-cpu" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_gpu_check_stops_without_a_usable_gpu_and_its_runner_reports_every_part(tmp_path):
    wheels = tmp_path / "wheels"  # this environment has every wheel already: none is needed offline
    wheels.mkdir()
    check = subprocess.run(["bash", "scripts/gpu_check.sh", "--wheels", str(wheels), "--out", str(tmp_path / "out")],
                           cwd=REPO, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                           timeout=300, check=False)
    assert check.returncode == 2, check.stdout[-3000:] + check.stderr[-3000:]
    assert "no usable CUDA device" in check.stdout
    # a line as each step starts: the venv, the wheelhouse (minutes on a small machine), the check itself
    assert check.stdout.index("gpu_check: installing the wheelhouse") < check.stdout.index("gpu_check: the check")
    result = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert result["versions"]["torch"] == torch.__version__ and result["parts"] == []
    # the runner itself, every part on a CPU at a tiny size: each part reported, the rows merged, GPU rows skipped
    from bench.gpu import ema, trace_ab

    rehearsal = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "cpu"),
                                "--rehearse-on-cpu"], cwd=REPO, capture_output=True, text=True, timeout=600,
                               check=False)
    report = json.loads((tmp_path / "cpu" / "gpu-check.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    groups = ("backends", "precision", "flags", "dali", "dp,ddp", "powersgd")
    assert list(parts) == ["gpu mutants", "bench gpu engines,trace,ema,trainer", "pytest -m gpu", "bench gpu ceiling",
                           "bench gpu trainer", "pytest -m gpu clusters", "bench gpu input",
                           *(f"bench gpu {g}" for g in groups)]
    assert parts["pytest -m gpu clusters"]["status"] == "ok"  # its tests skip here
    assert all(p["status"] == "ok" for name, p in parts.items() if name.startswith("bench")), parts
    assert parts["pytest -m gpu"]["status"] == "ok", parts["pytest -m gpu"]  # every gpu test skips here
    assert parts["gpu mutants"]["status"] == "ok" and "nothing to put back" in parts["gpu mutants"]["summary"]
    rows = {(c["group"], c["name"]): c for c in report["checks"]}
    assert rows[("compute ceiling", "compute ceiling")]["status"] == "ok"
    assert all(c["status"] == "skipped" for (group, _), c in rows.items() if group == "trainer")
    assert rows[("input", "VERDICT")]["status"] == "ok"
    assert rows[("trace", "decode gpu, where a batch's time goes")]["status"] == "ok"  # its CPU path's ranges
    assert rows[("trace", "VERDICT")]["status"] == "ok" and rows[("engines", "JPEG call alone")]["status"] == "ok"
    # the decode part's A/B arms (the blocking one in a process of its own) and EMA's two fits ran on the CPU
    assert all(rows[("trace", name)]["status"] == "ok" for name in trace_ab.NAMES)
    assert all(rows[("ema", name)]["status"] == "ok" for name in ema.NAMES)
    assert (tmp_path / "cpu" / "gpu-check.md").read_text().startswith("# GPU check, ")
    assert report["verdict"].startswith("rehearsal on a CPU, not a check") and "passed" not in report["verdict"]
    assert rehearsal.returncode == 0, rehearsal.stdout[-3000:]


def test_a_rerun_of_some_parts_without_a_gpu_exits_2_in_one_paragraph(tmp_path):
    """docs/clusters.md's rerun line, run where torch sees no GPU, into a folder that does not exist yet."""
    rerun = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "new" / "rerun"),
                            "--parts", "gpu,flags"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert rerun.returncode == 2, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "Traceback" not in rerun.stderr and "no usable CUDA device" in rerun.stdout
    # said before the imports that take up to a minute on a small machine
    assert rerun.stdout.startswith("gpu_check: reading the versions"), rerun.stdout[:500]
    assert json.loads((tmp_path / "new" / "rerun" / "gpu-check.json").read_text())["parts"] == []


@pytest.mark.parametrize(("native", "precision", "accelerator", "expected"), [
    (False, "16-mixed", "cpu", "32-true"), (True, "16-mixed", "cpu", "bf16-mixed"), (False, "bf16-mixed", "cpu", None),
    (False, "32-true", "cpu", None), (False, "16-mixed", "gpu", None),
])
def test_16_mixed_on_a_cpu_without_native_bf16_trains_in_32_true(monkeypatch, native, precision, accelerator,
                                                                   expected):
    """Lightning would run 16-mixed on a CPU as bf16-mixed, emulated op by op without AVX512-BF16 or AMX; with them
    the run asks for bf16-mixed itself, so Lightning's warning about its Trainer arguments never comes."""
    import torch

    from lightning_app.devices import cpu_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_precision(precision, accelerator) == expected
