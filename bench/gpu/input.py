"""`bench gpu --groups input`: where the input time goes when real JPEGs feed the training step.

Rows (group "input"): the ImageFolder train loader alone (no model: batches to the device and
normalised by on_after_batch_transfer) at several worker counts, and at the best with pin_memory off;
end-to-end training at the best count, and the same step alone on its last batch (on the device);
one core's decode + crop rate through the dataset's own sample path (x the workers: the CPU decode
ceiling); the training process's own CPU (and the workers') while the best loader-alone row ran; and a
VERDICT naming the limit (`name_limit`). `dm_kwargs` reach every DataModule the group makes
(e.g. another decoder), so a caller can add rows with other settings.

Timing windows are whole rounds: the loader hands out batches in worker order, one per worker a round,
so from the last batch of one round to the last of a later one every worker delivered the same number.
Warm-up: prefetch + 1 rounds (the first `prefetch` rounds were asked for at start-up, before anything
was consumed: forks, first batches, the rings and pinned blocks filling; round prefetch + 1 is the first
steady one). Timed: at least --steps batches and 2 rounds. The built-in data hold the whole window in
one epoch (`batches_needed`): at an epoch's end the workers wait for the next epoch's indices.
"""
from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu.checks import Check, TrainStep, Workload, cudnn_flags, fastest_precision, make_model, rate, sync
from bench.gpu.data import stream, timed_stream
from bench.loaders.timing import close, prepare, shutdown, to_device
from datamodules.budget.cpus import cpus_per_process

GROUP = "input"
PER_CORE = {False: "decode + crop", True: "read + header + box"}  # a worker's share of a sample, per decode
PER_CORE_HOW = {False: "SampleDataset.sample (read, decode, random crop)",
                True: "EncodedDataset.device_crop (read, walk the JPEG header, draw the box: --data.decode gpu)"}
LIMITS = ("decode CPU", "the main process", "contention", "the H2D copy / pinning", "the GPU step")
TOLERANCE = 0.15   # two rates within 15% are "about equal"
BUSY_CORE = 0.85   # a thread of the training process at >= 85% of one core is saturated


@dataclass
class Figures:
    """What `name_limit` judges (images/s unless said): the best loader-alone row, pinned and not, end to end,
    the step alone, one core's decode rate x workers, and the training process's busiest thread (cores)."""

    loader: float
    unpinned: float | None
    end_to_end: float
    step_alone: float
    decode_ceiling: float
    main_cpu: float


def name_limit(f: Figures) -> tuple[str, str]:
    """(one of LIMITS, the arithmetic): the loader with headroom -> the step, or contention if the step alone is
    faster too; else the loader's own limit: pinning if pin off is faster, decode if the workers reach their
    cores' rate, the main process if it is busy, else contention."""
    def r(a: float, b: float) -> str:
        return f"{a:,.0f} / {b:,.0f} = {a / max(b, 1e-9):.2f}"

    if f.loader > (1 + TOLERANCE) * f.end_to_end:
        if f.step_alone > (1 + TOLERANCE) * f.end_to_end:
            return "contention", (f"loader alone / end-to-end {r(f.loader, f.end_to_end)} and step alone / "
                                  f"end-to-end {r(f.step_alone, f.end_to_end)}: each is faster alone than together")
        return "the GPU step", (f"loader alone / end-to-end {r(f.loader, f.end_to_end)} > {1 + TOLERANCE:.2f}: the "
                                f"loader has headroom; step alone / end-to-end {r(f.step_alone, f.end_to_end)}")
    why = f"loader alone / end-to-end {r(f.loader, f.end_to_end)} <= {1 + TOLERANCE:.2f}: the loader is the limit; "
    if f.unpinned is not None and f.unpinned > (1 + TOLERANCE) * f.loader:
        return "the H2D copy / pinning", why + f"pin_memory off / on {r(f.unpinned, f.loader)}"
    share = f"loader alone / decode ceiling {r(f.loader, f.decode_ceiling)}"
    if f.loader >= (1 - TOLERANCE) * f.decode_ceiling:
        return "decode CPU", why + share + f" >= {1 - TOLERANCE:.2f}"
    if f.main_cpu >= BUSY_CORE:
        return "the main process", why + share + f"; its busiest thread uses {f.main_cpu:.2f} of a core"
    return "contention", why + share + (f" while the training process's busiest thread uses {f.main_cpu:.2f} of a "
                                        "core: the workers run below their one-core rate (shared cores, SMT, memory)")


# ------------------------------------------------------------------------------ loaders

