"""A gloo process group for a test's processes (in_processes), torn down so that no rank leaves early."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def gloo_group(store: str, rank: int, world: int) -> Iterator[None]:
    """Rank `rank` of a gloo group of `world` processes meeting at the FileStore `store`, destroyed on leaving.

    Leaving normally, the ranks first meet at a barrier: a rank whose work needs no collective would otherwise
    destroy the group, closing its connections, while a slower peer is still in init_process_group's connect,
    which then fails with "Connection closed by peer" (seen with 2 processes on a loaded 2-CPU machine)."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
