"""DALI pipelines: train (random resized crop, flip) and val (resize, center crop).

Only imported by `datamodules.dali` once DALI is known to be installed. Every pipeline
outputs ("images", "index"): float CHW images normalised with the ImageNet mean and std,
and the sample's position in the Index (the backend maps it to the label, so a test can
also see exactly which samples each rank read).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from datamodules.transforms import IMAGENET_MEAN, IMAGENET_STD

READER_NAME = "Reader"
MEAN = [m * 255 for m in IMAGENET_MEAN]
STD = [s * 255 for s in IMAGENET_STD]
# nvJPEG scratch sizes of NVIDIA's ImageNet example: no re-allocation after the first batches.
DEVICE_MEMORY_PADDING = 211025920
HOST_MEMORY_PADDING = 140544512


@dataclass
class PipelineSpec:
    """What a pipeline needs besides its source (picklable, plain values)."""

    train: bool
    decoder_device: str  # "cpu" or "mixed"
    image_size: int
    val_resize: int  # val: shorter side before the center crop
    min_scale: float
    fp16: bool
    hw_decoder_load: float


def _decode_and_augment(encoded, spec: PipelineSpec):
    mixed = spec.decoder_device == "mixed"
    extra = (
        {"hw_decoder_load": spec.hw_decoder_load, "device_memory_padding": DEVICE_MEMORY_PADDING,
         "host_memory_padding": HOST_MEMORY_PADDING}
        if mixed else {}
    )
    dtype = types.FLOAT16 if spec.fp16 else types.FLOAT
    if spec.train:
        images = fn.decoders.image_random_crop(
            encoded, device=spec.decoder_device, output_type=types.RGB,
            random_area=[spec.min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, **extra,
        )
        images = fn.resize(images, resize_x=spec.image_size, resize_y=spec.image_size,
                           interp_type=types.INTERP_LINEAR, antialias=True)
        mirror = fn.random.coin_flip(probability=0.5)
        return fn.crop_mirror_normalize(images, dtype=dtype, output_layout="CHW", mean=MEAN, std=STD, mirror=mirror)
    images = fn.decoders.image(encoded, device=spec.decoder_device, output_type=types.RGB, **extra)
    # torchvision: PIL bilinear with antialias (a triangle filter widened when shrinking),
    # shorter side to val_resize; DALI's linear + antialias is the same filter family.
    images = fn.resize(images, resize_shorter=spec.val_resize, interp_type=types.INTERP_LINEAR, antialias=True)
    return fn.crop_mirror_normalize(images, dtype=dtype, output_layout="CHW", mean=MEAN, std=STD,
                                    crop=(spec.image_size, spec.image_size), crop_pos_x=0.5, crop_pos_y=0.5)


@pipeline_def
def file_pipeline(spec: PipelineSpec, files: list[str], indices: list[int], shard_id: int, num_shards: int):
    """Reads the Index's files (an explicit list: the labels are the Index's, not DALI's walk).

    The reader's "label" is the sample's position in the Index.
    """
    encoded, index = fn.readers.file(
        files=files, labels=indices, name=READER_NAME, shard_id=shard_id, num_shards=num_shards,
        random_shuffle=spec.train, initial_fill=min(4096, max(len(files), 1)), pad_last_batch=True,
        # False: all ranks move to the next shard together each epoch (still disjoint), so
        # every rank sees the whole dataset over num_shards epochs.
        stick_to_shard=False,
    )
    return _decode_and_augment(encoded, spec), index


@pipeline_def
def external_pipeline(spec: PipelineSpec, source):
    encoded, index, label = fn.external_source(
        source=source, num_outputs=3, batch=False, parallel=True, dtype=[types.UINT8, types.INT32, types.INT32],
    )
    return _decode_and_augment(encoded, spec), index, label


# --- LMDB source ------------------------------------------------------------------------
class LMDBSampleSource:
    """Per-sample callback for `fn.external_source(parallel=True, batch=False)`.

    Picklable (it is sent to spawned workers); its `LMDBReader` opens the database lazily
    once per process, on first use. Each epoch every rank draws the same global permutation (seeded by the
    epoch) and takes its own slice of it: shards are disjoint every epoch and all ranks run
    `steps` batches. Past the real samples of the last (val) batch it repeats a sample; the
    loader trims those.
    """

    def __init__(self, path: str, split: str, count: int, shard_id: int, num_shards: int,
                 batch_size: int, steps: int, shuffle: bool, seed: int, epoch_offset: int = 0) -> None:
        self.path, self.split, self.count = path, split, count
        self._reader = None
        self.shard_id, self.num_shards = shard_id, num_shards
        self.batch_size, self.steps, self.shuffle = batch_size, steps, shuffle
        self.seed, self.epoch_offset = seed, epoch_offset
        self._order: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_order": None, "_reader": None}

    def shard(self, epoch: int) -> np.ndarray:
        """Index positions this rank reads in `epoch` (before padding)."""
        if self._order is None or self._order[0] != epoch:
            order = np.arange(self.count)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            self._order = (epoch, order[self.shard_id::self.num_shards])
        return self._order[1]

    def __call__(self, sample_info) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if sample_info.idx_in_epoch >= self.steps * self.batch_size:
            raise StopIteration
        shard = self.shard(sample_info.epoch_idx + self.epoch_offset)
        i = int(shard[min(sample_info.idx_in_epoch, len(shard) - 1)])
        if self._reader is None:
            from datamodules.lmdb import LMDBReader

            self._reader = LMDBReader(self.path)
        data, label = self._reader.get(self.split, i)
        return np.frombuffer(data, dtype=np.uint8), np.array([i], dtype=np.int32), np.array([label], dtype=np.int32)
