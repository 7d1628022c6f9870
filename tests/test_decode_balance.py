"""--data.decode gpu's balance (datamodules/sample/balance.py): the workers decode a share of each batch so that
neither they nor the device stage wait. The solution from measured costs, and the share reaching real forked
workers through shared memory, with the overflow decoded on the CPU path's own boxes."""
from __future__ import annotations

import pytest
import torch

from datamodules.errors import DataError
from datamodules.imagefolder import ImageFolderDataModule
from datamodules.sample.balance import WARMUP_BATCHES, WorkerDecodeShare, shared_overflow
from datamodules.sample.crop import TrainCrop
from datamodules.sample.loader_plan import LoaderPlan
from tests.test_device_decode import _both, _pair


def _fed(share: WorkerDecodeShare, batches: int, n: int, read: float, decode: float, device: float,
         cannot: int = 0) -> float:
    """Feed `batches` batches of n whose worker spent `read` s per image reading and `decode` s per image it
    decoded, and whose device images took the stage `device` s each; the overflow the workers are told."""
    for _ in range(batches):
        on_cpu = round(n * float(share.overflow[0])) + cannot
        on_cpu = min(n, max(on_cpu, cannot))
        costs = [n, n * read, on_cpu, on_cpu * decode, cannot]
        share.update(costs, (n - on_cpu) * device, n - on_cpu)
    return float(share.overflow[0])


def test_the_share_makes_both_halves_take_as_long():
    # 4 workers, 1 ms to read an image, 4 ms to decode one; the device 1 ms an image: s = (4 - 1) / (4 + 4)
    share = WorkerDecodeShare(shared_overflow(), workers=4)
    overflow = _fed(share, 60, 64, read=1e-3, decode=4e-3, device=1e-3)
    assert overflow == pytest.approx(3 / 8, abs=1e-6)
    s = overflow
    assert (1e-3 + s * 4e-3) / 4 == pytest.approx((1 - s) * 1e-3)  # a batch per worker-time = the stage's


def test_files_the_device_cannot_take_count_towards_the_share():
    share = WorkerDecodeShare(shared_overflow(), workers=4)
    overflow = _fed(share, 60, 64, read=1e-3, decode=4e-3, device=1e-3, cannot=8)  # an eighth must go to the CPU
    assert overflow == pytest.approx((3 / 8 - 1 / 8) / (1 - 1 / 8), abs=1e-6)


def test_workers_slower_than_the_device_get_nothing_more_to_decode():
    share = WorkerDecodeShare(shared_overflow(), workers=2)
    assert _fed(share, 60, 64, read=2e-3, decode=4e-3, device=0.5e-3) == 0.0  # 2 x 0.5 ms < 2 ms to read


def test_a_fixed_share_and_no_workers_stay_put():
    fixed = WorkerDecodeShare(shared_overflow(), workers=4, fixed=0.25)
    assert _fed(fixed, 20, 64, read=1e-3, decode=4e-3, device=1e-3) == 0.25
    alone = WorkerDecodeShare(shared_overflow(), workers=0)  # batches packed on the stage's own thread
    assert _fed(alone, 20, 64, read=1e-3, decode=4e-3, device=1e-3) == 0.0


def test_a_cpu_decode_is_tried_before_any_was_timed_and_warm_up_is_not_counted():
    share = WorkerDecodeShare(shared_overflow(), workers=4)
    assert _fed(share, WARMUP_BATCHES, 64, read=1e-3, decode=4e-3, device=1.0) == 0.0  # not counted
    costs = [64, 64e-3, 0, 0, 0]
    share.update(costs, 64e-3, 64)
    assert float(share.overflow[0]) == 0.05


@pytest.mark.parametrize("fixed", [0.0, 1.0])
def test_the_share_reaches_forked_workers_and_the_overflow_is_the_cpu_paths_own_crop(tiny_data, fixed, photo_tree):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), decode="gpu", cpu_decode_share=fixed, num_workers=2,
                               batch_size=8, image_size=32, persistent_workers=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    seen = sum(len(labels) for _, labels in loader)
    counts = dm.device_decoders["train"].counts
    assert counts["device"] + counts["cpu"] == seen > 0
    assert counts["cpu"] == (seen if fixed == 1.0 else counts["cannot"])
    # the overflow's pixels are the CPU path's: the same seeds, the same boxes
    cpu, dev = _pair(photo_tree, "train", TrainCrop(0.25), 64)
    dev = dev.planned(LoaderPlan(overflow=torch.full((1,), fixed, dtype=torch.float64)))
    want, _, got, _, packed, _ = _both(cpu, dev, list(range(len(cpu))))
    assert len(packed.pixel_slots) == (len(cpu) if fixed == 1.0 else 0)
    if fixed == 1.0:
        assert torch.equal(got, want)


def test_a_share_without_decode_gpu_or_outside_0_1_is_refused():
    for bad in ({"cpu_decode_share": 0.5}, {"cpu_decode_share": None}, {"decode": "gpu", "cpu_decode_share": 1.5}):
        with pytest.raises(DataError, match="cpu_decode_share"):
            ImageFolderDataModule(**bad)
    assert ImageFolderDataModule(decode="gpu", cpu_decode_share=None).cpu_decode_share is None
