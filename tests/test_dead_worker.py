"""A train loader worker SIGKILLed (as the kernel's OOM killer does) while the training process is healthy: the
loader goes on with new workers to the next step where the ranks agree, every rank stops there and saves last.ckpt,
and the run exits 4 with one paragraph naming the worker's pid, the signal, the likely cause, the epoch and the step
(datamodules/processes/dead_workers.py, lightning_app/callbacks/stop_signals.py).

Before, the run ended in a 121-line traceback ending "DataLoader worker (pid(s) N) exited unexpectedly" (under the
fork server, torch never learns the signal), and with several processes the rank whose worker died left its peers
waiting in a collective; the progress since the last checkpoint was lost.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import quick_args
from tests.helpers.event_files import scalars
from tests.helpers.processes import finish, start_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 15  # per epoch: 240 tiny training images at a global batch of 16
LOG_EVERY = 5  # the ranks agree on stops at these steps and at each epoch's end


def _args(data: Path, root: Path, devices: int, *extra: str) -> list[str]:
    ddp = ["--config", "configs/ddp.yaml", "--trainer.devices", "2"] if devices == 2 else []
    return ["fit", *ddp, *quick_args(data, root, epochs=3, batch=16), "--data.num_workers", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", str(LOG_EVERY),
            "--model.pictures", "[]", *extra]


def _kill_worker(rank: int, between_epochs: bool = False) -> list[str]:
    # between epochs: in the validation after the first epoch; the death is found as the second epoch starts
    epoch, batch = (0, -1) if between_epochs else (1, 2)
    return ["--trainer.callbacks+=tests.helpers.callbacks.KillLoaderWorkerAt", f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.batch={batch}", f"--trainer.callbacks.rank={rank}"]


def _env() -> dict[str, str]:
    slurm = {k for k in os.environ if k.startswith("SLURM_")} | {"RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"}
    return {**{k: v for k, v in os.environ.items() if k not in slurm}, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "FIC_DDP_TIMEOUT_S": "60"}


def _fit(args: list[str]) -> tuple[int, str]:
    return finish(start_main(args, _env()), timeout=600)


@pytest.mark.parametrize(("devices", "rank", "between_epochs"), [(1, 0, False), (2, 1, False), (2, -1, False),
                                                                  (2, -1, True)],
                         ids=["one-process", "two-processes-rank-1", "two-processes-both",
                              "two-processes-both-between-epochs"])
def test_a_killed_loader_worker_saves_on_every_rank_names_itself_and_exits_4(tiny_data, tmp_path, devices, rank,
                                                                             between_epochs):
    code, out = _fit(_args(tiny_data, tmp_path, devices, *_kill_worker(rank, between_epochs)))
    assert code == 4, out[-5000:]
    assert "Traceback" not in out and "exited unexpectedly" not in out, out[-5000:]
    killed = re.findall(r"SIGKILL to loader worker pid (\d+) of rank (\d+)", out)
    assert len(killed) == (2 if rank == -1 else 1), out[-5000:]
    said = [line for line in out.splitlines() if line.startswith("A training loader worker died:")]
    assert len(said) == 1, out[-5000:]  # once, from rank 0, whichever rank's worker died
    for pid, its_rank in killed:
        where = f" (rank {its_rank})" if devices == 2 else ""
        assert f"pid {pid}{where} was killed by SIGKILL in epoch 2, at step " in said[0], said[0]
    assert "out-of-memory killer" in said[0] and "dmesg" in said[0] and "--data.num_workers (2 per process now)" \
        in said[0], said[0]
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert STEPS + 2 < step <= 2 * STEPS, step  # after the kill, in its epoch
    if devices == 2:  # at a step the ranks agree on: every rank stopped there
        assert step % LOG_EVERY == 0 and "(all 2 processes stopped at the step they agreed on)" in said[0], said[0]
    code, out = _fit(_args(tiny_data, tmp_path, devices, "--ckpt_path", "last"))
    assert code == 0 and "Done: best val/acc1" in out, out[-5000:]
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3 * STEPS


def test_the_train_loader_names_a_killed_worker_and_goes_on_from_its_last_batch():
    """In-process, a forkserver ResumableLoader of 2 workers: worker 0 SIGKILLed after 3 batches; the loader
    records its pid and signal (the fork server's report) and delivers the rest of the epoch from new workers,
    the same batches in the same order as an uninterrupted loader, none replayed, none skipped."""
    from datamodules.processes import dead_workers
    from datamodules.resume import EpochSampler, ResumableLoader

    data = list(range(64))

    def loader(workers: int) -> ResumableLoader:
        sampler = EpochSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
        context = {"multiprocessing_context": "forkserver"} if workers else {}
        return ResumableLoader(data, batch_size=4, sampler=sampler, num_workers=workers, **context)

    dead_workers.forget()
    killed = loader(2)
    batches = iter(killed)
    got = [next(batches).tolist() for _ in range(3)]
    pid = killed._iterator._workers[0].pid
    os.kill(pid, signal.SIGKILL)
    got += [batch.tolist() for batch in batches]
    assert got == [batch.tolist() for batch in loader(0)]
    assert [(d.pid, d.how()) for d in dead_workers.recorded] == [(pid, "was killed by SIGKILL")]
    dead_workers.forget()


def test_a_killed_worker_of_a_loader_nobody_records_is_named_with_its_signal():
    """A validation loader's worker (no ResumableLoader records it) SIGKILLed under the fork server: torch's message
    has no signal ("exited unexpectedly"); the paragraph reads the worker's exit status from the loader that raised.
    The fault campaign of issue 52 got "A loader worker died: pid N ended." with no signal and no cause."""
    from datamodules.processes import dead_workers

    data = torch.utils.data.TensorDataset(torch.arange(10_000))
    loader = torch.utils.data.DataLoader(data, batch_size=1, num_workers=1, multiprocessing_context="forkserver")
    batches = iter(loader)
    os.kill(batches._workers[0].pid, signal.SIGKILL)  # before its first batch: torch's liveness check finds it
    with pytest.raises(RuntimeError, match="exited unexpectedly") as raised:
        next(batches)
    said = dead_workers.unsaved_paragraph(raised.value)
    assert said is not None and "was killed by SIGKILL" in said and "dmesg" in said, said


def test_a_persistent_worker_killed_between_epochs_is_recorded_and_the_next_epoch_runs_whole():
    """In-process, a forkserver ResumableLoader with persistent workers: worker 0 SIGKILLed after epoch 0 (as in
    the validation). torchdata finds the death as the next epoch starts, in `iter()`; the fault campaign of issue 52
    found that this ended the run unsaved on every rank. The loader records it and runs the epoch from new workers:
    the samples of the epoch, in its order, none replayed, none skipped."""
    from datamodules.processes import dead_workers
    from datamodules.resume import EpochSampler, ResumableLoader

    data = list(range(32))

    def loader(workers: int) -> ResumableLoader:
        sampler = EpochSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
        context = {"multiprocessing_context": "forkserver", "persistent_workers": True} if workers else {}
        return ResumableLoader(data, batch_size=4, sampler=sampler, num_workers=workers, **context)

    dead_workers.forget()
    killed = loader(1)
    assert len(list(killed)) == 8
    pid = killed._iterator._workers[0].pid
    os.kill(pid, signal.SIGKILL)
    killed.sampler.set_epoch(1)
    got = [batch.tolist() for batch in killed]
    uninterrupted = loader(0)
    uninterrupted.sampler.set_epoch(1)
    assert got == [batch.tolist() for batch in uninterrupted]
    assert [(d.pid, d.how()) for d in dead_workers.recorded] == [(pid, "was killed by SIGKILL")]
    dead_workers.forget()


@pytest.mark.parametrize(("rank", "loader"), [(1, "training"), (-1, "training"), (-1, "validation")],
                         ids=["two-processes-rank-1", "two-processes-both", "two-processes-both-validation-worker"])
def test_a_worker_killed_after_its_last_batch_of_the_fit_is_named_and_the_finished_fit_exits_0(tiny_data, tmp_path,
                                                                                               rank, loader):
    """A train loader worker SIGKILLed as the last epoch's validation starts, or a validation worker as it ends:
    the loader had delivered its last batch of the fit, so nothing reads the death, and nothing is lost: every epoch
    trained, scored once, last.ckpt the fit's end. The fit ends as finished (exit 0, its Done line), with the dead
    worker's paragraph once (the ranks' deaths gathered at the end of the fit): the node's OOM killer is at work,
    and the next run should know. Before, nothing said it."""
    when = -1 if loader == "training" else -2  # the last validation's start, or its end
    code, out = _fit(_args(tiny_data, tmp_path, 2, "--trainer.callbacks+=tests.helpers.callbacks.KillLoaderWorkerAt",
                           "--trainer.callbacks.epoch=2", f"--trainer.callbacks.batch={when}",
                           f"--trainer.callbacks.rank={rank}"))
    assert code == 0 and "Done: best val/acc1" in out and "Traceback" not in out, out[-5000:]
    killed = re.findall(r"SIGKILL to loader worker pid (\d+) of rank (\d+)", out)
    assert len(killed) == (2 if rank == -1 else 1), out[-5000:]
    said = [line for line in out.splitlines() if line.startswith(f"A {loader} loader worker died after its last batch")]
    assert len(said) == 1, out[-5000:]
    for pid, its_rank in killed:
        assert f"pid {pid} (rank {its_rank}) was killed by SIGKILL in epoch 3, at step {3 * STEPS}" in said[0], said[0]
    assert "dmesg" in said[0] and "--data.num_workers (2 per process now)" in said[0] and "exit status 0" in said[0]
    run = tmp_path / "version_0"
    steps = [step for step, _ in scalars(run, "val/acc1")]
    assert len(steps) == 3 and len(set(steps)) == 3, steps  # every epoch scored once
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 3 * STEPS
    assert all(bool(torch.isfinite(v).all()) for v in state["state_dict"].values() if v.is_floating_point())


def test_a_dead_worker_its_fork_server_has_not_reaped_yet_is_recorded_with_its_signal():
    """A fork server's child stays a zombie until the server reaps it and reports its status; on the loaded test
    VM that took seconds, and the end-of-fit check above missed a death (exit code None). A zombie is dead: its
    status is awaited. Here the server is frozen (SIGSTOP) while the worker is killed and thawed a moment later."""
    import multiprocessing
    import threading
    import time
    from multiprocessing import forkserver

    from datamodules.processes import dead_workers

    worker = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    worker.start()
    server = forkserver._forkserver._forkserver_pid
    dead_workers.forget()
    try:
        os.kill(server, signal.SIGSTOP)
        os.kill(worker.pid, signal.SIGKILL)
        while Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        threading.Timer(0.5, os.kill, (server, signal.SIGCONT)).start()
        dead_workers.record_ended([worker])
    finally:
        os.kill(server, signal.SIGCONT)
    assert [(d.pid, d.how()) for d in dead_workers.recorded] == [(worker.pid, "was killed by SIGKILL")]
    dead_workers.forget()


def test_a_batch_read_from_a_killed_validation_worker_before_its_death_is_reported_names_the_worker():
    """A validation worker SIGKILLed after it queued a batch, its death not yet reported by the fork server (it
    took seconds on the loaded VM): reading that batch's shared memory from the dead worker fails with torch's raw
    ConnectionRefusedError (torch names the worker only when it already reads as dead: dataloader.py,
    `_try_get_data`), which ended the run with a traceback, or, worded "connection reset by peer" or "received 0
    items of ancdata" (a transfer cut), as a lost peer on every rank: the fault campaign's unexplained exit 1 of
    issue 52. The error comes from a loader whose worker died, so it is that death: the worker's paragraph."""
    import threading
    import time
    from multiprocessing import forkserver

    from datamodules.processes import dead_workers

    data = torch.utils.data.TensorDataset(torch.zeros(64, 1000))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="forkserver")
    batches = iter(loader)
    next(batches)
    worker, server = batches._workers[0], forkserver._forkserver._forkserver_pid
    while batches._data_queue.qsize() < 2:  # its next batches wait in the queue, their storage in the worker
        time.sleep(0.01)
    try:
        os.kill(server, signal.SIGSTOP)
        os.kill(worker.pid, signal.SIGKILL)
        while Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        threading.Timer(0.5, os.kill, (server, signal.SIGCONT)).start()
        with pytest.raises(OSError) as raised:  # ConnectionRefusedError
            next(batches)
    finally:
        os.kill(server, signal.SIGCONT)
    said = dead_workers.unsaved_paragraph(raised.value)
    assert said is not None and f"pid {worker.pid} was killed by SIGKILL" in said and "dmesg" in said, said


