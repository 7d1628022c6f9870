"""How predict's rows reach rank 0: through the output folder when every rank sees it, as objects otherwise.

`shared_by_every_rank` proves at start, before any inference, whether the folder rank 0 writes into is the
folder every other rank would write into: rank 0 writes a token there, a barrier, every rank looks for it. On
node-local disks (the same path on every node, another disk behind it) the others do not find it, and
`RowGather` brings their rows to rank 0 over the process group instead, a few batches at a time.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import torch.distributed as dist

GATHER_EVERY = 16  # batches a rank holds before they go to rank 0: 4096 rows at 256 images a batch, about 1 MB


def shared_by_every_rank(strategy, folder: str) -> bool:
    """True when every rank sees what rank 0 writes into `folder` (rank 0 has made it). A collective: every rank
    calls it. The token's name is new each time (rank 0's, broadcast), so a token left by an earlier predict on a
    node's own disk proves nothing."""
    if strategy.world_size < 2:
        return True
    token = os.path.join(folder, strategy.broadcast(f".shared-{secrets.token_hex(8)}" if strategy.global_rank == 0
                                                    else None))
    if strategy.global_rank == 0:
        with open(token, "w") as f:
            f.write("predict: is this folder shared by every rank?\n")
    strategy.barrier("predictions_shared_token")
    shared = strategy.reduce_boolean_decision(os.path.isfile(token), all=True)
    if strategy.global_rank == 0:  # every rank has looked: the reduce above needed each one's answer
        os.remove(token)
    return shared


class RowGather:
    """Every rank's rows to rank 0 as objects (torch.distributed.gather_object), every `every` batches: a rank holds
    at most that many batches of rows, and nothing waits on a disk rank 0 cannot read. `sink(rank, rows)` takes
    them on rank 0, in each rank's order.

    A round is a collective, so every rank runs the same rounds: one at each `every`-th batch it predicts, then at
    the end (`finish`) one more at a time until every rank has ended. A rank may predict a batch fewer than
    another (Lightning's UnrepeatedDistributedSamplerWrapper shares the images unpadded,
    pytorch_lightning/overrides/distributed.py): its end rounds meet the other's last in-loop round."""

    def __init__(self, every: int, sink: Callable[[int, list], None]) -> None:
        self.every = every
        self.sink = sink
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._rows: list = []
        self._batches = 0

    def add(self, rows: list) -> None:
        """One batch's rows; at every `every`-th batch, a round."""
        self._rows += rows
        self._batches += 1
        if self._batches % self.every == 0:
            self._round(done=False)

    def finish(self) -> None:
        """The rows left, then rounds until every rank has finished."""
        while not self._round(done=True):
            pass

    def _round(self, done: bool) -> bool:
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(self._rows, gathered, dst=0)
        self._rows = []
        if gathered is not None:
            for rank, rows in enumerate(gathered):
                if rows:
                    self.sink(rank, rows)
        flags = [None] * self.world_size
        dist.all_gather_object(flags, done)
        return all(flags)
