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
from tests.helpers.gloo import gloo_group
from tests.helpers.processes import in_processes

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


@pytest.mark.parametrize(("backend", "decode"), [
    ("imagefolder", "cpu"), ("lmdb", "cpu"), ("downscaled", "cpu"), ("lmdb", "gpu"),
    pytest.param("imagefolder", "gpu", marks=pytest.mark.slow),
    pytest.param("downscaled", "gpu", marks=pytest.mark.slow)])
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


def _resume_mid_epoch(config: str, data: Path, decode: str, tmp_path: Path, *extra: str,
                      resume_with: tuple[str, ...] = ()) -> tuple[Path, Path, str]:
    """The test above; `resume_with`: flags only the resumed run adds. (The uninterrupted run's and the resumed
    run's SampleRecorder folders, the resumed run's stderr.)"""
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
    proc = run_main(_args(config, data, tmp_path, resumed, *steps, "--ckpt_path", "last", *resume_with))
    assert not (resumed / "rank0_epoch0.json").exists()  # epoch 1 was done: not run again
    if not resume_with:
        _assert_continues(_epoch(whole, 1), _epoch(resumed, 1), SAVED_AT - STEPS)
        _assert_same(_epoch(whole, 2), _epoch(resumed, 2))
    return whole, resumed, proc.stderr


def test_another_worker_count_goes_on_from_the_sample_the_epoch_had_reached(sources, tmp_path):
    """The checkpoint saved with 2 loader workers, resumed with 1: the workers' states cannot be placed, but the
    resumed epoch still runs the uninterrupted run's remaining batches, samples for samples (not, as a loader
    started afresh under Lightning's restored batch count would, epoch 0's first ones), and says so once."""
    whole, resumed, err = _resume_mid_epoch(*sources["imagefolder"], "cpu", tmp_path,
                                            resume_with=("--data.num_workers", "1"))
    done = SAVED_AT - STEPS
    assert _epoch(resumed, 1)["batches"] == _epoch(whole, 1)["batches"][done:]  # 4 batches: none again, none left
    assert _epoch(resumed, 2)["batches"] == _epoch(whole, 2)["batches"]
    said = [line for line in err.splitlines() if "train loader state" in line]
    assert len(said) == 1, err[-3000:]
    assert ("saved by 1 process(es) with 2 loader worker(s) each, this run has 1 with 1: the interrupted epoch goes "
            "on from the sample it had reached") in said[0]
    last = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 3 * STEPS


def _loader(data: list[int], workers: int, world: int = 1, rank: int = 0, batch: int = 8) -> ResumableLoader:
    sampler = EpochSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    return ResumableLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)


def _state_in_epoch_1(data: list[int], workers: int, done: int) -> tuple[list[list[int]], dict]:
    """(epoch 1's batches, uninterrupted), and a state taken `done` batches into epoch 1 with `workers` workers."""
    whole = _loader(data, 0)
    whole.sampler.set_epoch(1)
    first = _loader(data, workers)
    first.sampler.set_epoch(1)
    batches = iter(first)
    for _ in range(done):
        next(batches)
    return [batch.tolist() for batch in whole], first.state_dict()


def test_loader_state_holds_the_epoch_and_another_worker_count_goes_on_from_the_same_sample():
    """In-process: a state taken 3 batches into epoch 1 continues it in a fresh loader whose sampler is still at
    epoch 0 (Lightning calls set_epoch only after making the resumed iterator). A loader with another number of
    workers cannot place the saved workers' states: it warns and goes on from the same sample of epoch 1's order,
    running as many batches as the epoch had left (Lightning keeps its count of the 3 done)."""
    data = list(range(64))
    epoch, state = _state_in_epoch_1(data, workers=2, done=3)
    again = _loader(data, 2)
    again.load_state_dict(state)
    assert epoch[:3] + [batch.tolist() for batch in again] == epoch
    for workers in (1, 0):
        other = _loader(data, workers)
        with pytest.warns(UserWarning, match="saved by 1 process.* with 2 loader worker.*this run has 1 with "
                                             f"{workers}: the interrupted epoch goes on from the sample it had "
                                             "reached") as said:
            other.load_state_dict(state)
        assert len(said) == 1
        assert [batch.tolist() for batch in other] == epoch[3:]


def _resume_on_two_ranks(rank: int, store: str, state: dict) -> list[list[int]]:
    with gloo_group(store, rank, 2):
        loader = _loader(list(range(64)), 0, world=2, rank=rank, batch=4)  # the same global batch of 8
        with pytest.warns(UserWarning, match="saved by 1 process.*, this run has 2 with 0"):
            loader.load_state_dict(state)
        return [batch.tolist() for batch in loader]


def test_a_state_of_one_process_goes_on_from_the_same_sample_on_two(tmp_path):
    """Saved by one process 3 batches of 8 into epoch 1, resumed by 2 gloo processes of 4 a batch each: between
    them they take the epoch's remaining samples once each, in as many steps as the epoch had left."""
    data = list(range(64))
    epoch, state = _state_in_epoch_1(data, workers=2, done=3)
    ranks = in_processes(_resume_on_two_ranks, 2, str(tmp_path / "store"), state)
    assert [len(batches) for batches in ranks] == [len(epoch) - 3] * 2
    assert sorted(i for batches in ranks for b in batches for i in b) == sorted(i for b in epoch[3:] for i in b)


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
