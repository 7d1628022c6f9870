"""`bench gpu --groups trace`, the A/B rows: the same `--data.decode gpu` fit, unprofiled, with the decode side
stream's priority at -1 (the default) and at 0, and with CUDA's blocking sync instead of its spin-wait.

The priority travels by FIC_DECODE_STREAM_PRIORITY (read where datamodules/sample/device_decode.py makes its side
stream) and is read back from the decoder's stream (`torch.cuda.Stream.priority`): an arm whose stream did not get
the priority asked is a FAIL, not a comparison. The sync flag is the process's: `cudaSetDeviceFlags(
cudaDeviceScheduleBlockingSync)` (0x04, driver_types.h) on the libcudart torch loaded (nvidia/*/lib; torchvision's
own copy shares the device's primary context, whose flags these are), called before the CUDA context exists, so
that arm runs in a process of its own (`python -m bench.gpu.trace_ab SPEC OUT`) and reads the flag back with
cudaGetDeviceFlags. Under the default (cudaDeviceScheduleAuto, cuda_runtime_api.h) a process with fewer contexts
than CPUs spins in every wait; with blocking sync the waiting thread sleeps, so the decode thread's CPU time in its
ranges (trace_clock.py) is then its real host work.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.gpu.checks import Check, Workload

REPO = Path(__file__).resolve().parents[2]
AB_STEPS = 20  # timed steps an arm (after the trace's warm-up)
SUBPROCESS_S = 240
BLOCKING_SYNC, SCHEDULE_MASK = 0x04, 0x07  # driver_types.h: cudaDeviceScheduleBlockingSync, cudaDeviceScheduleMask
SCHEDULES = {0: "auto", 1: "spin", 2: "yield", 4: "blocking sync"}
ARMS = (("A/B: side stream priority -1, default sync (the default)", -1, False),
        ("A/B: side stream priority 0", 0, False),
        ("A/B: blocking sync, priority -1", -1, True))
NAMES = [name for name, _, _ in ARMS]


def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (not torchvision's bundled copy), else the one of torch's CUDA version."""
    import torch

    from bench.gpu.engines import mapped_libraries

    loaded = [p for p in mapped_libraries("libcudart") if "torchvision" not in p]
    try:
        if loaded:
            return ctypes.CDLL(loaded[0])
        return ctypes.CDLL(f"libcudart.so.{(torch.version.cuda or '0').split('.')[0]}") if torch.version.cuda else None
    except OSError:
        return None


def schedule(lib: ctypes.CDLL | None) -> str:
    """The device's scheduling flag as cudaGetDeviceFlags reads it, or why it cannot be read."""
    if lib is None:
        return "not read: no libcudart"
    flags = ctypes.c_uint()
    status = lib.cudaGetDeviceFlags(ctypes.byref(flags))
    return SCHEDULES.get(flags.value & SCHEDULE_MASK, hex(flags.value)) if status == 0 else \
        f"not read: cudaGetDeviceFlags returned {status}"


def set_blocking_sync(lib: ctypes.CDLL | None) -> str | None:
    """Blocking sync for this process's device (call before anything makes the CUDA context); None when set, else
    why not."""
    if lib is None:
        return "no libcudart to call"
    lib.cudaSetDeviceFlags.argtypes = [ctypes.c_uint]
    status = lib.cudaSetDeviceFlags(BLOCKING_SYNC)
    return None if status == 0 else f"cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) returned {status}"


def run_arm(w: Workload, root: Path, num_workers: int, priority: int) -> dict:
    """One arm's fit in this process: its window's figures (trace.Window), the priority asked and the schedule."""
    from bench.gpu.trace import PRIORITY_ENV, Window, decode_fit
    from bench.gpu.trace_clock import RangeClock

    before = os.environ.get(PRIORITY_ENV)
    os.environ[PRIORITY_ENV] = str(priority)
    try:
        window = Window(w.warmup, w.steps, w.device == "cuda", RangeClock())
        decode_fit(w, root, num_workers, window)
    finally:
        if before is None:
            del os.environ[PRIORITY_ENV]
        else:
            os.environ[PRIORITY_ENV] = before
    return {**window.figures, "priority_asked": priority,
            "schedule": schedule(cudart()) if w.device == "cuda" else "no CUDA"}


def run_arm_in_a_process(w: Workload, root: Path, num_workers: int, priority: int) -> dict:
    spec = json.dumps({"workload": w.__dict__, "root": str(root), "num_workers": num_workers, "priority": priority})
    with tempfile.TemporaryDirectory(prefix="trace-ab-") as tmp:
        out = Path(tmp) / "arm.json"
        proc = subprocess.run([sys.executable, "-m", "bench.gpu.trace_ab", spec, str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=SUBPROCESS_S, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"the blocking-sync arm's process exited {proc.returncode}: {' | '.join(tail)}")
        return json.loads(out.read_text())


def _row(name: str, arm: dict, base: dict | None, cuda: bool, blocking: bool) -> Check:
    ranges = "; ".join(f"{k} {v['wall_ms']:.1f} ms a batch, its thread's CPU {v['cpu_ms']:.1f} ms"
                       for k, v in arm["ranges"].items()) or "no decode range timed"
    waits = arm.get("waits")
    said = (f"{arm['steps']} steps after {arm['warmup']}; {ranges}; "
            + (f"the decode thread waited {waits['workers']:.0%} for the workers, {waits['step']:.0%} for the step; "
               if waits else "")
            + f"side stream priority asked {arm['priority_asked']}, read back {arm['priority']}; "
              f"sync: {arm['schedule']}")
    problems = []
    if cuda and arm["priority"] is not None and arm["priority"] != arm["priority_asked"]:
        problems.append("the side stream did not get the priority asked")
    if cuda and blocking and arm.get("blocking_set"):
        problems.append(arm["blocking_set"])
    elif not cuda and blocking:
        said += f" ({arm.get('blocking_set') or 'set'}: no CUDA here)"
    ratio = f", {arm['images_s'] / base['images_s']:.2f}x the default" if base and base is not arm else ""
    return Check("trace", name, "FAIL" if problems else "ok", "; ".join(problems + [said]), arm["images_s"],
                 f"{arm['images_s']:,.0f} img/s{ratio}", arm)


def ab_rows(w: Workload, root: Path, num_workers: int) -> list[Check]:
    """Each arm of ARMS (see the module doc), its row said as it ends."""
    cuda = w.device == "cuda"
    w = replace(w, steps=AB_STEPS if cuda else w.steps)
    rows, base = [], None
    for name, priority, blocking in ARMS:
        try:
            arm = (run_arm_in_a_process if blocking else run_arm)(w, root, num_workers, priority)
        except Exception as e:  # noqa: BLE001 - one arm's failure is its row, the others stand
            rows.append(Check("trace", name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        arm.update(steps=w.steps, warmup=w.warmup)
        base = base or arm
        rows.append(_row(name, arm, base, cuda, blocking))
        print(f"trace: {name}: {rows[-1].figure}; {rows[-1].verdict}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    """The blocking-sync arm: SPEC (JSON: workload, root, num_workers, priority) -> OUT (JSON)."""
    lib = cudart()  # torch imported, no CUDA context yet: the flag can still be set
    refused = set_blocking_sync(lib)
    spec, out = json.loads(argv[0]), Path(argv[1])
    arm = run_arm(Workload(**spec["workload"]), Path(spec["root"]), spec["num_workers"], spec["priority"])
    arm["blocking_set"] = refused
    out.write_text(json.dumps(arm))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
