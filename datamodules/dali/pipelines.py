"""DALI pipelines: train (random resized crop, flip) and val (resize, center crop).

Only imported by `datamodules.dali` once DALI is known to be installed. Every pipeline
outputs `output_names(spec)`: HWC images and the sample's position in the Index (the backend
maps it to the label, so a test can also see exactly which samples each rank read). Images
are uint8 when decoded on the CPU (normalised later, on the training device), float (or fp16)
normalised with the ImageNet mean and std when decoded on the GPU ("mixed").

With CPU decoding (`spec.resize_on_host`), DALI reads, picks the random crop and decodes only
that region; the images leave the pipeline at their decoded size (plus a flip flag when
training) and `loader.HostFinish` resizes them with the shared sample path's kernel. DALI's
own CPU resize costs more than its decoding (`python -m bench loaders` times both: its DALI CPU
stage rates).

Spawned LMDB workers unpickle `LMDBSampleSource` from here: this module must not import
Lightning (nor anything that does, such as `datamodules.base`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from datamodules.dali.augment import dali_auto_augment
from datamodules.processes.loader_workers import InWorkersOnly
from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD

READER_NAME = "Reader"
MEAN = [m * 255 for m in IMAGENET_MEAN]
STD = [s * 255 for s in IMAGENET_STD]


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
    device_memory_padding: int = 16 << 20  # per thread (datamodules.dali sizes these)
    host_memory_padding: int = 8 << 20  # two pinned buffers per thread
    auto_augment: str | None = None  # datamodules/dali/augment.py: DALI's native policies
    resize_on_host: bool = False  # CPU decoding: the loader resizes (see the module doc)


def output_names(spec: PipelineSpec, lmdb: bool = False) -> list[str]:
    """The pipeline's outputs, in order: what the loader's iterator maps them to."""
    flip = ["mirror"] if spec.resize_on_host and spec.train else []
    return ["images", *flip, "index", *(["label"] if lmdb else [])]


def _decode_and_augment(encoded, spec: PipelineSpec) -> tuple:
    mixed = spec.decoder_device == "mixed"
    extra = (
        {"hw_decoder_load": spec.hw_decoder_load, "device_memory_padding": spec.device_memory_padding,
         "host_memory_padding": spec.host_memory_padding}
        if mixed else {}
    )
    # GPU: normalise where the pixels already are. CPU: keep uint8 (a quarter of the bytes to copy and
    # send to the device); the DataModule normalises on the device. HWC either way: the model's NCHW
    # view of it is channels-last memory, so channels_last costs no copy.
    if mixed:
        norm = {"dtype": types.FLOAT16 if spec.fp16 else types.FLOAT, "mean": MEAN, "std": STD}
    else:
        norm = {"dtype": types.UINT8}
    if spec.train:
        images = fn.decoders.image_random_crop(
            encoded, device=spec.decoder_device, output_type=types.RGB,
            random_area=[spec.min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, **extra,
        )
        if spec.resize_on_host:  # the crop at its decoded size, and the flip to apply after the resize
            return images, fn.random.coin_flip(probability=0.5, dtype=types.UINT8)
        images = fn.resize(images, resize_x=spec.image_size, resize_y=spec.image_size,
                           interp_type=types.INTERP_LINEAR, antialias=True)
        images = dali_auto_augment(images, spec.auto_augment)  # uint8 HWC; after the flip in the other backends
        mirror = fn.random.coin_flip(probability=0.5)
        return (fn.crop_mirror_normalize(images, output_layout="HWC", mirror=mirror, **norm),)
    images = fn.decoders.image(encoded, device=spec.decoder_device, output_type=types.RGB, **extra)
    if spec.resize_on_host:
        return (images,)
    # torchvision: PIL bilinear with antialias (a triangle filter widened when shrinking),
    # shorter side to val_resize; DALI's linear + antialias is the same filter family.
    images = fn.resize(images, resize_shorter=spec.val_resize, interp_type=types.INTERP_LINEAR, antialias=True)
    return (fn.crop_mirror_normalize(images, output_layout="HWC", crop=(spec.image_size, spec.image_size),
                                     crop_pos_x=0.5, crop_pos_y=0.5, **norm),)


@pipeline_def(enable_conditionals=True)  # nvidia.dali.auto_aug selects its ops with `if`
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
    return (*_decode_and_augment(encoded, spec), index)


@pipeline_def(enable_conditionals=True)
def external_pipeline(spec: PipelineSpec, source):
    encoded, index, label = fn.external_source(
        source=source, num_outputs=3, batch=False, parallel=True, dtype=[types.UINT8, types.INT32, types.INT32],
    )
    return (*_decode_and_augment(encoded, spec), index, label)


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
        self._in_worker = InWorkersOnly()

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
            self._in_worker()  # once per DALI worker process
            self._reader = _open_reader(self.path)
        data, label = self._reader.get(self.split, i)
        return np.frombuffer(data, dtype=np.uint8), np.array([i], dtype=np.int32), np.array([label], dtype=np.int32)


def _open_reader(path: str):
    """The LMDB reader from its Lightning-free module: a spawned DALI worker should not spend seconds
    importing Lightning (`datamodules.lmdb` imports `datamodules.base`)."""
    from datamodules.lmdb.reader import LMDBReader

    return LMDBReader(path)