@pytest.mark.parametrize("rank", [1, -1], ids=["two-processes-rank-1", "two-processes-both"])
def test_validation_workers_killed_mid_validation_save_the_epoch_and_every_epoch_is_scored_once(tiny_data, tmp_path,
                                                                                                rank):
    """Every validation worker SIGKILLed at the second validation's batch 1 (the fork server frozen, so that queued
    batches are read from dead workers before their deaths are known, as on a loaded node): the validation goes on
    with new workers from its first batch not delivered and ends whole, then every rank stops at the epoch's end,
    saves last.ckpt (epoch 2's training, finite) and the run exits 4 with the workers' paragraph; `--ckpt_path last`
    trains and scores epoch 3, so every epoch is scored once. Before, the death ended the run unsaved (exit 4,
    "Nothing was saved"): epoch 2's training was lost; earlier still, as a lost peer on both ranks."""
    kill = "--trainer.callbacks+=tests.helpers.callbacks.KillValWorkersUnreported"
    code, out = _fit(_args(tiny_data, tmp_path, 2, kill, "--trainer.callbacks.epoch=1", "--trainer.callbacks.batch=1",
                           f"--trainer.callbacks.rank={rank}"))
    assert code == 4, out[-5000:]
    assert "Traceback" not in out and "Distributed run failed" not in out, out[-5000:]
    killed = re.findall(r"SIGKILL to validation workers \[([\d, ]+)\] of rank (\d)", out)
    assert len(killed) == (2 if rank == -1 else 1), out[-5000:]
    said = [line for line in out.splitlines() if line.startswith("A validation loader worker died:")]
    assert len(said) == 1, out[-5000:]  # once, from rank 0, whichever rank's workers died
    for pids, its_rank in killed:
        for pid in pids.split(", "):
            assert f"pid {pid} (rank {its_rank}) was killed by SIGKILL in epoch 2, at step {2 * STEPS}" in said[0]
    assert "dmesg" in said[0] and "scored whole, once" in said[0] and "last.ckpt (all 2 processes" in said[0], said[0]
    run = tmp_path / "version_0"
    assert len(scalars(run, "val/acc1")) == 2, out[-5000:]  # epoch 2's validation ran to its end and was scored
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 2 * STEPS  # epoch 2's training kept
    assert all(bool(torch.isfinite(v).all()) for v in state["state_dict"].values() if v.is_floating_point())
    code, out = _fit(_args(tiny_data, tmp_path, 2, "--ckpt_path", "last"))
    assert code == 0 and "Done: best val/acc1" in out and "Traceback" not in out, out[-5000:]
    steps = [step for step, _ in scalars(run, "val/acc1")]
    assert len(steps) == 3 and len(set(steps)) == 3, steps  # every epoch scored once


