"""The parallel rows of `bench gpu`: dp (one process, DataParallel) and DDP (NCCL, every GPU of the node).

Each compares one step's gradients with a single device or process on the same batch (fp32, no TF32,
eval-mode BatchNorm so every shard computes the same function), then times or measures the path.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from bench.gpu.checks import Check, TrainStep, Workload, cudnn_flags, free_port, make_model, rate, sync, synthetic_batch

# ------------------------------------------------------------------------------ dp

def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten().cpu() for p in model.parameters() if p.grad is not None])


def dp_check(w: Workload, tolerance: float = 1e-3) -> Check:
    """One step through the dp strategy's DataParallel view vs a single device: the same weights and batch,
    BatchNorm from running statistics (eval mode, so every GPU's chunk computes the same function), fp32
    without TF32; the gradients' relative difference |g_dp - g| / |g| (all parameters as one vector) <= tolerance."""
    from lightning_app.strategies import DataParallelView

    n = torch.cuda.device_count()
    if n < 2:
        return Check("dp", f"dp over {n} GPU", "skipped", f"DataParallel needs >= 2 CUDA GPUs ({n} here)")
    x, y = synthetic_batch(w)
    with cudnn_flags(benchmark=False, tf32=False):
        grads = []
        for parallel in (False, True):
            model = make_model(w).eval()
            view = DataParallelView(model, list(range(n))) if parallel else model
            model.zero_grad(set_to_none=True)
            F.cross_entropy(view(x), y).backward()
            grads.append(_grads(model))
        ref, got = grads
        diff = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        model.train()
        step = TrainStep(model)
        step.model = view  # the DataParallel view runs the forward; the optimizer updates the one model
        ips, _ = rate(lambda: step(x, y), w.batch_size, w.warmup, w.steps, w.device)
    ok = diff <= tolerance
    return Check("dp", f"dp over {n} GPUs", "ok" if ok else "FAIL",
                 f"gradients vs one device: relative difference {diff:.1e} (tolerance {tolerance:g}, fp32, no TF32)",
                 ips, f"{ips:,.0f} img/s (32-true)", {"grad_rel_diff": diff})


# ------------------------------------------------------------------------------ DDP over NCCL

def _ddp_worker(rank: int, world: int, port: int, w: Workload, mb: int, out: str, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            device_id=torch.device(device) if cuda else None)
    try:
        # all-reduce bus bandwidth, as nccl-tests reports it: size / time x 2 (n - 1) / n
        buf = torch.ones(mb * 2**20 // 4, device=device)
        for _ in range(5):
            dist.all_reduce(buf)
        sync(device)
        t0, reps = time.perf_counter(), 20
        for _ in range(reps):
            dist.all_reduce(buf)
        sync(device)
        seconds = (time.perf_counter() - t0) / reps
        busbw = buf.numel() * 4 / seconds * 2 * (world - 1) / world / 1e9
        # one DDP step on this rank's share of the global batch vs one process on the whole batch
        local = Workload(**{**asdict(w), "device": device})
        x, y = synthetic_batch(local)  # the same global batch on every rank
        share = w.batch_size // world
        with cudnn_flags(benchmark=False, tf32=False):
            model = make_model(local).eval()
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
            F.cross_entropy(ddp(x[rank * share:(rank + 1) * share]), y[rank * share:(rank + 1) * share]).backward()
            got = _grads(model)
            diff = None
            if rank == 0:
                single = make_model(local).eval()
                F.cross_entropy(single(x[:share * world]), y[:share * world]).backward()
                ref = _grads(single)
                diff = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        if rank == 0:
            import json

            with open(out, "w") as f:
                json.dump({"busbw_gb_s": busbw, "grad_rel_diff": diff, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def ddp_check(w: Workload, mb: int = 256, tolerance: float = 1e-3, processes: int | None = None,
              backend: str = "nccl") -> Check:
    """NCCL over every GPU of the node: all-reduce bus bandwidth, and a DDP step's gradients against one
    process on the same global batch (eval-mode BatchNorm, fp32 without TF32). `backend="gloo"` with
    `processes` runs the same check on CPUs (what the test suite does)."""
    import json
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    n = processes or torch.cuda.device_count()
    if n < 2:
        return Check("DDP", "NCCL DDP", "skipped", f"DDP over NCCL needs >= 2 CUDA GPUs ({n} here)")
    if backend == "nccl" and not dist.is_nccl_available():
        return Check("DDP", "NCCL DDP", "skipped", "this torch build has no NCCL")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        try:
            mp.spawn(_ddp_worker, args=(n, port, w, mb, out, backend), nprocs=n, join=True)
        except Exception as e:  # noqa: BLE001 - a failing path is a FAIL row with its error
            return Check("DDP", f"{backend.upper()} DDP x{n}", "FAIL", f"{type(e).__name__}: {str(e)[-300:]}")
        with open(out) as f:
            got = json.load(f)
    diff = got["grad_rel_diff"]
    ok = diff is not None and diff <= tolerance
    return Check("DDP", f"{backend.upper()} DDP x{n}", "ok" if ok else "FAIL",
                 f"{n} processes; DDP step vs one process on the same global batch: gradients' relative "
                 f"difference {diff:.1e} (tolerance {tolerance:g}); all-reduce of {mb} MiB", None,
                 f"{got['busbw_gb_s']:,.1f} GB/s bus bandwidth", got)
