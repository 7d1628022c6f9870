"""What the device decode says at the end of a run: where its thread waited (`Waits`) and the line (`decode_line`)."""
from __future__ import annotations

from typing import Any


class Waits:
    """Seconds the stage's thread spent waiting for the workers' next batch, building a batch on the device, and
    waiting for the step to take the batch it built; and the batches. The device's part split three ways: the
    batched JPEG decode (the call blocks until its private stream is done), the crops and resizes (launches), and
    the host's wait, before each decode, for the resize of the batch before last (device_decode.py: its decoded
    images go back to the allocator only then)."""

    def __init__(self) -> None:
        self.workers = self.device = self.step = 0.0
        self.jpeg = self.crop = self.previous = 0.0
        self.batches = 0

    def device_shares(self) -> dict[str, float]:
        total = self.jpeg + self.crop + self.previous
        return {k: getattr(self, k) / total if total else 0.0 for k in ("jpeg", "crop", "previous")}

    def shares(self) -> dict[str, float]:
        total = self.workers + self.device + self.step
        return {k: getattr(self, k) / total if total else 0.0 for k in ("workers", "device", "step")}


def decode_line(decoders: dict[str, Any]) -> str | None:
    """The end-of-run words on --data.decode gpu, from the `DeviceDecode`s by split (the training loader's, else
    any): how much the workers decoded, what an image cost each half, where the decode thread waited. None without
    device decode."""
    decoder = decoders.get("train") or next(iter(decoders.values()), None)
    if decoder is None or not decoder.waits.batches:
        return None
    where = "device" if decoder.cuda else "CPU"  # without CUDA the device decode runs on the CPU
    counts = decoder.counts
    total = counts["device"] + counts["cpu"]
    words = [f"--data.decode gpu: {total:,} images, {counts['cpu'] / max(1, total):.0%} decoded by the workers"]
    if counts["cannot"]:
        words.append(f"{counts['cannot']:,} of them because the device cannot take them (progressive, grayscale, "
                     "CMYK, EXIF-rotated or not JPEG: docs/data.md)")
    costs = decoder.share.costs() if decoder.share is not None else None
    if costs is not None:
        decode = f", {costs['decode'] * 1e3:.2f} ms to decode there" if costs["decode"] is not None else ""
        words.append(f"per image {costs['read'] * 1e3:.2f} ms to read in a worker{decode}, "
                     f"{costs['device'] * 1e3:.2f} ms on the {where} ({decoder.share.workers} workers)")
    waits = decoder.waits.shares()
    words.append(f"the decode thread waited {waits['workers']:.0%} of its time for the workers and "
                 f"{waits['step']:.0%} for the step")
    parts = decoder.waits.device_shares()
    if decoder.waits.jpeg:
        words.append(f"its {where} time {parts['jpeg']:.0%} in the JPEG decode, {parts['crop']:.0%} cropping, "
                     f"{parts['previous']:.0%} waiting for its previous batch")
    return ", ".join(words)
