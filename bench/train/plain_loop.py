"""The hand-written PyTorch loop `bench train` compares the template with: same model, data, batch and precision.

Run by `bench train` as `python -m bench.train.plain_loop SPEC.json`; it writes its per-epoch
times as JSON to the file named by $BENCH_EPOCH_TIMES. It is also the one-page twin of a fit's step
(docs/design.md, "One step in one page"): the template's Index, dataset and batches, and a plain loop.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

TIMES_ENV = "BENCH_EPOCH_TIMES"  # where a run writes its per-epoch times (the Lightning rows too)


def plain_loop(spec: dict) -> dict:
    """The same training, by hand: DataLoader, model, SGD + warm-up/cosine, autocast. No Lightning."""
    import numpy as np
    import torch.nn.functional as F

    from bench.progress_bars import report_step
    from datamodules import ImageFolderDataModule
    from datamodules.sample.batches import SampleLoader, built_batch
    from datamodules.sample.transforms import normalize
    from lightning_app.lr_schedule import warmup_cosine
    from models import create_model

    seed = spec["seed"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dm = ImageFolderDataModule(data_dir=spec["root"], batch_size=spec["batch_size"], num_workers=spec["num_workers"],
                               image_size=spec["image_size"], val_image_size=spec["image_size"],
                               min_scale=spec["min_scale"], val_crop_ratio=spec["val_crop_ratio"])
    dm.setup("fit")
    workers = spec["num_workers"]
    # The template's own sample path (a worker builds whole batches), so only the training loop differs.
    loader = SampleLoader(dm.datasets["train"], batch_size=spec["batch_size"], shuffle=True, drop_last=True,
                        collate_fn=built_batch, num_workers=workers, pin_memory=device.type == "cuda",
                        persistent_workers=workers > 0,
                        prefetch_factor=4 if workers > 0 else None)
    kw = {"width": spec["width"]} if spec["arch"] == "conv11" else {}
    model = create_model(spec["arch"], num_classes=dm.num_classes, image_size=spec["image_size"], **kw).to(device)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": spec["weight_decay"]},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=spec["lr"] * spec["batch_size"] / 256, momentum=spec["momentum"],
                          nesterov=spec["nesterov"])
    total = len(loader) * spec["epochs"]
    warmup = min(total - 1, int(spec["warmup_epochs"] * total / spec["epochs"]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, total))
    precision = spec["precision"]
    if precision == "16-mixed" and device.type == "cpu":
        precision = "bf16-mixed"
    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    torch.backends.cudnn.benchmark = spec["benchmark"]
    model.train()
    epochs = []
    for epoch in range(spec["epochs"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, images, wait, steps = time.perf_counter(), 0, 0.0, 0
        loss_sum = torch.zeros((), device=device)  # read once, at the epoch's end: no host sync per step
        it = iter(loader)
        while True:
            t_wait = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - t_wait
            x = normalize(x.to(device, non_blocking=True))
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y, label_smoothing=spec["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            sched.step()
            loss_sum += loss.detach().float()
            images += x.shape[0]
            steps += 1
            report_step(f"epoch {epoch + 1}/{spec['epochs']}, step {steps}/{len(loader)}")
        if device.type == "cuda":
            torch.cuda.synchronize()
        epochs.append({"seconds": time.perf_counter() - t0, "wait": wait, "images": images,
                       "loss": float(loss_sum) / max(1, steps)})
        if not math.isfinite(float(loss)):
            raise RuntimeError("the hand-written loop diverged (loss is not finite)")
    return {"epochs": epochs, "world_size": 1}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("internal entry point: use `python -m bench train`")
    out = plain_loop(json.loads(Path(sys.argv[1]).read_text()))
    Path(os.environ[TIMES_ENV]).write_text(json.dumps(out))
