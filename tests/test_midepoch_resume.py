"""A run resumed from a mid-epoch checkpoint finishes the epoch as if it had never stopped, on every map-style backend.

The train loader's state (sampler position and epoch, workers' progress and generators: datamodules/resume.py)
travels in the checkpoint. Each test trains conv11 (width 8, 16 px, 2 loader workers, persistent) for three epochs
of 7 steps and stops in the second one: the resumed epoch must deliver, batch for batch, the samples and pixels
(crops, flips) the uninterrupted run delivered, none replayed and none skipped, and so must the epoch after it
(the per-epoch reseed makes no second iterator: lightning_app/callbacks/reseed.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from datamodules.downscale.writer import ensure_downscaled
from datamodules.lmdb.pack import pack
from datamodules.resume import EpochSampler, ResumableLoader
from tests.helpers.cli import quick_args, run_main

STEPS = 7  # per epoch: 240 tiny training images, 32 a (global) batch, the last partial batch dropped
SAVED_AT = STEPS + 3  # a checkpoint after batch 3 of epoch 2 (index 2): the resumed run starts at index 3


@pytest.fixture(scope="module")
def sources(tiny_data, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Backend -> (its data config, its data_dir): the same tiny tree as a tree, an LMDB, a downscaled copy."""
    made = tmp_path_factory.mktemp("sources")
    return {
        "imagefolder": ("configs/data/imagefolder.yaml", tiny_data),
        "lmdb": ("configs/data/lmdb.yaml", pack(tiny_data, made / "tiny.lmdb", progress=False)),
        "downscaled": ("configs/data/downscaled.yaml", ensure_downscaled(tiny_data, made / "down", 24)),
    }


def _args(config: str, data: Path, root: Path, out: Path, *extra: str) -> list[str]:
    return ["fit", "--config", config, *quick_args(data, root, epochs=3, batch=32),
            "--data.num_workers", "2", "--data.image_size", "16", "--trainer.num_sanity_val_steps", "0",
            "--trainer.limit_val_batches", "0", "--checkpoint.monitor", "null", "--model.pictures", "[]",
            "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder", f"--trainer.callbacks.out_dir={out}",
            *extra]


def _epoch(out: Path, epoch: int, rank: int = 0) -> dict:
    return json.loads((out / f"rank{rank}_epoch{epoch}.json").read_text())


def _assert_continues(whole: dict, resumed: dict, done: int) -> None:
    """`resumed` is `whole` after its first `done` batches: the same samples in the same batches, the same pixels."""
    assert resumed["batches"] == whole["batches"][done:], (
        f"resumed epoch: {len(resumed['batches'])} batches; samples replayed: "
        f"{sorted(set(resumed['indices']) & {i for b in whole['batches'][:done] for i in b})[:8]}")
    assert resumed["digests"][0] == whole["digests"][done], "the first resumed batch has other crops or flips"
    assert resumed["digests"] == whole["digests"][done:]


def _assert_same(whole: dict, resumed: dict) -> None:
    assert resumed["batches"] == whole["batches"] and resumed["digests"] == whole["digests"]


@pytest.mark.parametrize(("backend", "decode"), [("imagefolder", "cpu"), ("lmdb", "cpu"), ("downscaled", "cpu"),
                                                 ("lmdb", "gpu")])
