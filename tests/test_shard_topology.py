"""LitData is told the trainer's layout before it detects one (datamodules/shards/topology.py).

Five real gloo processes read a real pack through ShardDataset and ShardLoader. LitData's detection is made to
see 2 GPUs per node (1 of 2 GPUs on each of 5 nodes), a layout for which it raises "The world size should be
divisible by the number of GPUs." (litdata/utilities/env.py, _DistributedEnv.detect: 5 // 2 = 2 nodes guessed,
5 % 2 != 0). The GPUs are the one simulated input: this CPU machine has none, so the `torch` that
litdata.utilities.env reads is given a `cuda` answering is_available() True and device_count() 2; the process
group, the dataset, the loader and its worker are real.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from datamodules.shards.pack import pack
from tests.helpers.gloo import gloo_group
from tests.helpers.processes import in_processes

pytestmark = pytest.mark.timeout(300)
WORLD, BATCH = 5, 8


def _ids(items: list[tuple]) -> list[int]:
    """The collate_fn: the items' positions in the split's Index (the pack's sample ids)."""
    return [int(item[3]) for item in items]


def _loader(url: str, rank: int):
    from datamodules.shards.loader import ShardDataset, ShardLoader

    dataset = ShardDataset(url, shuffle=False, drop_last=False, ranks=(WORLD, rank, WORLD))
    return ShardLoader(dataset, batch_size=BATCH, num_workers=1, collate_fn=_ids)


def _rank(rank: int, store: str, url: str) -> dict:
    import litdata.utilities.env as litdata_env
    from litdata import StreamingDataset
    from litdata.utilities.env import _DistributedEnv, _WorkerEnv

    with gloo_group(store, rank, WORLD):
        # the simulated input: 2 GPUs visible on this "node", as LitData's detection sees them
        litdata_env.torch = SimpleNamespace(
            distributed=torch.distributed, cuda=SimpleNamespace(is_available=lambda: True, device_count=lambda: 2))
        try:
            StreamingDataset(url)
            litdatas = "built"
        except RuntimeError as e:
            litdatas = str(e)
        loader = _loader(url, rank)  # the constructor, the cache and reader (len), the worker iterator
        env = loader.dataset.distributed_env
        epoch = [i for batch in loader for i in batch]
        first = _loader(url, rank)
        head = next(iter(first))
        state = first.state_dict()
        del first
        resumed = _loader(url, rank)
        resumed.load_state_dict(state)  # load_state_dict detects too
        rest = [i for batch in resumed for i in batch]
        reader = resumed.dataset._create_cache(_WorkerEnv(1, 0))._reader._distributed_env  # a worker's, made here
        return {"litdata": litdatas, "env": (env.world_size, env.global_rank, env.num_nodes),
                "reader": reader == _DistributedEnv(WORLD, rank, WORLD), "len": len(loader), "epoch": epoch,
                "resumed": head + rest}


def test_litdata_is_told_a_layout_its_own_detection_refuses(tiny_data, tmp_path):
    dst = tmp_path / "pack"
    pack(tiny_data, str(dst), chunk_mb=0.01, progress=False)
    ranks = in_processes(_rank, WORLD, str(tmp_path / "store"), str(dst / "train"), timeout=240)
    for rank, got in enumerate(ranks):
        assert got["litdata"] == "The world size should be divisible by the number of GPUs."  # raised today
        assert got["env"] == (WORLD, rank, WORLD) and got["reader"]
        assert len(got["epoch"]) == 240 // WORLD and got["len"] == 240 // WORLD // BATCH
        assert got["resumed"] == got["epoch"]  # one batch, then the rest from its state
    ids = [i for got in ranks for i in got["epoch"]]
    assert sorted(ids) == list(range(240))  # every sample once over the 5 ranks
