"""StreamingDataModule: training on a pack made by `python -m datamodules.shards`, in a folder or in object storage.

    python main.py fit --config configs/data/streaming.yaml --data.data_dir s3://bucket/imagenet

Chunks of a remote pack are downloaded by every node into its cache (--data.cache_dir, bounded by
--data.max_cache_size) while the epoch runs; a local pack is read in place. The bytes go through the
shared sample path (loader.py), the loader's position travels in Lightning's checkpoint (exact
mid-epoch resume), and every failure of the store is one paragraph (errors.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from datamodules.base import BUILTIN_ROOT, REPO_ROOT, ImageDataModule
from datamodules.credentials import redact
from datamodules.errors import DataError
from datamodules.index import SPLITS, find_classes
from datamodules.processes.loader_workers import end_stuck_workers_at_exit
from datamodules.processes.locks import file_lock
from datamodules.sample.crop import TrainCrop, ValCrop
from datamodules.shards.errors import as_data_error, corrupt_chunk
from datamodules.shards.layout import INDEX, MARKER, read_meta
from datamodules.shards.loader import (
    PredictShardDataset,
    PredictShardLoader,
    ShardBatches,
    ShardDataset,
    ShardLoader,
)
from datamodules.shards.pack_store import open_store
from datamodules.shards.s3_clients import endpoint_of, is_remote

if TYPE_CHECKING:
    from datamodules.sample.decode_stage import DecodeStage


class StreamingDataModule(ImageDataModule):
    """Streams LitData shards through the shared sample path (see ImageDataModule for the shared args).

    Args:
        data_dir: a pack made by `python -m datamodules.shards`: a local folder or s3://bucket/prefix.
            An ImageFolder root is packed on first use into data/shards/<name>-<hash>.shards; None = the
            built-in dataset, packed on first use into data/builtin/<preset>.shards.
        storage_options: boto3 client arguments for an s3:// pack, e.g. {endpoint_url: http://host:9000,
            region_name: ...}; unset ones come from the standard AWS environment variables (AWS_ENDPOINT_URL,
            AWS_ACCESS_KEY_ID, ...). Credentials given here are never written to config.yaml, the hparams
            or a log (prefer the environment all the same). http:// endpoints work.
        cache_dir: where each node caches the chunks of an s3:// pack (default: LitData's ~/.lightning/chunks).
        max_cache_size: the most disk that cache may use, e.g. "50GB"; LitData deletes chunks already read
            beyond it. Give it room for a few chunks per worker at least.
        max_pre_download: chunks each worker downloads ahead of the one it reads.
    """

    def __init__(self, data_dir: str | None = None, storage_options: dict | None = None, cache_dir: str | None = None,
                 max_cache_size: str | None = "50GB", max_pre_download: int = 2, **kwargs) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise DataError(f"data.storage_options must be a mapping of boto3 client arguments, got "
                            f"{type(storage_options).__name__}.")
        self.storage_options = dict(storage_options or {})
        self.cache_dir, self.max_cache_size, self.max_pre_download = cache_dir, max_cache_size, max_pre_download
        super().__init__(data_dir=data_dir, **kwargs)
        for hparams in (self._hparams, self._hparams_initial):  # what Lightning logs and checkpoints
            if hparams.get("storage_options"):
                hparams["storage_options"] = redact(hparams["storage_options"])

    # -- the pack ---------------------------------------------------------------------------
    def discover_classes(self) -> list[str]:
        url = str(self.data_dir) if self.data_dir is not None else str(self._builtin_pack())
        tree = Path(url).expanduser()
        if not is_remote(url) and (tree / "train").is_dir() and not (tree / MARKER).exists():
            url = str(self._pack_tree(tree))  # an ImageFolder root, as LMDBDataModule takes one
        self.url = url.rstrip("/") if is_remote(url) else str(Path(url).expanduser().absolute())
        self.root = self.url
        self.endpoint = endpoint_of(self.storage_options) if is_remote(self.url) else None
        self.meta = read_meta(open_store(self.url, self.storage_options))
        skipped = {s: v["skipped"] for s, v in self.meta["splits"].items() if v.get("skipped")}
        if skipped:
            warnings.warn(f"the pack {self.url} leaves out {skipped} unreadable file(s) (listed under skipped_files "
                          "in its fic-shards.json).", stacklevel=2)
        return list(self.meta["classes"])

    def _builtin_pack(self) -> Path:
        from datamodules.builtin.tree import ensure_builtin

        tree = Path(ensure_builtin(self.builtin, root=BUILTIN_ROOT))
        return self._pack_tree(tree, tree.parent / f"{tree.name}.shards")

    def _pack_tree(self, tree: Path, dst: Path | None = None) -> Path:
        """A local pack of an ImageFolder tree, made on first use (again when the tree changed)."""
        from datamodules.shards.pack import pack

        find_classes(tree)  # a clear error for a bad layout before packing
        if dst is None:
            digest = hashlib.sha1(str(tree.absolute()).encode()).hexdigest()[:10]
            dst = REPO_ROOT / "data" / "shards" / f"{tree.name}-{digest}.shards"
        with file_lock(dst.parent / f".{dst.name}.lock"):  # DDP ranks starting at once pack it once
            pack(tree, str(dst), overwrite=True, skip_invalid=self.skip_invalid, progress=False)
        return dst

    def _check_local_chunks(self) -> None:
        """A truncated chunk of a local pack, named now rather than halfway through an epoch."""
        for split in SPLITS:
            index = json.loads((Path(self.url) / split / INDEX).read_text())
            for chunk in index["chunks"]:
                path = Path(self.url) / split / chunk["filename"]
                size = path.stat().st_size if path.exists() else None
                if size != chunk["chunk_bytes"]:
                    raise corrupt_chunk(self.url, f"{split}/{chunk['filename']}",
                                        f"{size} bytes, its index.json says {chunk['chunk_bytes']}" if size is not None
                                        else "missing")

    def setup(self, stage: str | None = None) -> None:
        if self.datasets or (stage == "predict" and self.predict_dir is not None):
            return
        self.start_worker_server()
        if self.meta["splits"]["train"]["count"] < self.batch_size:
            raise DataError(f"train/ of {self.url} has {self.meta['splits']['train']['count']} images, fewer than one "
                            f"global batch ({self.batch_size}); lower --data.batch_size.")
        remote = is_remote(self.url)
        if not remote:
            self._check_local_chunks()
        budgets = self._cache_budgets() if remote else {"train": None, "val": None}
        common = {"cache_dir": self._node_cache_dir() if remote else None,
                  "storage_options": self.storage_options or None, "max_pre_download": self.max_pre_download,
                  "seed": int(os.environ.get("PL_GLOBAL_SEED", "0")), "endpoint": self.endpoint, "ranks": self._ranks()}
        try:
            self.datasets = {  # made here, after the process group: LitData reads the rank and world size now
                "train": ShardDataset(f"{self.url}/train", shuffle=True, drop_last=True,
                                      max_cache_size=budgets["train"], **common),
                "val": ShardDataset(f"{self.url}/val", shuffle=False, batch_aligned=False,
                                    drop_last=self.world_size > 1, max_cache_size=budgets["val"], **common),
            }
        except DataError:
            raise
        except Exception as e:  # index.json unreachable, refused, missing: one paragraph
            known = as_data_error(e, self.url, endpoint=self.endpoint, cache_dir=self.cache_dir)
            if known is e:
                raise
            raise known from e

    def _ranks(self) -> tuple[int, int, int] | None:
        """(world size, global rank, nodes) from the trainer, for LitData (loader.ShardDataset says why)."""
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank, trainer.num_nodes) if trainer is not None else None

    def _node_cache_dir(self) -> str | None:
        """--data.cache_dir, in a `node<N>` folder of its own on each node of a multi-node run. LitData counts and frees
        a cache per node (litdata/streaming/reader.py: `num_bytes // num_nodes`, chunks deleted once read), so nodes
        sharing one folder on a shared file system would delete chunks another node still reads."""
        trainer = self.trainer
        if trainer is None or trainer.num_nodes <= 1:
            return self.cache_dir
        from litdata.utilities.dataset_utilities import get_default_cache_dir

        return os.path.join(self.cache_dir or get_default_cache_dir(), f"node{trainer.node_rank}")

    def _cache_budgets(self) -> dict[str, int | float | str | None]:
        """LitData's cache budget per split, so that both together stay within max_cache_size on this node.

        LitData keeps, per reader (a worker of a process on this node), the chunk it reads and up to
        max_pre_download more, never fewer than 2 (litdata/streaming/reader.py,
        _cap_pre_download_for_cache_budget), and counts a chunk only once it is downloaded: one more per
        reader may be in flight. Its own budget is set below ours by that much; a budget smaller than
        what the readers hold is refused here rather than overrun there.
        """
        size = self.max_cache_size
        if size is None or isinstance(size, float):  # LitData's own default, or a fraction of the free disk
            return {"train": size, "val": size}
        from litdata.utilities import format as litdata_format  # sizes read and shown as LitData does

        try:
            total = litdata_format._parse_max_cache_size(size)
        except ValueError as e:
            raise DataError(f"data.max_cache_size {size!r} is not a size such as 50GB or 500MB ({e}).") from None
        splits = self.meta["splits"]
        chunk = max(splits[s].get("max_chunk_bytes") or splits[s]["bytes"] for s in SPLITS)
        trainer = self.trainer
        readers = max(1, self.workers()) * (max(1, trainer.world_size // max(1, trainer.num_nodes)) if trainer else 1)
        held = readers * (max(2, self.max_pre_download) + 1) * chunk
        in_flight = readers * chunk
        val = min(splits["val"]["bytes"], held)
        train = total - val - in_flight - (0 if val < held else in_flight)
        if train < held:
            need = held + in_flight + val + (0 if val < held else in_flight)
            raise DataError(
                f"data.max_cache_size {size} is too small for {readers} reader(s) on this node (workers x processes), "
                f"each holding up to {max(2, self.max_pre_download) + 1} chunks of up to "
                f"{litdata_format._human_readable_bytes(chunk)} "
                f"of {self.url}: give it at least {litdata_format._human_readable_bytes(need)}, or lower "
                "--data.num_workers or "
                "--data.max_pre_download.")
        return {"train": int(train), "val": int(val)}

    # -- loaders ----------------------------------------------------------------------------
    def _stream(self, split: str, crop, size, dataset: ShardDataset | None = None) -> ShardLoader | DecodeStage:
        predict = isinstance(dataset, PredictShardDataset)
        plan = self.loader_plan(split == "train", encoded=self.decodes_on_device and not predict)
        end_stuck_workers_at_exit()
        batches = ShardBatches(crop, size, f"{self.url}/{split}", plan, with_paths=predict)
        loader = (PredictShardLoader if predict else ShardLoader)(
            dataset or self.datasets[split], batch_size=self.per_process_batch_size, collate_fn=batches,
            **self.loader_args(plan))
        if batches.encoded:  # the pack's sample ids go on as the batch's third element, as on the CPU path
            return self.on_device(loader, split, split == "train", batches.describe, plan.overflow, ids=True)
        return loader

    def train_dataloader(self) -> ShardLoader | DecodeStage:
        return self._stream("train", TrainCrop(self.min_scale, self.train_augment), self._train_size)

    def val_dataloader(self) -> ShardLoader | DecodeStage:
        return self._stream("val", ValCrop(self.val_crop_ratio), self.val_image_size)

    def test_dataloader(self) -> ShardLoader | DecodeStage:
        return self.val_dataloader()

    def predict_dataloader(self):
        """--data.predict_dir's images, or else the pack's val split (its paths those of the packed tree)."""
        if self.predict_dir is not None:
            return super().predict_dataloader()
        remote = is_remote(self.url)
        dataset = PredictShardDataset(
            f"{self.url}/val", source_root=self.meta.get("source_root", ""),
            total_items=self.meta["splits"]["val"]["count"], cache_dir=self.cache_dir if remote else None,
            storage_options=self.storage_options or None, max_pre_download=self.max_pre_download,
            max_cache_size=self._cache_budgets()["val"] if remote else None, endpoint=self.endpoint,
            ranks=self._ranks())
        return self._stream("val", ValCrop(self.val_crop_ratio), self.val_image_size, dataset)

    def train_batches(self) -> int:
        """Batches per epoch on this process (what the LR schedule counts), from the dataset's length."""
        batch = self.per_process_batch_size
        workers = self.memory_plan(fit=True).loader("train").workers  # the train loader's (`_stream`)
        return self.datasets["train"].get_len(workers, batch) // batch  # as StreamingDataLoader.__len__
