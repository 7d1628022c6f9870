"""The stream and event operations of the device decode, behind one small interface: CUDA's, and a CPU one that
keeps the order the decode asked for and checks it as a GPU would need it.

The operations (device_decode.py and ring.py call only these):
- `new_stream(priority)`, `current()` (this thread's current stream: the consumer's), `using(stream)`;
- `record(stream) -> event`, `wait(stream, event)` (device-side: later work on `stream` runs after the event;
  the host does not wait), `observe(event)` (the host waits for it), `done(event)` (has it passed? no wait);
- `hand_to(tensor, stream)`: the allocator learns that `stream` uses `tensor` (CUDA: `record_stream`);
- `reads(stream, key)`, `writes(stream, key)`, `releases(key)`: what the work queued next on `stream` does with
  the memory named `key` (a ring slot, a batch's decoded images), and its return to the allocator. CUDA needs no
  record of them; the CPU implementation checks them.

`CudaStreams` is right by construction when its caller keeps three rules, each what CUDA and the caching
allocator guarantee and no more:
- an event orders only the work queued on its stream before `record` (torch/cuda/streams.py, `Event.record`),
  and `wait` orders only work queued after it (`Stream.wait_event`: "only future operations are affected");
- memory goes back to the allocator's pool of the stream it was allocated on, and is handed out again at once
  for work queued later on that stream; work on other streams is not waited for unless `record_stream` named
  them ("ensure the tensor memory is not reused ... until all work queued on stream at the time of deallocation
  is complete", torch/_tensor_docs.py, `record_stream`);
- torchvision's decode writes its outputs on a private stream that waits for nothing queued on the caller's
  stream (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp; pytorch/vision PR 9606, meta-pytorch/torchcodec
  PR 1634): the memory it is handed must not be read by anything still queued, which only a host-observed event
  proves.

`CpuStreams`: without CUDA every operation has run when it returns, so nothing needs ordering; it keeps one
vector clock per stream and one for the host (what the host has seen finish) and records a violation where a
GPU could go wrong: a write not ordered after the last reads and write of that memory on other streams, a read
not ordered after its write, memory released before the host saw its last use finish. It also keeps each
stream's priority and which threads waited on the host. tests/test_decode_ring.py runs the real decode through
it.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from datamodules.errors import DataError

PRIORITY_ENV = "FIC_DECODE_STREAM_PRIORITY"  # the side streams' priority, for an A/B (bench/gpu/trace.py)
DEFAULT_PRIORITY = -1  # high: the resize queues ahead of the step's kernels (a lower number is a higher priority)


def stream_priority() -> int:
    """The side streams' priority: FIC_DECODE_STREAM_PRIORITY, else -1 (CUDA maps a value past its range to the
    nearest it has: torch/cuda/streams.py)."""
    value = os.environ.get(PRIORITY_ENV, "").strip()
    if not value:
        return DEFAULT_PRIORITY
    try:
        return int(value)
    except ValueError:
        raise DataError(f"{PRIORITY_ENV}={value!r} is not an integer: give the device decode's stream priority, "
                        f"e.g. -1 (high, the default) or 0 (the step's), or unset it.") from None


class CudaStreams:
    """The interface on CUDA (see the module doc): each operation is the CUDA call it names."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, priority: int) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device, priority=priority)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def using(self, stream: torch.cuda.Stream) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def observe(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def hand_to(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def reads(self, stream: Any, key: Hashable) -> None:
        pass

    def writes(self, stream: Any, key: Hashable) -> None:
        pass

    def releases(self, key: Hashable) -> None:
        pass


class CpuStream:
    def __init__(self, name: str, priority: int) -> None:
        self.name, self.priority = name, priority

    def __repr__(self) -> str:
        return f"CpuStream({self.name}, priority {self.priority})"


class CpuEvent:
    def __init__(self, clock: dict[str, int]) -> None:
        self.clock = clock  # what work on each stream it covers


