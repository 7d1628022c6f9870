"""The `powersgd` rows of `bench gpu`: what the PowerSGD hook costs a step on one GPU, against no hook.

A group of one process still runs DDP's whole hook path: compress, the all-reduces of P and Q (on a group of one),
and decompress, which calls torch.cuda.synchronize once per gradient bucket
(torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, powerSGD_hook's `decompress`). So the drain has a
figure without a second GPU; what PowerSGD saves on the wire does not show here (nothing crosses it). Rows: no hook
at torch's bucket size, PowerSGD (the strategy's hook, lightning_app/strategies/powersgd_state.py) at torch's
bucket size and at the larger one the strategy takes with it (ClusterDDPStrategy, POWERSGD_BUCKET_CAP_MB), each
timed after PowerSGD's plain all-reduce steps are over.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

from bench.gpu.checks import Check, TrainStep, Workload, free_port, make_model, rate, synthetic_batch

GROUP = "PowerSGD"
TORCH_BUCKET_MB = 25  # DistributedDataParallel's bucket_cap_mb default


def cases() -> list[tuple[str, str, float]]:
    from lightning_app.strategies.ddp import POWERSGD_BUCKET_CAP_MB

    return [("no hook", "none", TORCH_BUCKET_MB), (f"PowerSGD, {TORCH_BUCKET_MB} MB buckets", "powersgd",
                                                   TORCH_BUCKET_MB),
            (f"PowerSGD, {POWERSGD_BUCKET_CAP_MB:g} MB buckets", "powersgd", POWERSGD_BUCKET_CAP_MB)]


def _worker(rank: int, port: int, w: Workload, backend: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from lightning_app.strategies import comm_hooks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if cuda else None)
    found = {}
    try:
        x, y = synthetic_batch(w)
        precision = w.precision or "32-true"
        for name, hook_name, bucket_mb in cases():
            model = make_model(w)
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None,
                                                      bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
            hook, state = comm_hooks.build(hook_name, 4, 2)  # rank 4, compressing from step 2 (the warm-up's)
            if state is not None:
                state.name_parameters(model)
                state.one_bucket_at_a_time = not cuda  # as the strategy sets it (ClusterDDPStrategy)
                ddp.register_comm_hook(state, hook)
            step = TrainStep(ddp, precision, channels_last=cuda)
            ips, _ = rate(lambda step=step: step(x, y), w.batch_size, max(w.warmup, 3), w.steps, w.device)
            found[name] = ips
            del ddp, model, step
            if cuda:
                torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


def powersgd_rows(w: Workload, backend: str = "nccl") -> list[Check]:
    """One process, one device: a training step's images/s with each case; `backend="gloo"` runs it on a CPU
    (what the test suite does)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if backend == "nccl" and not dist.is_nccl_available():
        return [Check(GROUP, name, "skipped", "this torch build has no NCCL") for name, _, _ in cases()]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "powersgd.json")
        mp.spawn(_worker, args=(free_port(), w, backend, out), nprocs=1, join=True)
        with open(out) as f:
            found = json.load(f)
    plain = found["no hook"]
    rows = []
    for name, _, bucket_mb in cases():
        ips = found[name]
        share = "" if name == "no hook" else f", {ips / plain:.2f}x the step without a hook"
        rows.append(Check(GROUP, name, "ok", f"DDP on a group of 1 ({backend}), {bucket_mb:g} MB buckets, "
                          f"{w.precision or '32-true'}{share}", ips, f"{ips:,.0f} img/s"))
    return rows
