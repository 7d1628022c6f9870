"""LitData told the trainer's layout (world size, global rank, nodes) before it looks for one.

LitData detects the layout itself wherever it needs one: `_DistributedEnv.detect` (litdata/utilities/env.py)
is called by StreamingDataset.__init__, by the Cache and BinaryReader a dataset makes (`_create_cache`, also
reached from `get_len`), by StreamingDataLoader's worker iterator (`_StreamingMultiProcessingDataLoaderIter`)
and by its `load_state_dict` (litdata/streaming/dataset.py, cache.py, reader.py, dataloader.py). With a process
group it guesses num_nodes = world size // torch.cuda.device_count() and raises "The world size should be
divisible by the number of GPUs." when that guess is above 1 and the world size is not a multiple of the GPUs
visible: `--trainer.devices 6 --trainer.num_nodes 3` on nodes that show 8 GPUs (world 18, guessed 2 nodes),
or 1 of 2 GPUs on each of 5 nodes. So the detection is told first: inside `told(env)` it answers `env`.

`install` replaces `detect` once per process with one that answers the layout of the innermost `told` in this
thread's context (a ContextVar: nested and concurrent uses cannot leave each other's answer behind), and
LitData's own detection everywhere else.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from litdata.utilities.env import _DistributedEnv

_TOLD: ContextVar[_DistributedEnv | None] = ContextVar("litdata_layout", default=None)


def install() -> None:
    """Make LitData's `_DistributedEnv.detect` answer what `told` says (idempotent)."""
    litdatas = _DistributedEnv.__dict__["detect"].__func__
    if getattr(litdatas, "answers_told_layout", False):
        return

    def told_or_detected(cls) -> _DistributedEnv:
        env = _TOLD.get()
        return env if env is not None else litdatas(cls)

    told_or_detected.answers_told_layout = True
    _DistributedEnv.detect = classmethod(told_or_detected)


@contextmanager
def told(env: _DistributedEnv | None) -> Iterator[None]:
    """LitData's detection answers `env` inside (its own detection when None)."""
    install()
    token = _TOLD.set(env)
    try:
        yield
    finally:
        _TOLD.reset(token)
