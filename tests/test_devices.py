"""No silent CPU fallback: a machine with an NVIDIA driver whose torch finds no CUDA device stops in one paragraph.

The decision's inputs (the driver file, nvidia-smi's answer) point at test values; torch is this machine's real
torch, which finds no CUDA device here.
"""
from __future__ import annotations

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
                              "--out", str(tmp_path / "out")], cwd=REPO, env={**os.environ, DRIVER_FILE_ENV: driver_file},
                             capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "This machine has an NVIDIA GPU (driver 535.104.05)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written