@dataclass
class LoaderRun:
    images_s: float
    asked: int
    workers: int         # after the memory budget
    prefetch: int
    warmup: int
    steps: int
    epoch: int           # batches per epoch
    main_cpu: float      # the training process's CPU over the window, in cores (all its threads)
    busiest_thread: float  # its busiest thread's (the main loop or the pin thread), in cores
    workers_cpu: float | None  # the workers' together, in cores (/proc), None where unreadable


def worker_counts(cuda: bool, cpus: int | None = None) -> list[int]:
    cpus = cpus or cpus_per_process(1)
    return sorted({max(1, min(n, cpus)) for n in ((16, 14, 12, 8) if cuda else (2, 1))}, reverse=True)


def window(w: Workload, workers: int, prefetch: int) -> tuple[int, int]:
    """(warm-up, timed) batches, whole rounds of `workers` (see the module doc)."""
    per_round = max(1, workers)
    return (prefetch + 1) * per_round, max(2, -(-w.steps // per_round)) * per_round


def _args(w: Workload, workers: int, pin: bool, dm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    return {"batch_size": w.batch_size, "image_size": w.image_size, "num_workers": workers, "pin_memory": pin,
            **(dm_kwargs or {})}


def planned(w: Workload, workers: int, pin: bool = True, dm_kwargs: dict[str, Any] | None = None) -> tuple[int, int]:
    """(workers, prefetch) the DataModule's memory plan runs for `workers` asked (datamodules/budget/memory.py)."""
    from datamodules.budget.sizing import Layout, LoaderSizing

    layout = Layout(world=1, ranks_per_node=1, cpus=cpus_per_process(1), cuda=w.device == "cuda")
    plan = LoaderSizing.plan_for(_args(w, workers, pin, dm_kwargs), layout).loader("train")
    return plan.workers, plan.prefetch


def batches_needed(w: Workload, counts: list[int], dm_kwargs: dict[str, Any] | None = None) -> int:
    """Train batches an epoch must hold for every row's window (+1: drop_last never shortens it)."""
    return 1 + max(sum(window(w, *planned(w, n, dm_kwargs=dm_kwargs))) for n in counts)


def make_dm(root: Path, w: Workload, workers: int, pin: bool = True, dm_kwargs: dict[str, Any] | None = None):
    from datamodules import ImageFolderDataModule

    dm = ImageFolderDataModule(data_dir=str(root), **_args(w, workers, pin, dm_kwargs))
    dm.setup("fit")
    return dm


@contextlib.contextmanager
def _loader(root: Path, w: Workload, workers: int, pin: bool, dm_kwargs: dict[str, Any] | None):
    """(DataModule, its train loader, (warm-up, timed) batches, its plan), the workers stopped afterwards."""
    dm = make_dm(root, w, workers, pin, dm_kwargs)
    loader = dm.train_dataloader()
    plan = dm.memory_plan(fit=True).loader("train")  # the workers and prefetch it runs
    prepare(loader)
    try:
        yield dm, loader, window(w, plan.workers, plan.prefetch), plan
    finally:
        close(loader)
        shutdown(dm)


def _cpu_seconds(stats: list[Path]) -> float | None:
    """utime + stime of /proc/<pid>/stat files (a process: all its threads; /proc/<pid>/task/<tid>/stat: one
    thread); None where one is unreadable (the process or thread is gone)."""
    total = 0
    for stat in stats:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), after pid and (comm)
    return total / os.sysconf("SC_CLK_TCK") if stats else None


def _threads() -> dict[str, float]:
    """CPU seconds of each thread of this process (the main thread, the pin thread, ...)."""
    seconds = {stat.parent.name: _cpu_seconds([stat]) for stat in Path("/proc/self/task").glob("*/stat")}
    return {tid: s for tid, s in seconds.items() if s is not None}


def loader_alone(root: Path, w: Workload, workers: int, pin: bool = True,
                 dm_kwargs: dict[str, Any] | None = None) -> LoaderRun:
    """The train loader with no model: each batch to the device and through on_after_batch_transfer; the
    training process's CPU (time.process_time: all its threads) and the workers' (/proc) over the window."""
    device = torch.device(w.device)
    with _loader(root, w, workers, pin, dm_kwargs) as (dm, loader, (warmup, steps), plan):
        batches = stream(loader)
        for _ in range(warmup):
            dm.on_after_batch_transfer(to_device(next(batches), device), 0)
        sync(w.device)
        stats = [Path(f"/proc/{p.pid}/stat") for p in getattr(getattr(loader, "_iterator", None), "_workers", [])]
        t0, cpu0, busy0, threads0 = time.perf_counter(), time.process_time(), _cpu_seconds(stats), _threads()
        images = sum(int(dm.on_after_batch_transfer(to_device(next(batches), device), 0)[0].shape[0])
                     for _ in range(steps))
        sync(w.device)
        seconds, cpu, busy1 = time.perf_counter() - t0, time.process_time() - cpu0, _cpu_seconds(stats)
        threads = [s - threads0.get(tid, 0.0) for tid, s in _threads().items()]
    busy = (busy1 - busy0) / seconds if busy0 is not None and busy1 is not None else None
    return LoaderRun(images / seconds, workers, plan.workers, plan.prefetch, warmup, steps, dm.train_batches(),
                     cpu / seconds, min(max(threads, default=cpu), cpu) / seconds, busy)  # /proc: 10 ms ticks


def end_to_end(root: Path, w: Workload, workers: int, dm_kwargs: dict[str, Any] | None = None) -> tuple[float, float]:
    """(training images/s through the loader, images/s of the same step alone on its last batch, on the device):
    the ceiling's step (fastest precision, channels_last), as bench/gpu/data.py's train_through."""
    device = torch.device(w.device)
    last: list[torch.Tensor] = []
    with _loader(root, w, workers, True, dm_kwargs) as (dm, loader, (warmup, steps), _), \
            cudnn_flags(benchmark=device.type == "cuda"):
        train = TrainStep(make_model(w, num_classes=dm.num_classes), fastest_precision(w), channels_last=True)

        def step(batch) -> int:
            last[:] = dm.on_after_batch_transfer(to_device(batch, device), 0)
            train(*last)
            return int(last[0].shape[0])

        images, seconds = timed_stream(stream(loader), step, replace(w, warmup=warmup, steps=steps))
        alone, _ = rate(lambda: train(*last), int(last[0].shape[0]), w.warmup, w.steps, w.device)
    return images / max(seconds, 1e-9), alone


def decode_per_core(root: Path, w: Workload, seconds: float, dm_kwargs: dict[str, Any] | None = None) -> float:
    """Images/s of one thread running the dataset's own sample path (read, decode, random crop) over its files;
    with --data.decode gpu, the worker's share of it (read, header, box)."""
    dataset = make_dm(root, w, 0, False, dm_kwargs).datasets["train"]
    if hasattr(dataset, "device_crop"):  # --data.decode gpu: a worker only reads, walks the header and draws the box
        def one(i: int, rng: random.Random) -> object:
            return dataset.device_crop(dataset.source.read(i), w.image_size, rng)
    else:
        def one(i: int, rng: random.Random) -> object:
            return dataset.sample(i, w.image_size, rng)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(4):  # untimed: the decoders' first calls
            one(i, random.Random(i))
        t0, count = time.perf_counter(), 0
        while count < 8 or time.perf_counter() - t0 < seconds:
            one(count * 7919 % len(dataset), random.Random(count))  # spread over the files
            count += 1
        return count / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ the rows

def physical_cores() -> int | None:
    """Distinct (package, core) of the CPUs this process may use: fewer than the CPUs with SMT."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return None
    return len(cores)


def _workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


def _loader_check(name: str, run: LoaderRun, pin: bool) -> Check:
    capped = f" (of {run.asked} asked: the memory budget, data.*_budget_gib)" if run.workers < run.asked else ""
    rounds = run.steps // max(1, run.workers)
    crosses = "" if run.warmup + run.steps <= run.epoch else " (the window crosses epochs: more train images)"
    busy = f", the workers {run.workers_cpu:.1f} cores" if run.workers_cpu is not None else ""
    verdict = (f"no model: batches to the device + on_after_batch_transfer; {_workers(run.workers)}{capped}, "
               f"{run.prefetch} batch(es) each in flight, pin_memory {'on' if pin else 'off'}; {run.warmup} warm-up "
               f"batches ({run.prefetch + 1} rounds: start-up, rings and pinned blocks filled) then {run.steps} timed "
               f"({rounds} whole rounds: {rounds} per worker); epoch {run.epoch} batches{crosses}; the training "
               f"process {run.main_cpu:.2f} of a core (busiest thread {run.busiest_thread:.2f}){busy}")
    return Check(GROUP, name, "ok", verdict, run.images_s, f"{run.images_s:,.0f} img/s",
                 {k: v for k, v in run.__dict__.items() if k != "images_s"})


def _loader_rows(root: Path, w: Workload, counts: list[int], dm_kwargs: dict[str, Any] | None,
                 label: str) -> tuple[list[Check], LoaderRun | None]:
    """A row per count, pinned (a count the memory budget runs as another count's is skipped); the fastest run."""
    rows, best = [], None
    for n in counts:
        ran = planned(w, n, dm_kwargs=dm_kwargs)[0]
        name = f"{label}loader alone, {_workers(n)}"
        if ran != n and ran in counts:
            rows.append(Check(GROUP, name, "skipped", f"the memory budget (data.*_budget_gib) runs {ran} for {n} at "
                              f"batch {w.batch_size}, {w.image_size} px: the {_workers(ran)} row"))
            continue
        run = loader_alone(root, w, n, True, dm_kwargs)
        rows.append(_loader_check(name, run, True))
        best = run if best is None or run.images_s > best.images_s else best
    return rows, best


def _cpu_check(name: str, run: LoaderRun) -> Check:
    cores = physical_cores()
    busy = f"; the workers together {run.workers_cpu:.1f} cores" if run.workers_cpu is not None else ""
    return Check(GROUP, name, "ok", f"during the loader-alone row at {_workers(run.workers)}: time.process_time() "
                 "over wall time (all its threads: the main loop, the pin thread), and its busiest thread's "
                 f"(/proc/self/task){busy}; {cpus_per_process(1)} CPUs" + (f" on {cores} cores" if cores else ""),
                 figure=f"{run.main_cpu:.2f} of a core, busiest thread {run.busiest_thread:.2f}",
                 extra={"main_cpu": run.main_cpu, "busiest_thread": run.busiest_thread, "workers_cpu": run.workers_cpu,
                        "physical_cores": cores})


def input_rows(w: Workload, root: Path, counts: list[int] | None = None, dm_kwargs: dict[str, Any] | None = None,
               label: str = "") -> list[Check]:
    """Every row of the group (see the module doc); `label` starts each row's name (rows with other dm_kwargs)."""
    cuda = w.device == "cuda"
    on_device = (dm_kwargs or {}).get("decode") == "gpu"
    per_core = decode_per_core(root, w, 1.5 if cuda else 0.5, dm_kwargs)  # first: on an idle machine
    rows, best = _loader_rows(root, w, counts or worker_counts(cuda), dm_kwargs, label)
    if best is None:
        return rows
    n, ceiling = best.workers, per_core * best.workers
    unpinned = loader_alone(root, w, n, False, dm_kwargs)
    rows.append(_loader_check(f"{label}loader alone, {_workers(n)}, pin_memory off", unpinned, False))
    rows[-1].verdict = ("" if cuda else "no CUDA: nothing is pinned either way; ") + rows[-1].verdict
    e2e, alone = end_to_end(root, w, n, dm_kwargs)
    rows += [Check(GROUP, f"{label}end-to-end, {_workers(n)}", "ok", f"the ceiling's step ({w.arch}, "
                   f"{fastest_precision(w)}, channels_last) fed by the loader, the same window ({best.warmup} + "
                   f"{best.steps} batches)", e2e, f"{e2e:,.0f} img/s, {e2e / best.images_s:.0%} of the loader alone"),
             Check(GROUP, f"{label}step alone", "ok", "the same step, model and precision on its last real batch, "
                   f"already on the device: {w.warmup} + {w.steps} steps", alone, f"{alone:,.0f} img/s"),
             Check(GROUP, f"{label}{PER_CORE[on_device]}, one core", "ok", "one process, one thread "
                   f"(torch.set_num_threads(1)): {PER_CORE_HOW[on_device]} over the train files, {w.image_size} px; x "
                   f"{_workers(n)} = the workers' CPU ceiling, if each had a core to itself", per_core,
                   f"{per_core:,.0f} img/s; x {n} = {ceiling:,.0f} img/s", {"decode_ceiling": ceiling}),
             _cpu_check(f"{label}training process CPU", best)]
    limit, why = name_limit(Figures(best.images_s, unpinned.images_s if cuda else None, e2e, alone, ceiling,
                                    best.busiest_thread))
    rows.append(Check(GROUP, f"{label}VERDICT", "ok", why, figure=limit, extra={"limit": limit}))
    for row in rows:  # said as each attribution ends: a part stopped at its timeout keeps them in its log
        print(f"input: {row.name}: {row.figure}; {row.verdict}", flush=True)
    return rows


def best_workers(checks: list[Check]) -> int | None:
    """The worker count of the fastest loader-alone row (pinned, CPU path) among `checks`, if one ran."""
    runs = [c for c in checks if c.group == GROUP and c.status == "ok" and c.name.startswith("loader alone")
            and "pin_memory off" not in c.name and c.images_s]
    return max(runs, key=lambda c: c.images_s).extra["workers"] if runs else None