def test_resumed_epoch_delivers_the_uninterrupted_runs_batches(backend, decode, sources, tmp_path):
    """The uninterrupted run saves last.ckpt mid-epoch (a step save) and goes on; that checkpoint, put back as
    last.ckpt (what a run killed right after the save leaves), resumed with --ckpt_path last, delivers the rest of
    the uninterrupted run's epoch. With --data.decode gpu the device stage runs a batch ahead of the step."""
    _resume_mid_epoch(*sources[backend], decode, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_resumed_epoch_delivers_the_same_batches_under_each_worker_start(method, sources, tmp_path):
    """The same, ImageFolder, with the workers forked from the training process or spawned (the test above: the
    default, forkserver): the workers' generators and progress travel in the checkpoint whichever way they start."""
    _resume_mid_epoch(*sources["imagefolder"], "cpu", tmp_path, "--data.worker_start", method)


def _resume_mid_epoch(config: str, data: Path, decode: str, tmp_path: Path, *extra: str) -> None:
    kept = tmp_path / "step.ckpt"
    # decode gpu: every file the device can take, on the device (the balanced share, timing-driven, would decode
    # some on the CPU path instead: the same boxes, pixels a grey level apart; docs/data.md)
    pinned = ["--data.cpu_decode_share", "0"] if decode == "gpu" else []
    steps = ["--data.decode", decode, *pinned, "--checkpoint.every_n_train_steps", str(SAVED_AT),
             "--trainer.callbacks+=tests.helpers.callbacks.KeepCheckpointAt",
             f"--trainer.callbacks.step={SAVED_AT}", f"--trainer.callbacks.path={kept}", *extra]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_main(_args(config, data, tmp_path, whole, *steps))
    step = torch.load(kept, map_location="cpu", weights_only=True)
    assert step["global_step"] == SAVED_AT
    assert step["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # the train loader's state is in it
    shutil.copy(kept, tmp_path / "version_0" / "checkpoints" / "last.ckpt")  # what a kill right after it leaves
    run_main(_args(config, data, tmp_path, resumed, *steps, "--ckpt_path", "last"))
    assert not (resumed / "rank0_epoch0.json").exists()  # epoch 1 was done: not run again
    _assert_continues(_epoch(whole, 1), _epoch(resumed, 1), SAVED_AT - STEPS)
    _assert_same(_epoch(whole, 2), _epoch(resumed, 2))


def test_loader_state_holds_the_epoch_and_another_worker_count_restarts_the_epoch_with_a_warning():
    """In-process: a state taken 3 batches into epoch 1 continues it in a fresh loader whose sampler is still at
    epoch 0 (Lightning calls set_epoch only after making the resumed iterator); a loader with another number of
    workers cannot place the saved workers' states, so it warns and runs the epoch from its start."""
    data = list(range(64))

    def loader(workers: int) -> ResumableLoader:
        sampler = EpochSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
        return ResumableLoader(data, batch_size=8, sampler=sampler, num_workers=workers)

    whole = loader(0)
    whole.sampler.set_epoch(1)
    epoch = [batch.tolist() for batch in whole]
    first = loader(2)
    first.sampler.set_epoch(1)
    batches = iter(first)
    seen = [next(batches).tolist() for _ in range(3)]
    state = first.state_dict()
    again = loader(2)
    again.load_state_dict(state)
    assert seen + [batch.tolist() for batch in again] == epoch
    other = loader(1)
    with pytest.warns(UserWarning, match="--data.num_workers"):
        other.load_state_dict(state)
    assert len(list(other)) == len(epoch)


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_ddp_each_rank_resumes_its_own_shard_after_sigterm(sources, tmp_path, decode):
    """2 gloo processes, 2 workers each: SIGTERM mid-epoch (CheckpointOnSigterm saves last.ckpt after the batch),
    then --ckpt_path last: each rank delivers the rest of its own uninterrupted epoch, samples and pixels. With
    --data.decode gpu each rank decodes its own shard's batches."""
    config, data = sources["lmdb"]
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.decode", decode,
           *(["--data.cpu_decode_share", "0"] if decode == "gpu" else [])]  # exact pixels: see above
    whole, cut, resumed = tmp_path / "whole", tmp_path / "cut", tmp_path / "resumed"
    run_main(_args(config, data, tmp_path / "a", whole, *ddp))
    sigterm = ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=1",
               f"--trainer.callbacks.batch={SAVED_AT - STEPS - 1}", "--trainer.callbacks.sig=SIGTERM",
               "--trainer.callbacks.rank=0"]
    stopped = run_main(_args(config, data, tmp_path / "b", cut, *ddp, *sigterm))
    assert "SIGTERM: saved" in stopped.stdout + stopped.stderr
    run_main(_args(config, data, tmp_path / "b", resumed, *ddp, "--ckpt_path", "last"))
    for rank in (0, 1):
        _assert_continues(_epoch(whole, 1, rank), _epoch(resumed, 1, rank), SAVED_AT - STEPS)
        _assert_same(_epoch(whole, 2, rank), _epoch(resumed, 2, rank))
    assert not set(_epoch(resumed, 1, 0)["indices"]) & set(_epoch(resumed, 1, 1)["indices"])
