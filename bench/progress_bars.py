"""No redrawn tqdm bars while `python -m bench` writes to a file (a log), only while it writes to a terminal."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def no_bars_in_a_log_file() -> Iterator[None]:
    """No redrawn tqdm bars (carriage returns, cursor-up escapes) while the output goes to a file.

    tqdm reads TQDM_* defaults from the environment only once, when it is imported
    (tqdm.utils.envwrap), which happened before this runs: set it for the `main.py` subprocesses
    of `bench train`, and disable the bars of this process by a subclass put in place of
    `tqdm.tqdm`, which the bench modules look up when they draw a bar.
    The data tools print plain lines instead (datamodules.packing.progress_display).
    """
    if sys.stderr.isatty():
        yield
        return
    import tqdm as tqdm_module

    class QuietTqdm(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    saved = (tqdm_module.tqdm, os.environ.get("TQDM_DISABLE"))
    os.environ["TQDM_DISABLE"] = "1"
    tqdm_module.tqdm = QuietTqdm
    try:
        yield
    finally:
        tqdm_module.tqdm = saved[0]
        if saved[1] is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved[1]
