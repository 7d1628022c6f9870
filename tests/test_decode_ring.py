"""Two batches in flight and a ring of output batches (datamodules/sample/device_decode.py, ring.py): the order
of streams and events, checked on a CPU by device_streams.CpuStreams as a GPU would need it, and on CUDA for real.

The CPU checks run the real decode of real JPEGs: what they check is the order the code asks for (which event
each stream waits on, which the host observes, when memory goes back), not CUDA's timing."""
from __future__ import annotations

import itertools

import pytest
import pytorch_lightning as pl
import torch

from datamodules.errors import DataError
from datamodules.imagefolder import ImageFolderDataModule
from datamodules.sample import device_streams
from datamodules.sample.crop import TrainCrop
from datamodules.sample.dataset import FileSource
from datamodules.sample.device_decode import DeviceDecode
from datamodules.sample.encoded import EncodedDataset
from datamodules.sample.ring import RING_SLOTS
from datamodules.sample.transforms import normalize
from lightning_app.module import ImageClassifier
from tests.helpers.mutants import mutant
from tests.helpers.optional import needs_gpus

KWARGS = {"batch_size": 4, "num_workers": 0, "image_size": 32, "decode": "gpu", "cpu_decode_share": 0.0,
          "persistent_workers": False}


def _stage(photo_tree):
    dm = ImageFolderDataModule(data_dir=str(photo_tree), **KWARGS)
    dm.setup("fit")
    return dm, dm.train_dataloader()


def _train_on(stage, epochs: int = 2) -> int:
    """What a training loop does with each batch: normalise it (work queued on the consumer's stream) and drop it
    before asking for the next."""
    seen = 0
    for _ in range(epochs):
        for images, labels in stage:
            normalize(images).mean()
            seen += len(labels)
    return seen


def test_the_decode_keeps_a_gpus_order_and_the_ring_never_grows(photo_tree):
    """Over 2 epochs: no ring slot written before the consumer's stream passed its last use, no decoded images
    released before the host saw their resize finish, no read before its write (CpuStreams.violations); the
    consumer never waits on the host; the ring holds RING_SLOTS batches and no more."""
    _, stage = _stage(photo_tree)
    assert _train_on(stage) == 2 * 24
    decoder = stage.decoder
    streams = decoder.streams
    assert streams.violations == []
    assert "MainThread" not in streams.host_waits  # the consumer: only device-side waits
    assert decoder.ring.made <= RING_SLOTS and decoder.ring.held() == 0
    assert not decoder.in_flight or len(decoder.in_flight) <= 1  # decoded images of one batch at most, kept


def test_a_consumer_that_fetches_ahead_has_its_batch_kept_until_its_work_is_queued(photo_tree):
    """Lightning's fetcher without a loader length asks for batch k+1 before it queues the step on k
    (loops/fetchers.py, `_PrefetchDataFetcher`): k's slot is written again only after work queued on k then."""
    _, stage = _stage(photo_tree)
    streams = stage.decoder.streams

    def slot_key(images: torch.Tensor):
        return next(s.key for s in stage.decoder.ring._ring if s.images.data_ptr() == images.data_ptr())

    for _ in range(2):
        ahead = None
        for batch in stage:
            if ahead is not None:  # the step on the batch before, queued now on the consumer's stream
                streams.reads(streams.current(), slot_key(ahead[0]))
                normalize(ahead[0]).mean()
            ahead = batch
        ahead = None
    assert streams.violations == []


def test_the_side_streams_run_at_high_priority_and_the_env_var_sets_it(photo_tree, monkeypatch):
    _, dev = _encoded(photo_tree)
    decoder = DeviceDecode("cpu", dev.source.describe)
    assert [s.priority for s in decoder.streams.streams] == [-1, -1]
    monkeypatch.setenv("FIC_DECODE_STREAM_PRIORITY", "0")
    assert [s.priority for s in DeviceDecode("cpu", dev.source.describe).streams.streams] == [0, 0]
    monkeypatch.setenv("FIC_DECODE_STREAM_PRIORITY", "high")
    with pytest.raises(DataError, match="FIC_DECODE_STREAM_PRIORITY='high' is not an integer"):
        DeviceDecode("cpu", dev.source.describe)


def test_a_batch_the_consumer_keeps_is_never_overwritten(photo_tree):
    """A consumer that keeps every batch (a list) gets the batches one that copies each gets: the ring skips a
    slot whose batch is still held and grows instead."""
    _, stage = _stage(photo_tree)
    torch.manual_seed(0)  # the crops, drawn in this process (no workers)
    copied = [(images.clone(), labels.clone()) for images, labels in stage]
    _, again = _stage(photo_tree)
    torch.manual_seed(0)
    kept = list(again)
    assert len(kept) == len(copied) == 6
    for (x, y), (kx, ky) in zip(copied, kept, strict=True):
        assert torch.equal(x, kx) and torch.equal(y, ky)
    assert again.decoder.ring.made > RING_SLOTS and again.decoder.streams.violations == []


def test_an_abandoned_epoch_gives_its_slots_back(photo_tree):
    """limit_*_batches, a sanity check: the epoch's batches built ahead are never handed out; their slots are free
    for the next epoch, which allocates nothing."""
    _, stage = _stage(photo_tree)
    for _ in range(3):
        list(itertools.islice(stage, 2))
    assert stage.decoder.ring.held() == 0 and stage.decoder.ring.made <= RING_SLOTS
    assert stage.decoder.streams.violations == []


