"""Where a DALI CPU pipeline's time goes: the DALI CPU backend's pipeline against DALI's own whole one.

Both are `datamodules.dali.pipelines.file_pipeline` on the same files and threads, run for a few
batches after a warm-up:
- `resize_on_host`: read, random-crop decode and the flip coin, what the DALI CPU backend runs
  in DALI (the sample path's kernel then resizes on the host);
- DALI's own train pipeline: the same, plus DALI's CPU resize, the flip and the uint8 output.
The drop between the two is what DALI's resize (and flip) costs; that drop is why the backend
resizes on the host.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from datamodules.budget.cpus import usable_cpus


def dali_stage_rates(files: Sequence[str], image_size: int = 224, min_scale: float = 0.25, batch_size: int = 64,
                     batches: int = 20, threads: int | None = None) -> dict[str, float]:
    """Images/s of DALI's CPU train pipeline with and without its own resize (warm cache)."""
    from datamodules.dali.pipelines import PipelineSpec, file_pipeline

    files = list(files)
    spec = PipelineSpec(train=True, decoder_device="cpu", image_size=image_size, val_resize=image_size,
                        min_scale=min_scale, fp16=False, hw_decoder_load=0.0)
    kw = {"batch_size": batch_size, "num_threads": threads or usable_cpus(), "device_id": None, "seed": 0}
    specs = {
        "read + random-crop decode (the DALI CPU backend's part)": dataclasses.replace(spec, resize_on_host=True),
        "+ DALI's resize, flip, uint8 out (DALI's own pipeline)": spec,
    }
    out = {}
    for name, cut in specs.items():
        pipe = file_pipeline(cut, files, list(range(len(files))), 0, 1, **kw)
        pipe.build()
        for _ in range(3):
            pipe.run()
        t0 = time.perf_counter()
        for _ in range(batches):
            pipe.run()
        out[name] = batches * batch_size / (time.perf_counter() - t0)
        del pipe
    return out
