"""The checks of `bench gpu`: one training step per path, its verdict against a reference, and its rate.

Every step is plain PyTorch on synthetic batches already on the device (no loader), so a row measures
the path it names. Each check returns a `Check`; one that cannot run here is skipped with its reason.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models import create_model

NUM_CLASSES = 10


@dataclass
class Check:
    group: str                      # compute ceiling | backend | DALI mixed | precision | speed flag | dp | DDP
    name: str
    status: str = "ok"              # ok | FAIL | skipped
    verdict: str = ""               # what was compared and against what tolerance, or the skip reason
    images_s: float | None = None
    figure: str = ""                # the row's headline figure, formatted
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Workload:
    arch: str = "resnet50"
    image_size: int = 224
    batch_size: int = 128
    warmup: int = 5
    steps: int = 20
    device: str = "cuda"
    precision: str | None = None    # the ceiling's (the faster AMP measured); None: fastest_precision's guess


def amp_dtype() -> torch.dtype:
    """The AMP dtype a user of this GPU would pick: bf16 where supported, else fp16."""
    return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16


def synthetic_batch(w: Workload, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w.batch_size, 3, w.image_size, w.image_size, generator=g)
    y = torch.randint(0, NUM_CLASSES, (w.batch_size,), generator=g)
    return x.to(w.device), y.to(w.device)


def make_model(w: Workload, seed: int = 0, num_classes: int = NUM_CLASSES) -> nn.Module:
    torch.manual_seed(seed)
    return create_model(w.arch, num_classes=num_classes, image_size=w.image_size).to(w.device)


class TrainStep:
    """model + SGD + the precision: `step(x, y)` runs forward, backward and the optimizer; returns the loss."""

    def __init__(self, model: nn.Module, precision: str = "32-true", channels_last: bool = False) -> None:
        self.model, self.channels_last = model, channels_last
        if channels_last:
            model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
        self.device_type = next(model.parameters()).device.type
        # GradScaler only for fp16 (bf16 has fp32's range): what Lightning's MixedPrecision plugin does.
        self.scaler = torch.amp.GradScaler(self.device_type) if self.dtype is torch.float16 else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device_type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        return loss.detach()


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for the rendezvous of the processes a check spawns."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sync(device: str) -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rate(step: Callable[[], Any], images: int, warmup: int, steps: int, device: str) -> tuple[float, float]:
    """(images/s, seconds of the warm-up) of `step` called `warmup` then `steps` times, synchronized."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    t1 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return images * steps / max(time.perf_counter() - t1, 1e-9), t1 - t0


@contextlib.contextmanager
def cudnn_flags(benchmark: bool = False, tf32: bool | None = None):
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = benchmark
    if tf32 is not None:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# ------------------------------------------------------------------------------ compute ceiling

def fastest_precision(w: Workload) -> str:
    """What the backend rows and speed flags train with: the ceiling's precision where it was measured in this
    run, else AMP (bf16, else fp16) on CUDA; 32-true on a CPU."""
    if not w.device.startswith("cuda"):
        return "32-true"
    return w.precision or ("bf16-mixed" if amp_dtype() is torch.bfloat16 else "16-mixed")


def compute_ceiling(w: Workload) -> Check:
    """ResNet-50 (or --arch) training steps on one synthetic on-device batch, in the fastest setting this
    template offers: channels_last, cudnn.benchmark, and each AMP precision the GPU has (bf16 is not always the
    faster: on an H200 with torch 2.11, 16-mixed outran it), the faster one kept and recorded in `w.precision`
    for the rows that share this ceiling. On a CPU: 32-true, channels_last."""
    cuda = w.device.startswith("cuda")
    candidates = ["32-true"] if not cuda else ["16-mixed"] + (["bf16-mixed"] if torch.cuda.is_bf16_supported() else [])
    x, y = synthetic_batch(w)
    rates = {}
    with cudnn_flags(benchmark=cuda):
        for precision in candidates:
            step = TrainStep(make_model(w), precision, channels_last=True)
            rates[precision], _ = rate(lambda s=step: s(x, y), w.batch_size, w.warmup, w.steps, w.device)
    precision = max(rates, key=rates.get)
    w.precision, ips = precision, rates[precision]
    others = "; ".join(f"{p} {r:,.0f} img/s" for p, r in rates.items() if p != precision)
    how = (f"{w.arch} at {w.image_size} px, batch {w.batch_size}, {precision}, channels_last"
           + (", cudnn.benchmark" if cuda else "") + (f" (the faster; {others})" if others else ""))
    return Check("compute ceiling", "compute ceiling", verdict=f"synthetic on-device batches: {how}", images_s=ips,
                 figure=f"{ips:,.0f} img/s", extra={"precision": precision, "rates": rates})


