"""Batch: where a worker writes a whole uint8 batch, and how the batch reaches the training process.

A DataLoader worker hands its batches to the training process in shared memory. A fresh shared
buffer per batch (what default_collate does: `_new_shared`) costs a page fault, a page
allocation and zeroing for every 4 KiB of it, every batch.

So each worker keeps a small ring of shared batch buffers, and reuses one only once the training
process has said it is done with it:
- the buffer carries a 16-byte header after the pixels: (batches sent, batches given back);
- the worker stamps "sent" before returning the batch as a `RingBatch`;
- in the training process, `give_back` sets "given back" = "sent" once the batch is no longer
  used there (or, when the DataLoader pins memory, once its pin thread has copied it).

A ring buffer is reused only when the two match, so a batch a consumer still holds is never
overwritten: a consumer that never gives batches back (a plain DataLoader around a
`SampleDataset`) just makes the worker fall back to a fresh buffer per batch, as before.
A ring holds buffers of one batch shape: when the size changes (progressive resizing), buffers of
the old size are dropped as soon as they are given back, so their shared memory is freed and the
ring fills with buffers of the new size. The number of slots comes from the memory plan
(datamodules/budget/memory.py): the batches a worker may have in flight, plus the consumer's.
`SampleLoader` gives back every batch of every iteration; `RingBatch.pin_memory` does it in the
DataLoader's pin thread (torch/utils/data/_utils/pin_memory.py calls a batch's own
`pin_memory()` before treating it as a tuple).
"""
from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

import numpy as np
import torch
from torch.utils.data import get_worker_info

from datamodules.processes.evaluation_loader import EvaluationLoader

RING_SLOTS = 8  # per worker, unless the memory plan says otherwise (SampleDataset.ring_slots)
_HEADER = 16  # bytes: int64 sent, int64 given back
_ALIGN = 64

_ring: tuple[int, list[tuple[torch.UntypedStorage, int]]] | None = None  # (buffer, bytes of pixels)