def _covers(clock: dict[str, int], stream: str, position: int) -> bool:
    return clock.get(stream, 0) >= position


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for stream, position in other.items():
        into[stream] = max(into.get(stream, 0), position)


class CpuStreams:
    """The interface without CUDA: nothing to order, the order checked (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: dict[str, dict[str, int]] = {}
        self._host: dict[str, int] = {}  # what the host has seen finish
        self._writes: dict[Hashable, tuple[str, int]] = {}
        self._reads: dict[Hashable, list[tuple[str, int]]] = {}
        self._threads: dict[int, CpuStream] = {}
        self.streams: list[CpuStream] = []
        self.host_waits: Counter[str] = Counter()  # thread name -> host waits (observe)
        self.violations: list[str] = []

    def new_stream(self, priority: int) -> CpuStream:
        with self._lock:
            stream = CpuStream(f"side{len(self.streams)}", priority)
            self.streams.append(stream)
            self._clocks[stream.name] = {}
            return stream

    def current(self) -> CpuStream:
        """This thread's own stream (its default), as `torch.cuda.current_stream` is per thread."""
        thread = threading.current_thread()
        with self._lock:
            if thread.ident not in self._threads:
                self._threads[thread.ident] = CpuStream(f"thread {thread.name}", 0)
                self._clocks[self._threads[thread.ident].name] = {}
            return self._threads[thread.ident]

    def using(self, stream: CpuStream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, stream: CpuStream) -> CpuEvent:
        with self._lock:
            return CpuEvent(dict(self._clock(stream)))

    def wait(self, stream: CpuStream, event: CpuEvent) -> None:
        with self._lock:
            _merge(self._clock(stream), event.clock)

    def observe(self, event: CpuEvent) -> None:
        with self._lock:
            self.host_waits[threading.current_thread().name] += 1
            _merge(self._host, event.clock)

    def done(self, event: CpuEvent) -> bool:
        with self._lock:  # every op has run: asking is seeing it finished, without a wait
            _merge(self._host, event.clock)
        return True

    def hand_to(self, tensor: torch.Tensor, stream: CpuStream) -> None:
        pass

    def reads(self, stream: CpuStream, key: Hashable) -> None:
        with self._lock:
            clock = self._tick(stream)
            write = self._writes.get(key)
            if write is not None and write[0] != stream.name and not _covers(clock, *write):
                self.violations.append(f"{key} read on {stream.name} before it waited for its write on {write[0]}")
            self._reads.setdefault(key, []).append((stream.name, clock[stream.name]))

    def writes(self, stream: CpuStream, key: Hashable) -> None:
        with self._lock:
            clock = self._tick(stream)
            for name, position in self._uses(key):
                if name != stream.name and not _covers(clock, name, position):
                    self.violations.append(f"{key} written on {stream.name} before it waited for its use on {name}")
            self._writes[key] = (stream.name, clock[stream.name])
            self._reads[key] = []

    def releases(self, key: Hashable) -> None:
        with self._lock:
            for name, position in self._uses(key):
                if not _covers(self._host, name, position):
                    self.violations.append(f"{key} released before the host saw its use on {name} finish")
            self._writes.pop(key, None)
            self._reads.pop(key, None)

    def _uses(self, key: Hashable) -> list[tuple[str, int]]:
        write = self._writes.get(key)
        return ([write] if write is not None else []) + self._reads.get(key, [])

    def _clock(self, stream: CpuStream) -> dict[str, int]:
        clock = self._clocks.setdefault(stream.name, {})
        _merge(clock, self._host)  # work queued after the host saw something finish runs after it
        return clock

    def _tick(self, stream: CpuStream) -> dict[str, int]:
        clock = self._clock(stream)
        clock[stream.name] = clock.get(stream.name, 0) + 1
        return clock


def streams_for(device: torch.device) -> CudaStreams | CpuStreams:
    return CudaStreams(device) if device.type == "cuda" else CpuStreams()