# ------------------------------------------------------------------------------ precision

def precision_steps(w: Workload, tolerance: float = 0.05) -> list[Check]:
    """16-mixed and bf16-mixed against 32-true with TF32, what fp32 training runs at on Ampere and later
    (cuDNN convolutions use TF32 by default, torch.backends.cudnn.allow_tf32; matmuls with
    `model.matmul_precision: high`); 32-true with TF32 off would overstate AMP's gain about twofold.
    Each row's first loss (the same weights and batch) agrees with strict fp32 (TF32 off, untimed) within
    `tolerance` (relative), every loss stays finite, and fp16's GradScaler scale stays finite and > 0."""
    x, y = synthetic_batch(w)
    with cudnn_flags(benchmark=False, tf32=False):
        strict = float(TrainStep(make_model(w), "32-true")(x, y))
    checks, base = [], None
    for precision, name in (("32-true", "32-true (TF32)"), ("16-mixed", "16-mixed"), ("bf16-mixed", "bf16-mixed")):
        if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
            checks.append(Check("precision", name, "skipped", "this GPU has no bf16"))
            continue
        with cudnn_flags(benchmark=False, tf32=True):
            step = TrainStep(make_model(w), precision)
            losses = [step(x, y)]  # the first step: the same weights for every precision
            # losses stay on the device until the end: a float() per step would sync and slow the timed loop
            ips, _ = rate(lambda s=step, out=losses: out.append(s(x, y)), w.batch_size, w.warmup, w.steps, w.device)
            losses = [float(v) for v in losses]
        scale = float(step.scaler.get_scale()) if step.scaler is not None else None
        base = base or ips
        first = abs(losses[0] - strict) / max(abs(strict), 1e-6)
        finite = all(math.isfinite(v) for v in losses)
        ok = finite and first <= tolerance and (scale is None or (math.isfinite(scale) and scale > 0))
        verdict = (f"losses finite: {finite}; first loss {losses[0]:.4f} vs strict fp32 {strict:.4f} "
                   f"(relative {first:.1e}, tolerance {tolerance})"
                   + (f"; GradScaler scale {scale:g}" if scale is not None else ""))
        checks.append(Check("precision", name, "ok" if ok else "FAIL", verdict, ips,
                            f"{ips:,.0f} img/s, {ips / base:.2f}x 32-true (TF32)",
                            {"losses": losses[:3] + losses[-1:], "scale": scale}))
    return checks


# ------------------------------------------------------------------------------ speed flags

def speed_flags(w: Workload) -> list[Check]:
    """channels_last, cudnn.benchmark and compile, each alone against the plain AMP step (the ceiling's AMP)."""
    precision = fastest_precision(w)
    x, y = synthetic_batch(w)
    checks, base = [], None
    for name, channels_last, benchmark, compiled in (("plain (AMP)", False, False, False),
                                                     ("channels_last", True, False, False),
                                                     ("cudnn.benchmark", False, True, False),
                                                     ("compile", False, False, True)):
        try:
            with cudnn_flags(benchmark=benchmark):
                model = make_model(w)
                if compiled:
                    model.compile()  # as ImageClassifier.configure_model: in place
                step = TrainStep(model, precision, channels_last=channels_last)
                loss = []
                ips, warm_s = rate(lambda s=step, out=loss: out.append(s(x, y)), w.batch_size, w.warmup, w.steps,
                                   w.device)
                loss = [float(v) for v in loss]
        except Exception as e:  # noqa: BLE001 - a path that fails is a FAIL row with the error
            checks.append(Check("speed flag", name, "FAIL", f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        base = base or ips
        finite = all(math.isfinite(v) for v in loss)
        checks.append(Check("speed flag", name, "ok" if finite else "FAIL",
                            f"{precision}; losses finite: {finite}; warm-up {warm_s:.1f} s" +
                            (" (includes compiling)" if compiled else ""), ips,
                            f"{ips:,.0f} img/s, {ips / base:.2f}x plain"))
    return checks