def batch_layout(n: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Shape, channels-last stride (what the resize kernel writes) and byte count of a uint8 batch."""
    return (n, 3, size, size), (3 * size * size, 1, 3 * size, 3), n * 3 * size * size


def ring_buffer_bytes(n: int, size: int) -> int:
    """Shared-memory bytes of one ring buffer for a batch of n images of size x size."""
    return -(-batch_layout(n, size)[2] // _ALIGN) * _ALIGN + _HEADER


def _header(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor | None:
    """The (sent, given back) int64 pair after `nbytes` of pixels, or None for a buffer without one."""
    start = -(-nbytes // _ALIGN) * _ALIGN
    if storage.nbytes() != start + _HEADER:
        return None
    return torch.empty(0, dtype=torch.int64).set_(storage, start // 8, (2,), (1,))


def _view(storage: torch.UntypedStorage, shape, stride) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape, stride)


def _worker_ring() -> list[tuple[torch.UntypedStorage, int]]:
    """This worker process's ring buffers (made after any fork: a ring never crosses one)."""
    global _ring
    if _ring is None or _ring[0] != os.getpid():
        _ring = (os.getpid(), [])
    return _ring[1]


def new_batch(n: int, size: int, pin: bool = False, slots: int = RING_SLOTS) -> torch.Tensor:
    """An uninitialised uint8 (n, 3, size, size) channels-last batch; in a worker, in shared memory.

    In a worker it is a ring buffer when one is free (see the module doc), stamped as sent; the ring
    keeps at most `slots` buffers and drops free buffers of another size. Elsewhere private memory,
    pinned if `pin`.
    """
    shape, stride, nbytes = batch_layout(n, size)
    if get_worker_info() is None:
        return torch.empty_strided(shape, stride, dtype=torch.uint8, pin_memory=pin)
    ring = _worker_ring()
    found = None
    for entry in list(ring):
        storage, held = entry
        header = _header(storage, held)
        if int(header[0]) != int(header[1]):
            continue  # still held by the training process
        if held != nbytes or found is not None and len(ring) > slots:
            ring.remove(entry)  # another size (or a slot too many): its shared memory goes with the last reference
        elif found is None:
            found = (storage, header)
    if found is not None:
        found[1][0] += 1
        return _view(found[0], shape, stride)
    if len(ring) < slots:
        storage = torch.UntypedStorage._new_shared(-(-nbytes // _ALIGN) * _ALIGN + _HEADER)
        _header(storage, nbytes).fill_(0)[0] = 1
        ring.append((storage, nbytes))
        return _view(storage, shape, stride)
    return _view(torch.UntypedStorage._new_shared(nbytes), shape, stride)  # every ring buffer is still held


def warm_ring(sample: torch.Tensor) -> None:
    """The tensor operations a worker's `new_batch` and its copy of `sample` into the batch run, here, on a
    one-sample shared buffer freed on return (why a training process runs them: datamodules/processes/forksafe.py)."""
    shape, stride, nbytes = batch_layout(1, sample.shape[-1])
    storage = torch.UntypedStorage._new_shared(ring_buffer_bytes(1, sample.shape[-1]))
    header = _header(storage, nbytes)
    header.fill_(0)[0] = 1
    if int(header[0]) != int(header[1]):
        header[0] += 1
    _view(storage, shape, stride)[0].copy_(sample)
    header[1] = header[0]


def fill_batch(batch: torch.Tensor, sample: Callable[..., torch.Tensor], pool: Executor, into: bool = False
               ) -> torch.Tensor:
    """batch[k] = sample(k) for every k, on `pool`'s threads; the first failure is re-raised here. `into`:
    sample(k, batch[k]) writes the slot itself (no copy).

    Inference mode is per thread: under trainer.validate in the training process the batch is an
    inference tensor, which the threads may only write in inference mode too.
    """
    inference = torch.is_inference_mode_enabled()

    def fill(k: int) -> None:
        with torch.inference_mode(inference):
            if into:
                sample(k, batch[k])
            else:
                batch[k].copy_(sample(k))

    list(pool.map(fill, range(len(batch))))
    return batch


class RingBatch(tuple):
    """(images, labels, *more tensors) whose images may sit in a worker's ring buffer: `give_back` before keeping it.

    A batch the training process drops without taking it (a DataLoader that stops early, e.g. after
    Lightning's sanity check or `limit_*_batches`, discards the batches its workers had prefetched:
    torch/utils/data/dataloader.py, `_MultiProcessingDataLoaderIter._reset`) gives its buffer back when
    it is freed, if nothing else holds the images or a view of them; otherwise the worker would count
    that buffer as held for the rest of the run. (With pinning, the pin thread has given every batch
    back before it can be discarded.)
    """

    def __new__(cls, batch):
        self = super().__new__(cls, batch)
        self.maker = os.getpid()  # travels with the batch (pickled __dict__)
        self.taken = False
        return self

    def __reduce__(self):
        # The images go by their shared ring buffer (torch's reductions send its file descriptor); the labels and
        # any further small tensors by value: as tensors of their own, each would take a fresh shared-memory segment
        # and a second descriptor hand-over per batch (torch/multiprocessing/reductions.py, reduce_storage), a
        # socket connection to the worker's resource sharer and an mmap in the training process, for 512 bytes.
        images, *rest = self
        return _ring_batch, (images, [_by_value(t) for t in rest], dict(self.__dict__))

    def pin_memory(self, device=None) -> tuple[torch.Tensor, ...]:
        return give_back(self, pin=True)

    def __del__(self) -> None:
        if self.taken or getattr(self, "maker", os.getpid()) == os.getpid():
            return  # handed over to the consumer, or still in the worker that made it
        images = self[0]
        # 3 references to the tensor: this tuple, `images`, getrefcount's argument; 2 to its storage: the
        # tensor and `storage` (torch._C._storage_Use_Count counts the StorageImpl's owners). More: still used.
        storage = images.untyped_storage()
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if sys.getrefcount(images) > 3 or use_count is None or use_count(storage._cdata) > 2:
            return
        header = _header(storage, images.numel()) if images.storage_offset() == 0 else None
        if header is not None:
            header[1] = header[0]


def _by_value(t):
    """A small CPU tensor as a numpy array (pickled as its bytes); anything else as it is."""
    if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_shared() and not t.requires_grad
            and t.dtype != torch.bfloat16 and t.numel() * t.element_size() <= 1 << 16):
        return t.numpy()
    return t


def _ring_batch(images: torch.Tensor, rest: list, state: dict) -> RingBatch:
    """A RingBatch unpickled (`RingBatch.__reduce__`): its small tensors made tensors again, its maker kept."""
    batch = RingBatch((images, *(torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in rest)))
    batch.__dict__.update(state)
    return batch


def give_back(batch: tuple[torch.Tensor, ...], pin: bool = False) -> tuple[torch.Tensor, ...]:
    """(images, labels, ...) safe to keep; a ring buffer goes back to its worker once nothing here uses it.

    Elements after the labels (the sample ids of a streamed batch) are passed on as they are (pinned with `pin`).

    pin: copy into pinned memory (the one copy the DataLoader's pin thread makes anyway) and give
    the ring buffer back at once. Otherwise no copy: the images become a tensor over a numpy view of
    the buffer, and the buffer goes back when that view is freed, i.e. when the last tensor made from
    these images (a view, a slice, the batch itself) is gone. torch.from_numpy keeps the array alive
    for exactly that long (the storage's deleter drops it).
    """
    images, *rest = batch
    if isinstance(batch, RingBatch):
        batch.taken = True
    header = _header(images.untyped_storage(), images.numel()) if images.storage_offset() == 0 else None
    if pin:
        out = torch.empty_strided(images.shape, images.stride(), dtype=images.dtype, pin_memory=True)
        out.copy_(images)
        if header is not None:
            header[1] = header[0]  # after the copy: the worker may now write this buffer again
        return (out, *(t.pin_memory() for t in rest))
    if header is None:
        return (images, *rest)
    view = images.numpy()
    weakref.finalize(view, _given_back, header, int(header[0])).atexit = False
    return (torch.from_numpy(view), *rest)


def _given_back(header: torch.Tensor, sent: int) -> None:
    # A header made under torch.inference_mode (Lightning's validate, test and predict loops) is an inference
    # tensor, which may be written only in that mode; the view holding the buffer may be freed after it (a stop's
    # teardown). Writing a normal tensor in that mode is allowed too.
    with torch.inference_mode():
        header[1] = sent


def built_batch(batch):
    """The DataLoader's collate_fn: `SampleDataset.__getitems__` already built the batch."""
    return batch


def given_back(batches: Iterator) -> Iterator:
    """The batches of a loader's iterator, each ring buffer given back as soon as its batch arrives."""
    for batch in batches:
        out = give_back(batch) if isinstance(batch, RingBatch) else batch
        # not the suspended frame's: the last batch of an abandoned iterator (limit_train_batches, a size
        # change) would keep its ring buffer mapped here, and the next workers forked would inherit it
        del batch
        yield out
        del out


class SampleLoader(EvaluationLoader):
    """A DataLoader that gives every ring buffer back as soon as a batch arrives (see the module doc), and whose
    dead workers a fit's validation replaces (datamodules/processes/evaluation_loader.py)."""

    def __iter__(self):
        yield from given_back(super().__iter__())
