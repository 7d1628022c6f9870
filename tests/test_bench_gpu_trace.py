"""`bench gpu --groups trace`: the arithmetic over a trace's events, the parse of kineto's chrome trace, and the
group run for real on a CPU (the decode's ranges on their own thread, no CUDA calls)."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.gpu import trace as gt

S = gt.Span
JPEG, RESIZE = gt.RANGES
DECODE, TRAIN = 10, 20  # thread ids


def test_runtime_calls_count_in_the_range_of_their_own_thread_and_streams_by_their_union():
    events = [S(JPEG, "range", DECODE, 0, 30_000), S(RESIZE, "range", DECODE, 30_000, 50_000),
              S(JPEG, "range", DECODE, 100_000, 120_000), S(RESIZE, "range", DECODE, 120_000, 130_000),
              S("cudaStreamSynchronize", "runtime", DECODE, 1_000, 25_000),
              S("cuStreamSynchronize", "runtime", DECODE, 1_500, 24_000),  # the driver call inside: counted once
              S("cudaLaunchKernel", "runtime", DECODE, 31_000, 31_010),
              S("cudaLaunchKernel", "runtime", DECODE, 32_000, 32_010),
              S("cudaMalloc", "runtime", DECODE, 121_000, 125_000),
              S("cudaEventSynchronize", "runtime", DECODE, 101_000, 111_000),
              S("cudaStreamSynchronize", "runtime", TRAIN, 2_000, 28_000),  # the training thread's: not counted
              S("cudaEventRecord", "runtime", DECODE, 60_000, 60_005),  # between ranges: not counted
              S("k1", "device", 7, 0, 10_000), S("k2", "device", 7, 5_000, 15_000), S("k3", "device", 13, 0, 4_000)]
    summary = gt.summarise(events, steps=2)
    jpeg, resize = summary["parts"][JPEG], summary["parts"][RESIZE]
    assert jpeg["batches"] == 2 and jpeg["wall_ms"] == 25.0
    assert jpeg["calls_ms"] == {"wait": 17.0} and jpeg["calls"] == {"wait": 1.0} and jpeg["host_ms"] == 8.0
    assert resize["calls_ms"] == {"allocate": 2.0, "launch": 0.01} and resize["calls"]["launch"] == 1.0
    # the device's window is 0 .. 15 ms: 7.5 ms a step, stream 7 busy all of it (two overlapping kernels)
    assert summary["step_ms"] == 7.5
    assert summary["streams"][7] == {"items_per_step": 1.0, "busy_ms_per_step": 7.5, "busy_share": 1.0}
    assert summary["streams"][13]["busy_ms_per_step"] == 2.0
    said = gt.verdict(summary)
    assert said.startswith(f"{JPEG} 25.0 ms a batch (wait 17.0, host 8.0)") and "largest: wait in" in said, said
    assert "a step 7.5 ms on the device, its busiest stream busy 100% of it" in said, said


def test_kinetos_chrome_trace_is_read_by_category_and_stream():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": JPEG, "tid": 4242, "ts": 10, "dur": 50},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "tid": 4242, "ts": 0, "dur": 500},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 4242, "ts": 12, "dur": 3},
        {"ph": "X", "cat": "kernel", "name": "void k<float>()", "tid": "stream 7", "ts": 20, "dur": 5,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "tid": "stream 13", "ts": 30, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 4242, "ts": 13, "dur": 1},
        {"ph": "M", "name": "thread_name", "tid": 4242}]}
    assert gt.spans(trace) == [S(JPEG, "range", 4242, 10, 60), S("cudaLaunchKernel", "runtime", 4242, 12, 15),
                               S("void k<float>()", "device", 7, 20, 25), S("Memcpy HtoD", "device", 13, 30, 35)]


@pytest.mark.slow
def test_the_trace_group_runs_on_a_cpu(tiny_data, tmp_path):
    from bench.__main__ import main

    out = tmp_path / "out"
    # the epoch holds 30 batches of 8: the 25 warm-up and 2 profiled steps fit
    rc = main(["gpu", "--allow-cpu", "--groups", "trace", "--data-dir", str(tiny_data), "--arch", "conv11",
               "--image-size", "32", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--num-workers", "1",
               "--out", str(out), "--machine", "test"])
    assert rc == 0
    row = next(c for c in json.loads((out / "test.gpu.json").read_text())["checks"] if c["group"] == "trace")
    assert row["status"] == "ok", row
    with gzip.open(row["extra"]["trace"], "rt") as f:
        events = gt.spans(json.load(f))
    ranges = [s for s in events if s.kind == "range"]
    # the decode thread's ranges, recorded although that thread did not start the profiler; one batch ahead of the
    # step, so the 2 profiled steps see 2 or 3 of its batches
    assert {s.name for s in ranges} == set(gt.RANGES) and len({s.where for s in ranges}) == 1, ranges
    for name in gt.RANGES:
        part = row["extra"]["parts"][name]
        assert 2 <= part["batches"] <= 3 and part["wall_ms"] > 0 and part["calls_ms"] == {}, part
    assert row["extra"]["streams"] == {} and row["extra"]["step_ms"] is None and f"{JPEG} " in row["verdict"], row
