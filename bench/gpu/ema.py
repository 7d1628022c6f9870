"""`bench gpu --groups ema`: the EMA callback's host syncs on CUDA (lightning_app/callbacks/ema.py).

Two fits of the trainer group's synthetic step (16-mixed + channels_last, the batch already on the device): without
EMA, and with `DelayedStartEMA` updating the average after every step. The window's host syncs are counted by
CUDA's sync debug mode (torch.cuda.set_sync_debug_mode("warn"): a warning at every synchronising call torch makes,
torch/cuda/__init__.py; bench/gpu/trainer.py StepClock); the first update (a copy) falls in the warm-up. EMA must add
none: its update keeps its count on the host and moves the tensors in one `torch._foreach_lerp_`. On a CPU
(--allow-cpu) both fits run and nothing is counted: there is no device to wait for.
"""
from __future__ import annotations

from bench.gpu.checks import Check, Workload

GROUP = "ema"
NAMES = ["synthetic step, no EMA", "synthetic step + EMA (DelayedStartEMA, an update every step)"]


def judge(without: float, with_ema: float) -> tuple[str, str]:
    """(status, words) from the host syncs a step without and with EMA: EMA must add none."""
    added = with_ema - without
    return ("FAIL", f"EMA adds {added:g} host syncs a step") if added > 0 else ("ok", "EMA adds no host sync")


def ema_rows(w: Workload) -> list[Check]:
    from bench.gpu.trainer import SyntheticData, fit_rate
    from lightning_app.callbacks.ema import DelayedStartEMA

    cuda = w.device == "cuda"
    precision = "16-mixed" if cuda else "32-true"
    clocks = [fit_rate(w, SyntheticData(w, w.warmup + w.steps), precision, True, False, callbacks)
              for callbacks in ([], [DelayedStartEMA(decay=0.999)])]
    per_step = [clock.syncs / w.steps for clock in clocks]
    rows = []
    for name, clock, syncs in zip(NAMES, clocks, per_step, strict=True):
        images_s = w.batch_size * w.steps / clock.seconds
        rows.append(Check(GROUP, name, "ok", f"{precision}, channels_last, {w.warmup} + {w.steps} steps; "
                          + (f"{syncs:g} host syncs a step (CUDA's sync debug mode)" if cuda else
                             "no CUDA: syncs not counted"), images_s, f"{images_s:,.0f} img/s",
                          {"syncs_per_step": syncs if cuda else None}))
    if cuda:
        status, said = judge(*per_step)
        rows[1].status, rows[1].verdict = status, f"{said}; {rows[1].verdict}"
    for row in rows:
        print(f"ema: {row.name}: {row.figure}; {row.verdict}", flush=True)
    return rows
