"""Where a DALI CPU pipeline's time goes: DALI's own train pipeline cut after each step, on all usable cores.

Each cut is a DALI pipeline of its own (same files, same threads, CPU decoding), run for a few
batches after a warm-up: reading + random-crop decoding only, then + DALI's resize, then DALI's
whole train pipeline (+ flip and the uint8 output). The drop between two cuts is what that step
costs. The first cut is what the DALI CPU backend runs in DALI; it resizes on the host instead
(datamodules/dali_pipelines.py), because DALI's CPU resize costs more than its decoding.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from datamodules.cpus import usable_cpus


def dali_stage_rates(files: Sequence[str], image_size: int = 224, min_scale: float = 0.25, batch_size: int = 64,
                     batches: int = 20, threads: int | None = None) -> dict[str, float]:
    """Images/s of each cut of DALI's CPU train pipeline (warm cache)."""
    from nvidia.dali import fn, pipeline_def, types

    from datamodules.dali_pipelines import PipelineSpec, file_pipeline

    threads = threads or usable_cpus()
    files = list(files)

    @pipeline_def
    def cut(resize: bool):
        encoded, _ = fn.readers.file(files=files, random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(encoded, device="cpu", output_type=types.RGB,
                                               random_area=[min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        if resize:
            images = fn.resize(images, resize_x=image_size, resize_y=image_size,
                               interp_type=types.INTERP_LINEAR, antialias=True)
        return images

    spec = PipelineSpec(train=True, decoder_device="cpu", image_size=image_size, val_resize=image_size,
                        min_scale=min_scale, fp16=False, hw_decoder_load=0.0)
    kw = {"batch_size": batch_size, "num_threads": threads, "device_id": None, "seed": 0}
    pipes = {
        "read + random-crop decode": cut(False, **kw),
        "+ resize (antialiased linear)": cut(True, **kw),
        "+ flip, uint8 HWC out (all in DALI)": file_pipeline(spec, files, list(range(len(files))), 0, 1, **kw),
    }
    out = {}
    for name, pipe in pipes.items():
        pipe.build()
        for _ in range(3):
            pipe.run()
        t0 = time.perf_counter()
        for _ in range(batches):
            pipe.run()
        out[name] = batches * batch_size / (time.perf_counter() - t0)
        del pipe
    return out
