"""`bench gpu --groups input`: the verdict's rules over made-up numbers, its timing windows, the rows it assembles
(with fakes), and the whole group run for real on a CPU."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench.gpu import input as gi
from bench.gpu.checks import Workload

F = gi.Figures


@pytest.mark.parametrize("figures,limit,shown", [
    # the loader alone has headroom over training, the step alone does not: the step is the limit
    (F(loader=6000, unpinned=6100, end_to_end=3000, step_alone=3100, decode_ceiling=8000, main_cpu=0.5),
     "the GPU step", "6,000 / 3,000 = 2.00"),
    # both are faster alone than together: they slow each other down
    (F(loader=4000, unpinned=4000, end_to_end=3000, step_alone=6000, decode_ceiling=8000, main_cpu=0.5),
     "contention", "6,000 / 3,000 = 2.00"),
    # training runs as fast as the loader alone, and the loader is faster without pinning
    (F(loader=3000, unpinned=4000, end_to_end=2900, step_alone=6000, decode_ceiling=8000, main_cpu=0.5),
     "the H2D copy / pinning", "4,000 / 3,000 = 1.33"),
    # the workers decode as fast as their cores can (pin off unknown: a CPU run)
    (F(loader=3000, unpinned=None, end_to_end=2950, step_alone=6000, decode_ceiling=3200, main_cpu=0.5),
     "decode CPU", "3,000 / 3,200 = 0.94"),
    # the workers could go twice as fast, and the training process is busy all the time
    (F(loader=3000, unpinned=3000, end_to_end=2950, step_alone=6000, decode_ceiling=6000, main_cpu=0.95),
     "the main process", "0.95 of a core"),
    # the workers could go twice as fast, and the training process is not busy: they share cores
    (F(loader=3000, unpinned=2500, end_to_end=2950, step_alone=6000, decode_ceiling=6000, main_cpu=0.4),
     "contention", "3,000 / 6,000 = 0.50"),
])
def test_name_limit_names_the_limit_with_its_arithmetic(figures, limit, shown):
    got, why = gi.name_limit(figures)
    assert got == limit and got in gi.LIMITS
    assert shown in why, why


def test_name_limit_tolerances_are_the_boundaries():
    base = {"unpinned": None, "step_alone": 9000, "decode_ceiling": 10000, "main_cpu": 0.1}
    assert gi.name_limit(F(loader=1150, end_to_end=1000, **base))[0] != "the GPU step"  # within 15%: about equal
    assert gi.name_limit(F(loader=1160, end_to_end=1000, **base))[0] == "contention"  # step alone 9x: both faster
    assert gi.name_limit(F(loader=1000, end_to_end=1000, **{**base, "decode_ceiling": 1176}))[0] == "decode CPU"
    assert gi.name_limit(F(loader=1000, end_to_end=1000, **{**base, "decode_ceiling": 1177}))[0] == "contention"


def test_windows_are_whole_rounds_after_the_prefetched_ones():
    w = Workload(batch_size=256, image_size=224, device="cuda", steps=30)
    assert gi.window(w, 14, 1) == (28, 42)  # 2 rounds warm-up; 30 timed -> 3 rounds of 14
    assert gi.window(w, 8, 2) == (24, 32)
    assert gi.window(Workload(steps=3), 2, 4) == (10, 4)  # at least 2 timed rounds
    assert gi.worker_counts(True, 16) == [16, 14, 12, 8] and gi.worker_counts(True, 10) == [10, 8]
    assert gi.worker_counts(False, 2) == [2, 1] and gi.worker_counts(False, 1) == [1]
    # the template's default budgets run 14 workers, 1 batch each in flight, for 16 asked at batch 256, 224 px
    # (64 MiB pinned blocks: train and val 16 + 2 each would need 2.25 GiB of the 2 GiB pinned budget)
    assert gi.planned(w, 16) == (14, 1) and gi.planned(w, 8) == (8, 2)
    assert gi.planned(w, 16, dm_kwargs={"pinned_budget_gib": 4.0})[0] == 16
    assert gi.batches_needed(w, [16, 14, 12, 8]) == 1 + max(28 + 42, 24 + 36, 24 + 32)


def test_cpu_seconds_reads_proc():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:
        pass
    assert gi._cpu_seconds([Path(f"/proc/{os.getpid()}/stat")]) >= 0.2
    assert gi._cpu_seconds([Path(f"/proc/{2**22 + 7}/stat")]) is None and gi._cpu_seconds([]) is None
    assert max(gi._threads().values()) >= 0.2  # this (main) thread


def test_input_rows_pass_dm_kwargs_everywhere_and_skip_a_count_the_budget_runs_as_another(monkeypatch, tmp_path):
    seen = []

    def loader_alone(root, w, n, pin=True, dm_kwargs=None):
        seen.append(("loader", n, pin, dm_kwargs))
        ran, prefetch = gi.planned(w, n, pin, dm_kwargs)
        warmup, steps = gi.window(w, ran, prefetch)
        return gi.LoaderRun(100.0 * ran if pin else 1000.0, n, ran, prefetch, warmup, steps, 99, 1.2, 0.97, 11.0)

    def end_to_end(root, w, n, dm_kwargs=None):
        seen.append(("end-to-end", n, dm_kwargs))
        return 1390.0, 6000.0

    def decode_per_core(root, w, seconds, dm_kwargs=None):
        seen.append(("decode", dm_kwargs))
        return 200.0

    for name, fake in (("loader_alone", loader_alone), ("end_to_end", end_to_end),
                       ("decode_per_core", decode_per_core)):
        monkeypatch.setattr(gi, name, fake)
    kw = {"min_scale": 0.5}
    w = Workload(batch_size=256, image_size=224, device="cuda", steps=30)
    rows = {r.name: r for r in gi.input_rows(w, tmp_path, [16, 14, 12, 8], kw, label="x: ")}
    assert seen == [("decode", kw), ("loader", 14, True, kw), ("loader", 12, True, kw), ("loader", 8, True, kw),
                    ("loader", 14, False, kw), ("end-to-end", 14, kw)]
    assert rows["x: loader alone, 16 workers"].status == "skipped"
    assert "runs 14 for 16" in rows["x: loader alone, 16 workers"].verdict
    assert rows["x: loader alone, 14 workers"].figure == "1,400 img/s"
    assert "28 warm-up batches" in rows["x: loader alone, 14 workers"].verdict
    assert rows["x: decode + crop, one core"].figure == "200 img/s; x 14 = 2,800 img/s"
    assert rows["x: training process CPU"].figure == "1.20 of a core, busiest thread 0.97"
    # 1,400 ~ 1,390 end to end: the loader; pin off 1,000 is slower; 1,400 / 2,800 = 0.5; a thread at 0.97: busy
    assert rows["x: VERDICT"].figure == "the main process", rows["x: VERDICT"].verdict
    assert all(r.status == "ok" for n, r in rows.items() if "16" not in n)


@pytest.mark.slow
def test_the_input_group_runs_on_a_cpu(tiny_data, tmp_path):
    from bench.__main__ import main

    out = tmp_path / "out"
    # the epoch holds 30 batches of 8: every window fits (at most 10 warm-up + 4 timed)
    rc = main(["gpu", "--allow-cpu", "--groups", "input", "--data-dir", str(tiny_data), "--arch", "conv11",
               "--image-size", "32", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--out", str(out),
               "--machine", "test"])
    assert rc == 0
    checks = json.loads((out / "test.gpu.json").read_text())["checks"]
    rows = {c["name"]: c for c in checks if c["group"] == "input"}
    counts = gi.worker_counts(False)

    def workers(k: int) -> str:
        return f"{k} worker{'s' * (k != 1)}"
    best = max((rows[f"loader alone, {workers(k)}"] for k in counts), key=lambda c: c["images_s"])
    n = best["extra"]["workers"]
    timed = [f"loader alone, {workers(k)}" for k in counts] + [f"loader alone, {workers(n)}, pin_memory off",
                                                             f"end-to-end, {workers(n)}", "step alone",
                                                             "decode + crop, one core"]
    gpu = [f"decode gpu: {name}".replace("decode + crop", "read + header + box") for name in timed
           if not name.startswith("loader alone") or name.startswith(f"loader alone, {workers(n)}")]
    assert set(rows) == {*timed, "training process CPU", "VERDICT", *gpu, "decode gpu: training process CPU",
                         "decode gpu: VERDICT"}, list(rows)  # the same at the best count with the device decoding
    assert rows["decode gpu: VERDICT"]["figure"] in gi.LIMITS
    timed += gpu
    assert all(c["status"] == "ok" for c in rows.values()), rows
    for name in timed:
        assert rows[name]["images_s"] > 0, rows[name]
    for c in (rows[f"loader alone, {workers(k)}"] for k in counts):
        e = c["extra"]
        assert e["warmup"] == (e["prefetch"] + 1) * e["workers"] and e["steps"] % e["workers"] == 0
        assert e["warmup"] + e["steps"] <= e["epoch"] and e["main_cpu"] > 0
        # /proc counts 10 ms ticks, and this window is a few of them: read, not judged
        assert e["workers_cpu"] is not None and e["main_cpu"] >= e["busiest_thread"] >= 0
    assert rows["training process CPU"]["extra"]["main_cpu"] == best["extra"]["main_cpu"] > 0
    assert rows["VERDICT"]["figure"] in gi.LIMITS and rows["VERDICT"]["verdict"]
    others = [c for c in checks if c["group"] != "input"]
    assert others and all(c["verdict"] == "not selected (--groups)" for c in others)
