"""No silent CPU fallback: on a machine with an NVIDIA GPU that this torch cannot use, stop in one paragraph.

A torch built for a newer CUDA than the driver supports sees no device (`torch.cuda.is_available()` is False),
and Lightning's `accelerator: auto` then trains on the CPU with one "GPU available: False" line. The machine
has a GPU when the NVIDIA kernel module answers (/proc/driver/nvidia/version) or `nvidia-smi` does; whether
torch can use it is Lightning's own count of CUDA devices, the one `auto` decides by. Nothing here touches
CUDA on a machine without an NVIDIA driver.

Tests point the two inputs at test values: FIC_NVIDIA_DRIVER_FILE (the driver file) and FIC_NVIDIA_SMI (the
nvidia-smi command).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from lightning_app.errors import UserError

DRIVER_FILE = "/proc/driver/nvidia/version"
DRIVER_FILE_ENV = "FIC_NVIDIA_DRIVER_FILE"
SMI_ENV = "FIC_NVIDIA_SMI"
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  ..." and the open module's
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build ..."
_DRIVER_LINE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version when this machine has one ("present" when its version cannot be read), else None."""
    try:
        text = Path(os.environ.get(DRIVER_FILE_ENV, DRIVER_FILE)).read_text()
    except OSError:
        text = None
    if text is not None:
        found = _DRIVER_LINE.search(text)
        return found.group(1) if found else "present"
    smi = shutil.which(os.environ.get(SMI_ENV, "nvidia-smi"))
    if smi is None:
        return None
    try:
        answer = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = answer.stdout.strip().splitlines()
    return lines[0].strip() if answer.returncode == 0 and lines else None


def unusable_gpu(how_to_choose_cpu: str) -> str | None:
    """The paragraph for a machine whose NVIDIA GPU this torch cannot use; None without a GPU or when torch uses it."""
    driver = nvidia_driver()
    if driver is None:
        return None
    import torch
    from lightning_fabric.accelerators.cuda import num_cuda_devices

    if num_cuda_devices() > 0:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA at all (a CPU-only build)"
    return (
        f"This machine has an NVIDIA GPU (driver {driver}), but torch {torch.__version__} cannot use it: it is built "
        f"for {build} and finds no usable CUDA device, so this run would quietly train on the CPU. Either install a "
        "torch built for this driver (a CUDA 13 build needs driver 580 or newer, a CUDA 12.x build 525 or newer; "
        "`nvidia-smi` prints the driver and the newest CUDA it runs; docs/clusters.md, \"Installing on a GPU "
        f"cluster\"), or {how_to_choose_cpu} to train on the CPU on purpose."
    )


def refuse_unusable_gpu(accelerator: object, how_to_choose_cpu: str = "pass --trainer.accelerator cpu") -> None:
    """Raise UserError (exit status 2) when a GPU is here and torch cannot use it, unless the CPU was asked for."""
    if str(accelerator).lower() == "cpu":
        return
    message = unusable_gpu(how_to_choose_cpu)
    if message:
        raise UserError(message)


def hide_gpus_from_a_cpu_run(accelerator: object) -> None:
    """`--trainer.accelerator cpu` on a machine with GPUs: hide them from this process and its children
    (CUDA_VISIBLE_DEVICES=""), so that no CUDA context is made on GPU 0 for a CPU run.

    Lightning creates one otherwise: the sanity check runs inside `isolate_rng()` (pytorch_lightning/trainer/
    trainer.py, `_run_stage`), which collects torch.cuda's RNG states whenever torch.cuda.is_available()
    (lightning_fabric/utilities/seed.py, `_collect_rng_states`), and `torch.cuda.get_rng_state_all()` initializes
    CUDA on every device. Before CUDA is initialized, torch.cuda.device_count() counts through NVML and parses
    CUDA_VISIBLE_DEVICES on every call (torch/cuda/__init__.py, `device_count`, `_device_count_nvml`): with none
    visible that loop is empty. Seen on an H200 (bench/results/gpu-check-h200.md), where a CPU fit held a context.
    """
    if str(accelerator).lower() != "cpu" or os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() == "":
        return
    import torch

    if torch.cuda.is_initialized():  # too late to hide anything; nothing to save either
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles), as oneDNN's bf16 kernels need
    (torch/cpu/__init__.py; private helpers, so a torch without them counts as native: nothing changes)."""
    import torch

    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(avx512_bf16() or amx())


def cpu_precision(precision: object, accelerator: object) -> str | None:
    """What a `16-mixed` run trains in on a CPU: `32-true` without native bfloat16, `bf16-mixed` with it; None to
    leave the precision alone.

    Lightning runs 16-mixed on a CPU as bf16-mixed, with its own warning naming its Trainer arguments
    (pytorch_lightning/trainer/connectors/accelerator_connector.py); asked for here, that warning never comes and
    preflight.py says it naming --trainer.precision. Without AVX512-BF16 or AMX every bf16 op is emulated: the
    quickstart trained at about 22 images/s in bf16-mixed and about 360 in 32-true on a 2-core AVX2-only AMD EPYC
    VM (2026-11-27). An explicit bf16-mixed is left as asked.
    """
    import torch

    on_cpu = str(accelerator).lower() == "cpu" or (str(accelerator).lower() == "auto" and not torch.cuda.is_available())
    if not on_cpu or str(precision) not in ("16-mixed", "16"):
        return None
    return "bf16-mixed" if native_cpu_bf16() else "32-true"