@pytest.mark.slow
def test_a_lightning_fit_allocates_no_batch_after_the_first_ones(photo_tree, tmp_path):
    """Lightning fetches the next batch after it queued the step on this one (loops/fetchers.py: a loader with a
    length is not prefetched), and keeps no reference to the uint8 batch: 3 epochs, RING_SLOTS batches made."""
    dm = ImageFolderDataModule(data_dir=str(photo_tree), **KWARGS)
    model = ImageClassifier(arch="conv11", num_classes=2, image_size=32, global_batch_size=4,
                            arch_kwargs={"width": 8}, pictures=[])
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    for split in ("train", "val"):
        decoder = dm.device_decoders[split]
        assert decoder.ring.made <= RING_SLOTS and decoder.streams.violations == [], split


def _encoded(root, split: str = "train"):
    paths = sorted(str(p) for p in (root / split).rglob("*.jpg"))
    dataset = EncodedDataset(FileSource(paths, "fix it"), [0] * len(paths), TrainCrop(0.25), 64)
    return paths, dataset


# ---------------------------------------------------------------------------- the CUDA part


@needs_gpus(1, "CUDA streams")
def test_a_ring_slot_is_written_again_only_after_the_training_stream_is_done_with_it(photo_tree):
    """Each batch is read on the training stream behind a 50 ms sleep after the consumer moved on from it; the
    next batches, built into the ring meanwhile, must not land in its slot before that read (without the
    device-side wait on the consumer's event, the sums would be of other batches' pixels)."""
    _, dev = _encoded(photo_tree)
    packs = [dev.__getitems__(list(range(k, k + 6))) for k in (0, 6, 12)]
    decoder = DeviceDecode("cuda", dev.source.describe)
    if mutant("ring-slot-reused-early"):  # the ring writes a slot again without waiting for the consumer's event
        decoder.ring.streams = _NoWait(decoder.streams)
    want = [int(decoder(p)[0].sum(dtype=torch.int64)) for p in packs]
    assert len(set(want)) == 3
    sums = []
    for k in range(9):
        images, _ = decoder(packs[k % 3])
        torch.cuda._sleep(50_000_000)  # the step's work on the batch, still queued when the next build starts
        sums.append(images.sum(dtype=torch.int64))
        del images
    decoder.moved_on()
    assert [int(s) for s in sums] == [want[k % 3] for k in range(9)]
    assert decoder.ring.made == 1  # each call moves on from the batch before: one slot, written again each time


@needs_gpus(1, "CUDA stream priorities")
def test_the_resize_stream_has_a_higher_priority_than_the_step(photo_tree, monkeypatch):
    if mutant("step-priority"):  # the side streams at the step's priority
        monkeypatch.setattr(device_streams, "DEFAULT_PRIORITY", 0)
    _, dev = _encoded(photo_tree)
    decoder = DeviceDecode("cuda", dev.source.describe)
    assert decoder.resize_stream.priority < torch.cuda.current_stream().priority


@needs_gpus(1, "nvJPEG's private stream")
def test_decoded_images_live_until_the_host_saw_their_resize_finish(photo_tree, monkeypatch):
    """Each batch's resize queues behind a 50 ms sleep on the resize stream while the next batches decode, with
    memory from the decode stream's pool (all the photos are 200 x 150: the same blocks). Images released before
    the host saw their resize finish would be overwritten by the next batch's pixels before they are read."""
    _, dev = _encoded(photo_tree)
    packs = [dev.__getitems__(list(range(k, k + 6))) for k in (0, 6)]
    reference = DeviceDecode("cuda", dev.source.describe)
    want = [reference(p)[0].clone() for p in packs]

    class Slow(DeviceDecode):
        def _build(self, batch):
            with torch.cuda.stream(self.resize_stream):
                torch.cuda._sleep(50_000_000)
            return super()._build(batch)

    slow = Slow("cuda", dev.source.describe)
    if mutant("images-released-early"):  # every resize taken as finished: images go back before the host saw it
        monkeypatch.setattr(slow.streams, "done", lambda event: True)
    got = [slow(packs[k % 2])[0].clone() for k in range(6)]
    torch.cuda.synchronize()
    for k, images in enumerate(got):
        assert torch.equal(images, want[k % 2]), k


class _NoWait:
    """A mutant's streams for the ring alone: every other call as `streams` makes it, the device-side wait skipped."""

    def __init__(self, streams) -> None:
        self._streams = streams

    def wait(self, stream, event) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._streams, name)


def test_a_slot_of_another_size_is_dropped_while_an_earlier_one_is_busy():
    """A new size (a new val size, progressive resizing) drops the free slots of the old one. The ring removed a slot
    with list.remove, which compared it with the slots before it by the dataclass's field-wise __eq__, tensors
    included: "The size of tensor a (32) must match the size of tensor b (16)", or an ambiguous truth value, and the
    fit ended in a traceback (tests/test_docs.py's `--data.decode gpu` command, seen while checking issue 52)."""
    from datamodules.sample.device_streams import CpuStreams
    from datamodules.sample.ring import BatchRing

    streams = CpuStreams()
    ring = BatchRing(torch.device("cpu"), streams)
    stream = streams.new_stream(0)
    ring.acquire(4, 16, stream)  # busy: being built
    free, _ = ring.acquire(4, 16, stream)
    ring.release(free, None)
    slot, images = ring.acquire(4, 32, stream)  # `free` is dropped; `busy` is compared on the way
    assert images.shape == (4, 3, 32, 32) and slot is not free and ring.held() == 2