def test_two_workers_killed_at_once_are_both_named_though_torch_names_one():
    """Two train workers SIGKILLed together, the second's death not yet reported by the fork server when torch
    names the first: the paragraph named one of the two (the fault campaign's kill of every fork server's
    children). Each worker of the loader found ended is recorded with the one torch names."""
    import threading
    import time
    from multiprocessing import forkserver

    from datamodules.processes import dead_workers
    from datamodules.resume import EpochSampler, ResumableLoader

    data = list(range(256))
    sampler = EpochSampler(data, num_replicas=1, rank=0, shuffle=False, seed=0, drop_last=True)
    loader = ResumableLoader(data, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="forkserver")
    dead_workers.forget()
    batches = iter(loader)
    next(batches)
    first, second = loader._iterator._workers
    server = forkserver._forkserver._forkserver_pid
    os.kill(first.pid, signal.SIGKILL)
    first.join()  # its death reported
    try:
        os.kill(server, signal.SIGSTOP)
        os.kill(second.pid, signal.SIGKILL)
        while Path(f"/proc/{second.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        threading.Timer(0.5, os.kill, (server, signal.SIGCONT)).start()
        rest = [batch.tolist() for batch in batches]
    finally:
        os.kill(server, signal.SIGCONT)
    assert len(rest) == 63
    assert sorted((d.pid, d.how()) for d in dead_workers.recorded) == sorted(
        [(first.pid, "was killed by SIGKILL"), (second.pid, "was killed by SIGKILL")])
    dead_workers.forget()


@pytest.mark.parametrize("persistent", [False, True], ids=["one-pass", "persistent-between-passes"])
def test_a_fit_validation_loader_goes_on_with_new_workers_from_its_first_batch_not_delivered(persistent):
    """In-process, a forkserver EvaluationLoader in a fit (restart_evaluation): worker 0 SIGKILLed after 3 batches
    of a pass (persistent: between two passes); the loader records the death as a validation worker's and delivers
    the rest of the pass from new workers, the batches of an uninterrupted pass, none replayed, none skipped; the
    next pass runs whole. Before, the death ended the fit unsaved: the epoch's training since the last save lost."""
    from datamodules.processes import dead_workers
    from datamodules.processes.evaluation_loader import EvaluationLoader

    data = torch.utils.data.TensorDataset(torch.arange(40))
    loader = EvaluationLoader(data, batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                              persistent_workers=persistent)
    whole = [batch[0].tolist() for batch in torch.utils.data.DataLoader(data, batch_size=4)]
    dead_workers.forget()
    dead_workers.restart_evaluation = True
    try:
        batches = iter(loader)
        got = [next(batches)[0].tolist() for _ in range(3)]
        if persistent:
            got += [batch[0].tolist() for batch in batches]
            assert got == whole
            got, batches = [], iter(loader)
        # the torch iterator the loader's generator reads from (a plain loader returns it itself)
        running = loader._iterator or getattr(batches, "gi_frame", None) and batches.gi_frame.f_locals["batches"]
        pid = (running or batches)._workers[0].pid
        os.kill(pid, signal.SIGKILL)
        got += [batch[0].tolist() for batch in batches]
        assert got == whole
        assert [batch[0].tolist() for batch in loader] == whole  # the next pass whole
        assert [(d.pid, d.how(), d.loader) for d in dead_workers.recorded] == [(pid, "was killed by SIGKILL",
                                                                               "validation")]
    finally:
        dead_workers.restart_evaluation = False
        dead_workers.forget()
