"""A full disk while a run writes (a checkpoint, TensorBoard's events, predictions.csv): one paragraph naming the file,
about how many bytes it needed and how many are free, the last good checkpoint and how to go on; exit status 2.

torch's zip writer reports a full disk as "unexpected pos N vs M" (torch/serialization.py), with `No space left on
device` only as the chained first exception; TensorBoard's writer thread raises its OSError, without a file name,
at the next log call (tensorboard/summary/writer/event_file_writer.py, `_check_worker_status`). So the cause is
looked for along the chain, and the file, when the error does not name it, from the code that wrote it.
"""
from __future__ import annotations

import errno
import glob
import os
import traceback

from lightning_app.errors import UserError, chain
from lightning_app.runs.folders import free_bytes

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(error: BaseException | None) -> OSError | None:
    """The OSError "no space left" (or "disk quota exceeded") behind `error`, if any."""
    return next((e for e in chain(error) if isinstance(e, OSError) and e.errno in NO_SPACE), None)


class DiskFull(UserError):
    """The paragraph; `kept` and `then` are filled in by the CLI, which knows the run (cli.py)."""

    def __init__(self, file: str, needed: int | None = None, folder: str | None = None) -> None:
        super().__init__(file)
        self.file, self.needed = file, needed
        self.free = free_bytes(folder or file)  # now: a failed fresh run's folder is removed afterwards (cli.py)
        self.kept, self.then = "", ""
        self.elsewhere = "give a larger disk with --trainer.default_root_dir DIR"

    refused = False  # found before writing (export.py): nothing was started

    def __str__(self) -> str:
        free = self.free
        needed = f" (about {self.needed:,} bytes)" if self.needed else ""
        what = "would not fit" if self.refused else "failed with 'No space left on device'"
        return (f"The disk is full: writing {self.file}{needed} {what}; "
                f"{'?' if free is None else f'{free:,}'} bytes are free on its filesystem. Nothing half-written was "
                f"kept (each file is written to a temp file first, removed again). {self.kept}Free space there, or "
                f"{self.elsewhere}{', then ' + self.then if self.then else ''}.")


def checkpoint_bytes(checkpoint: object) -> int:
    """About what torch.save writes for `checkpoint`: the bytes of the tensors it holds."""
    import torch

    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.nelement() * checkpoint.element_size()
    if isinstance(checkpoint, dict):
        return sum(checkpoint_bytes(v) for v in checkpoint.values())
    if isinstance(checkpoint, (list, tuple)):
        return sum(checkpoint_bytes(v) for v in checkpoint)
    return 0


def _written_by(error: OSError) -> str:
    return "".join(f.filename for f in traceback.extract_tb(error.__traceback__))


def explain(error: BaseException, trainer, run_dir: str | None) -> DiskFull | None:
    """The DiskFull paragraph for `error` raised while `trainer` ran (None: not a full disk)."""
    if isinstance(error, DiskFull):
        full = error
    else:
        cause = no_space(error)
        if cause is None:
            return None
        file = cause.filename
        if not file:
            frames = _written_by(cause)
            log_dir = getattr(trainer, "log_dir", None) or run_dir or "."
            if "tensorboard" in frames:
                events = sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")), key=os.path.getmtime)
                file = f"TensorBoard's events file {events[-1] if events else 'in ' + log_dir}"
            elif "callbacks/predictions.py" in frames:
                file = os.path.join(log_dir, "predictions.csv")
            else:
                file = f"a file under {log_dir}"
        full = DiskFull(str(file), folder=cause.filename or log_dir)
    callback = getattr(trainer, "checkpoint_callback", None)
    good = [p for p in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", ""),
                        getattr(trainer, "ckpt_path", None)) if p and os.path.isfile(p)]
    full.kept = f"The last good checkpoint is {good[0]}. " if good else "No checkpoint was saved before it. "
    if trainer is not None and getattr(trainer.state.fn, "value", "") == "fit":
        last = good and os.path.basename(good[0]) == "last.ckpt"
        full.then = ("resume with --ckpt_path last" if last else f"go on with --ckpt_path {good[0]}" if good else
                     "run the same command again")
    else:
        full.then = "run the same command again"
    return full


def quiet_writer_threads() -> None:
    """TensorBoard's writer thread prints its own traceback of a full disk ("Exception in thread ...") before the main
    thread meets the same error at its next log call (event_file_writer.py, _AsyncWriterThread.run): that one is
    said once, as the paragraph above; every other thread's exception is printed as before."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "quiet_writer_threads", False):
        return

    def hook(args) -> None:
        if no_space(args.exc_value) is not None and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.quiet_writer_threads = True
    threading.excepthook = hook
