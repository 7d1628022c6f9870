"""`bench gpu --groups trace`: the arithmetic over a trace's events (ranges, queue delays, allocations), the parse of
kineto's chrome trace, the verdict's rules over made-up numbers, the ranges' thread clock, and the group run for real
on a CPU (the decode's ranges on their own thread, no CUDA calls)."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.gpu import trace_events as gt
from bench.gpu import trace_verdict as gv
from bench.gpu.trace_clock import RangeClock, per_batch

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
    said = gv.said(summary, {})
    assert said.startswith(f"{JPEG} 25.0 ms a batch (wait 17.0, host 8.0)"), said
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


def test_kinetos_correlation_ids_travel_with_calls_and_device_work():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 4242, "ts": 12, "dur": 3,
         "args": {"cbid": 211, "correlation": 77, "External id": 5}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 20, "dur": 5,
         "args": {"stream": 7, "correlation": 77, "queued": 0}}]}
    launch, kernel = gt.spans(trace)
    assert launch.correlation == kernel.correlation == 77 and kernel.where == 7


def test_queue_delays_match_device_work_to_its_launch_by_correlation_and_split_what_other_streams_held_back():
    events = [S(JPEG, "range", DECODE, 0, 10_000), S(JPEG, "range", DECODE, 20_000, 30_000),
              # the decode thread's launches (ids 1, 2, 3) and the step's (ids 10, 11)
              S("cudaLaunchKernel", "runtime", DECODE, 100, 200, 1),
              S("cudaLaunchKernel", "runtime", DECODE, 300, 400, 2),
              S("cuLaunchKernel", "runtime", DECODE, 20_100, 20_200, 3),
              S("cudaLaunchKernel", "runtime", TRAIN, 0, 50, 10), S("cudaLaunchKernel", "runtime", TRAIN, 60, 90, 11),
              # the step's kernels on stream 7 from 100 to 5,100 us; the decode's on stream 13
              S("conv", "device", 7, 100, 3_100, 10), S("bn", "device", 7, 3_100, 5_100, 11),
              S("resize1", "device", 13, 2_200, 2_700, 1),  # could run at 200: held back 2 ms by stream 7's
              S("resize2", "device", 13, 2_700, 3_000, 2),  # queued behind resize1 on its own stream: not held back
              S("resize3", "device", 13, 20_150, 20_500, 3),  # started before its launch call returned: delay 0
              S("memcpy", "device", 13, 9_000, 9_100, 99)]  # no launch in the trace: not counted
    q = gt.queue_delays(events, batches=2)
    assert q["decode"]["items"] == 3 and q["step"]["items"] == 2
    # delays 2.0 (resize1), 2.3 (resize2: launched at 400, run at 2,700) and 0 (resize3)
    assert q["decode"]["max_ms"] == pytest.approx(2.3) and q["decode"]["median_ms"] == 2.0
    assert q["decode"]["held_ms"] == 2.0 and q["decode"]["held_ms_per_batch"] == 1.0
    # bn waited 3.01 ms for conv on its own stream: a delay, not held back by another stream
    assert q["step"]["max_ms"] == pytest.approx(3.01) and q["step"]["held_ms"] == pytest.approx(0.05)
    early = gt.queue_delays([events[1], events[4], events[11]], batches=1)["decode"]  # resize3 alone
    assert early["items"] == 1 and early["median_ms"] == 0.0 and early["held_ms"] == 0.0


def test_allocations_count_runtime_and_driver_calls_once_each_and_the_decode_threads_time():
    events = [S(RESIZE, "range", DECODE, 0, 10_000), S(RESIZE, "range", DECODE, 20_000, 30_000),
              S("cudaMalloc", "runtime", DECODE, 1_000, 3_000), S("cuMemAlloc_v2", "runtime", DECODE, 1_100, 2_900),
              S("cudaFree", "runtime", DECODE, 21_000, 22_000), S("cuMemCreate", "runtime", TRAIN, 5, 10),
              S("cuMemMap", "runtime", TRAIN, 20, 30), S("cudaHostAlloc", "runtime", TRAIN, 40, 50),
              S("cudaLaunchKernel", "runtime", DECODE, 5_000, 5_010)]
    a = gt.allocations(events, steps=2, batches=2)
    assert a["per_step"] == 2.5 and a["decode_per_batch"] == 1.0 and a["decode_ms_per_batch"] == 1.5
    assert a["names"] == {"cuMemCreate": 1, "cuMemMap": 1, "cudaFree": 1, "cudaHostAlloc": 1, "cudaMalloc": 1}
    assert gt.call_kind("cuMemAlloc_v2") == gt.call_kind("cuMemFree_v2") == "allocate"
    assert gt.call_kind("cuMemcpyHtoDAsync_v2") == "copy" and gt.call_kind("cuLaunchKernel") == "launch"


F = gv.Figures


@pytest.mark.parametrize("figures,limit,shown", [
    # the decode thread waits a third of its time for the workers' batches
    (F(60, 0.33, 0.0, 18.0, 20.0, 15.0, 1.0), gv.WORKERS, "waited 33% of its time for the workers' next batch"),
    # it waits for the step: the decode keeps up
    (F(30, 0.05, 0.40, 18.0, 5.0, 1.0, 0.0), gv.STEP, "waited 40% of its time for the step"),
    # both over the line: the larger wait names it
    (F(30, 0.25, 0.30, 18.0, 5.0, 1.0, 0.0), gv.STEP, "step 30%"),
    # it sets the pace; of its 60 ms, the engines' 25 is the largest part
    (F(60, 0.1, 0.0, 25.0, 20.0, 10.0, 1.0), gv.ENGINES, "the engines the largest, 42% of the batch"),
    (F(60, 0.1, 0.0, 15.0, 30.0, 10.0, 1.0), gv.HOST, "the decode thread's host work 30.0"),
    (F(60, 0.1, 0.0, 15.0, 10.0, 28.0, 1.0), gv.QUEUEING, "SM queueing behind the step 28.0"),
    (F(60, None, None, 10.0, 10.0, 9.0, 22.0), gv.ALLOCATIONS, "allocations 22.0"),
    # a part not measured (no trace of CUDA work: a CPU) is left out and said
    (F(60, 0.1, 0.0, 12.0, 40.0, None, 0.0), gv.HOST, "(not measured: SM queueing behind the step)"),
])
def test_name_limit_names_one_limit_with_its_arithmetic(figures, limit, shown):
    got, why = gv.name_limit(figures)
    assert got == limit and got in gv.LIMITS
    assert shown in why, why


def test_name_limit_waits_below_the_line_leave_it_to_the_batch():
    assert gv.name_limit(F(60, 0.19, 0.19, 30.0, 1.0, 1.0, 1.0))[0] == gv.ENGINES
    assert gv.name_limit(F(60, 0.2, 0.0, 30.0, 1.0, 1.0, 1.0))[0] == gv.WORKERS
    assert gv.name_limit(F(60, None, None, None, None, None, None))[0] == gv.HOST


def test_figures_from_the_summary_take_the_host_work_net_of_waits_and_at_most_the_threads_cpu():
    summary = {"parts": {JPEG: {"batches": 4, "wall_ms": 30.0, "calls_ms": {"wait": 24.0, "allocate": 2.0},
                                "calls": {}, "host_ms": 4.0},
                         RESIZE: {"batches": 4, "wall_ms": 20.0, "calls_ms": {"launch": 3.0}, "calls": {},
                                  "host_ms": 17.0}},
               "queue": {"decode": {"items": 40, "held_ms_per_batch": 12.5}}}
    # spin-wait: the JPEG range's thread was on a core 29 of its 30 ms; only 4 of them outside waits and allocations
    clock = {JPEG: {"cpu_ms": 29.0}, RESIZE: {"cpu_ms": 9.0}}  # the resize's thread: 9 ms of CPU of 20 ms
    f = gv.figures_from(summary, clock, {"workers": 0.1, "device": 0.9, "step": 0.0}, jpeg_alone_ms=18.0)
    assert f == F(50.0, 0.1, 0.0, 14.0, 4.0 + 9.0, 12.5, 2.0)
    assert gv.figures_from({"parts": {JPEG: {"batches": 0}}}, {}, None, None) is None


def test_the_range_clock_times_the_decode_modules_ranges_on_their_own_thread_and_the_profiler_still_sees_them():
    import threading
    import time

    import torch

    from datamodules.sample import device_decode

    real = device_decode.record_function
    clock = RangeClock()

    def decode_thread():
        with device_decode.record_function(JPEG):  # busy: 50 ms of this thread's CPU
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.05:
                pass
        with device_decode.record_function(RESIZE):  # asleep
            time.sleep(0.1)

    from torch._C._profiler import _ExperimentalConfig

    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread) as prof, clock.installed():
        before = clock.snapshot()
        thread = threading.Thread(target=decode_thread)
        thread.start()
        thread.join()
        after = clock.snapshot()
    assert device_decode.record_function is real and "datamodules.sample.device_decode" in clock.modules
    ranges = per_batch(before, after)
    assert ranges[JPEG]["batches"] == 1 and ranges[JPEG]["cpu_ms"] >= 50 and ranges[JPEG]["wall_ms"] >= 50
    assert ranges[RESIZE]["wall_ms"] >= 100 and ranges[RESIZE]["cpu_share"] < 0.5, ranges
    assert {JPEG, RESIZE} <= {e.name for e in prof.events()}


@pytest.mark.slow
def test_the_trace_and_engines_groups_run_on_a_cpu(tiny_data, tmp_path):
    from bench.__main__ import main
    from bench.gpu import trace_ab

    out = tmp_path / "out"
    # the epoch holds 30 batches of 8: the 25 warm-up and 2 profiled steps fit
    rc = main(["gpu", "--allow-cpu", "--groups", "engines,trace", "--data-dir", str(tiny_data), "--arch", "conv11",
               "--image-size", "32", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--num-workers", "1",
               "--out", str(out), "--machine", "test"])
    assert rc == 0
    checks = json.loads((out / "test.gpu.json").read_text())["checks"]
    rows = {c["name"]: c for c in checks if c["group"] in ("trace", "engines")}
    row = rows["decode gpu, where a batch's time goes"]
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
        clocked = row["extra"]["ranges"][name]  # the decode thread's CPU in the same ranges
        assert 2 <= clocked["batches"] <= 3 and 0 < clocked["cpu_ms"], clocked
    assert row["extra"]["streams"] == {} and row["extra"]["step_ms"] is None and f"{JPEG} " in row["verdict"], row
    assert row["extra"]["queue"]["decode"]["items"] == 0 and row["extra"]["device_allocations"] is None
    verdict = rows["VERDICT"]
    assert verdict["status"] == "ok" and verdict["figure"] in gv.LIMITS, verdict
    # no engine on a CPU, said; the decode alone timed on the CPU path
    assert rows["hardware JPEG engines"]["status"] == "skipped" and "nvjpeg" in rows["hardware JPEG engines"]["verdict"]
    assert rows["JPEG call alone"]["images_s"] > 0 and rows["decode + resize alone"]["images_s"] > 0
    assert verdict["extra"]["jpeg_alone_ms"] == rows["JPEG call alone"]["extra"]["ms_per_batch"]
    # the A/B arms ran, the blocking one in a process of its own, which said it could not set the flag here
    for name in trace_ab.NAMES:
        assert rows[name]["status"] == "ok" and rows[name]["images_s"] > 0, rows[name]
    assert rows[trace_ab.NAMES[2]]["extra"]["blocking_set"], rows[trace_ab.NAMES[2]]
