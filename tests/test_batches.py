"""Ring buffers between workers and the training process: reused, and never overwritten while a batch is held."""
from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.index import load_indexes
from datamodules.sample.batches import RING_SLOTS, RingBatch, SampleLoader, _header, built_batch, give_back
from datamodules.sample.crop import ValCrop
from datamodules.sample.dataset import FileSource, SampleDataset
from tests.helpers.trees import make_tree

BATCH = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> SampleDataset:
    # More batches per epoch than a worker has ring buffers, so holding one epoch exhausts the ring.
    root = make_tree(tmp_path_factory.mktemp("ring"), {"a": 24, "b": 24}, size=(40, 36))
    index = load_indexes(root)["val"]
    return SampleDataset(FileSource(index, ""), index.labels, ValCrop(), 24)


def reference(dataset: SampleDataset) -> list[torch.Tensor]:
    """The batches built in this process (no worker, no ring); ValCrop has no randomness."""
    return [b[0].clone() for b in DataLoader(dataset, batch_size=BATCH, collate_fn=built_batch)]


def test_held_batches_survive_later_epochs(dataset):
    expected = reference(dataset)
    assert len(expected) > RING_SLOTS
    loader = SampleLoader(dataset, batch_size=BATCH, collate_fn=built_batch, num_workers=1,
                          persistent_workers=True, prefetch_factor=2)
    batches = list(loader)  # a whole epoch kept: the worker must not reuse these buffers
    assert not any(isinstance(b, RingBatch) for b in batches)  # each given back as it arrived
    held = [images for images, _ in batches]
    del batches
    kept_view = held[0][1:3]  # a view outlives the batch it came from
    first = held[0].clone()
    del held[0]
    for _ in range(3):  # later epochs, batches dropped at once: their buffers go round the ring
        for images, _labels in loader:
            assert images.shape == (BATCH, 3, 24, 24)
            assert images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(first, expected[0])
    assert torch.equal(kept_view, expected[0][1:3])
    for got, want in zip(held, expected[1:], strict=False):
        assert torch.equal(got, want)


def test_buffers_go_round_once_given_back(dataset):
    expected = reference(dataset)
    loader = DataLoader(dataset, batch_size=BATCH, collate_fn=built_batch, num_workers=1,
                        persistent_workers=True, prefetch_factor=2)
    sent = []
    for _ in range(2):
        for k, batch in enumerate(loader):
            assert isinstance(batch, RingBatch)
            images = batch[0]
            sent.append(int(_header(images.untyped_storage(), images.numel())[0]))
            kept, _ = give_back(batch)
            assert torch.equal(kept, expected[k])
            del batch, images, kept
            gc.collect()
    # Given back at once, the worker needs only a few buffers: one of them carried many batches.
    assert max(sent) > 2


def test_a_batch_never_given_back_stays_intact(dataset):
    # A plain DataLoader (no give_back): the worker falls back to new buffers once its ring is held.
    expected = reference(dataset)
    loader = DataLoader(dataset, batch_size=BATCH, collate_fn=built_batch, num_workers=1)
    held = [b[0] for _ in range(2) for b in loader]
    for got, want in zip(held, expected + expected, strict=False):
        assert torch.equal(got, want)


def test_a_batch_taken_in_inference_mode_goes_back_when_freed_outside_it(dataset, monkeypatch):
    # Lightning's validate loop fetches under torch.inference_mode; a batch freed after it (a stop signal's
    # teardown: the fault campaign of issue 52, SIGTERM during `validate`) gave its buffer back from outside it.
    # The ring header made in inference mode is an inference tensor, and writing it there raised in the finalizer:
    # "Exception ignored in: <finalize object ...>" and a traceback on stderr.
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    loader = SampleLoader(dataset, batch_size=BATCH, collate_fn=built_batch, num_workers=1, prefetch_factor=2)
    batches = iter(loader)
    with torch.inference_mode():
        images, _labels = next(batches)
    del images, _labels
    for images, _labels in batches:  # the rest of the epoch, outside inference mode, still goes round the ring
        assert images.shape == (BATCH, 3, 24, 24)
    del batches, images, _labels
    gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]


def test_a_workers_labels_come_by_value_and_its_images_in_the_ring(dataset):
    """Only the images travel as shared memory (the ring buffer); the labels come pickled by value, without a
    shared-memory segment and a descriptor hand-over of their own each batch (RingBatch.__reduce__)."""
    loader = DataLoader(dataset, batch_size=BATCH, collate_fn=built_batch, num_workers=1)
    batch = next(iter(loader))
    assert isinstance(batch, RingBatch) and batch.maker != os.getpid() and not batch.taken
    images, labels = batch
    assert images.is_shared() and _header(images.untyped_storage(), images.numel()) is not None
    assert not labels.is_shared() and labels.dtype == torch.int64
    assert torch.equal(labels, dataset.labels[:BATCH])
    assert torch.equal(give_back(batch)[0], reference(dataset)[0])
