"""How the benchmarks show progress: no redrawn tqdm bars while `python -m bench` writes to a file (a log), only
while it writes to a terminal; and, on both, a line every FIC_PROGRESS_EVERY_S seconds (default 15) naming the row
being measured and the step its run has reached (`Progress`, `report_step`)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

EVERY_ENV = "FIC_PROGRESS_EVERY_S"
STEP_FILE_ENV = "FIC_PROGRESS_STEP_FILE"  # where a row's run (a subprocess) says which step it has reached
DEFAULT_EVERY_S = 15.0


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


def report_step(text: str) -> None:
    """In a row's run: say which step it has reached (e.g. "epoch 1/3, step 5/12"), for `Progress`'s next line.
    A temporary file renamed into place, so the line never reads half of it."""
    path = os.environ.get(STEP_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        Path(tmp).write_text(text)
        os.replace(tmp, path)


def trainer_step(trainer, batch_idx: int) -> str:
    """The step of a Lightning fit, as `report_step` takes it."""
    epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
    batches = trainer.num_training_batches  # inf until the loader's length is known
    of = f"/{int(batches)}" if batches != float("inf") else ""
    return f"epoch {trainer.current_epoch + 1}{epochs}, step {batch_idx + 1}{of}"


class Progress:
    """A line every FIC_PROGRESS_EVERY_S seconds, from a thread, while a long suite runs: the suite, the row being
    measured (`row`), how long it has run and the step its subprocess last reported (`report_step`). Lines go
    through tqdm.write, which clears a bar drawn on a terminal and draws it again below the line."""

    def __init__(self, suite: str, rows: int, work: Path) -> None:
        self.suite, self.rows = suite, rows
        self.every_s = float(os.environ.get(EVERY_ENV) or DEFAULT_EVERY_S)
        self.step_file = work / "progress-step.txt"
        self._row: tuple[str, int, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._lines, name="bench-progress", daemon=True)

    def row(self, name: str, index: int | None = None) -> None:
        """Row `index` (1-based) of `rows`, named `name`, starts now (no index: a run outside the rows)."""
        self.step_file.unlink(missing_ok=True)
        self._row = (f"row {index}/{self.rows} {name}" if index else name, time.monotonic())

    def line(self) -> str | None:
        if self._row is None:
            return None
        label, t0 = self._row
        try:
            step = self.step_file.read_text().strip() or "starting"
        except OSError:
            step = "starting"
        return f"{self.suite}: {label}: {step} ({time.monotonic() - t0:.0f} s in this row)"

    def _lines(self) -> None:
        from tqdm import tqdm

        while not self._stop.wait(self.every_s):
            text = self.line()
            if text:
                tqdm.write(text, file=sys.stderr)
                sys.stderr.flush()

    def __enter__(self) -> Self:
        self.step_file.parent.mkdir(parents=True, exist_ok=True)
        os.environ[STEP_FILE_ENV] = str(self.step_file)  # the rows' subprocesses inherit it
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        os.environ.pop(STEP_FILE_ENV, None)
