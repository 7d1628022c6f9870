"""Triton kernels on a CPU: `TRITON_INTERPRET=1` is read when a kernel is decorated (triton/runtime/jit.py,
`jit`), so it must be set before any module defining one is imported: in a fresh interpreter (processes.py
in_child), through `call_interpreted`."""
from __future__ import annotations

import importlib
import os
import sys


def call_interpreted(module: str, name: str, *args):
    """module.name(*args), imported only now, with Triton's interpreter on."""
    os.environ["TRITON_INTERPRET"] = "1"
    assert "datamodules.sample.resize_kernel" not in sys.modules, "a kernel was decorated before the interpreter"
    return getattr(importlib.import_module(module), name)(*args)
