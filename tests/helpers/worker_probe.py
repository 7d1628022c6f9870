"""A collate_fn that reports, from inside a loader worker, whether the worker has imported Lightning (a module this
light, so that unpickling it adds nothing)."""
import sys


def lightning_imported(batch) -> bool:
    return "pytorch_lightning" in sys.modules or "lightning" in sys.modules
