"""Optional parts some tests need: NVIDIA DALI (requirements-dali-cu13.txt, -cu12.txt), timm (requirements-extras.txt;
absent at CI's oldest end: its tests skip there with the reason).

Where DALI is absent its tests skip with the reason. Where FIC_REQUIRE_DALI=1 (CI's first end, .ci/run) its
absence stops the run before any test (tests/conftest.py), so DALI's tests can never skip silently there.
"""
from __future__ import annotations

import pytest

REQUIRE_DALI_ENV = "FIC_REQUIRE_DALI"


def dali_missing() -> str | None:
    """Why DALI cannot be used here, or None when it can."""
    try:
        import nvidia.dali.plugin.pytorch  # noqa: F401 - imports nvidia.dali too
    except ImportError as error:
        return f"needs NVIDIA DALI, not installed here ({error}): pip install -r requirements-dali-cu13.txt"
    return None


DALI_MISSING = dali_missing()
needs_dali = pytest.mark.skipif(DALI_MISSING is not None, reason=DALI_MISSING or "")


def timm_missing() -> str | None:
    """Why timm cannot be used here, or None when it can (found, not imported: importing it costs 0.6 s)."""
    import importlib.util

    if importlib.util.find_spec("timm") is None:
        return "needs timm, not installed here: pip install -r requirements-extras.txt"
    return None


TIMM_MISSING = timm_missing()
needs_timm = pytest.mark.skipif(TIMM_MISSING is not None, reason=TIMM_MISSING or "")



def cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int = 1, why: str = ""):
    """Marks a test `gpu` (what `pytest -m gpu` and scripts/gpu_check.sh select) and skips it, with the reason,
    where fewer than `count` CUDA GPUs are usable."""
    have = cuda_gpus()
    wanted = "a CUDA GPU" if count == 1 else f"at least {count} CUDA GPUs"
    skip = pytest.mark.skipif(have < count, reason=f"needs {wanted}{f' ({why})' if why else ''}; {have} here")

    def mark(test):
        return pytest.mark.gpu(skip(test))

    return mark
