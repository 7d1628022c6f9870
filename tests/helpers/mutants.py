"""A test's defect, put back on demand: the GPU check's mutant runs (scripts/gpu_mutants.py) run one test with
FIC_MUTANT set to a name, and that test, seeing `mutant(name)`, puts its defect back (a monkeypatch of the product
line it guards) before it runs; it must then fail. A CUDA test takes part with one `if mutant(...)` and one entry
in scripts/gpu_mutants.py MUTANTS: (the defect, the test's node id, the name)."""
from __future__ import annotations

import os

MUTANT_ENV = "FIC_MUTANT"


def mutant(name: str) -> bool:
    """True when this run asks for the defect `name` to be put back."""
    return os.environ.get(MUTANT_ENV) == name
