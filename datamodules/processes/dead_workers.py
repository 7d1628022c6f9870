"""A loader worker that dies while the training process is healthy (SIGKILL from the kernel's OOM killer above all):
which one, by which signal, and what to do.

torch learns of a dead worker in two ways (torch/utils/data/dataloader.py, `_try_get_data`; the same code in
torchdata's stateful_dataloader.py): a SIGCHLD handler in the training process (_utils/signal_handling.py, which
raises "DataLoader worker (pid N) is killed by signal: Killed." from wherever the main thread happens to be), and,
each time a batch is awaited for MP_STATUS_CHECK_INTERVAL (5 s) in vain, a liveness check of every worker, which
raises "DataLoader worker (pid(s) N) exited unexpectedly" with no cause. Under --data.worker_start forkserver (the
default) a worker is the fork server's child, not the training process's, so no SIGCHLD comes and only the second
message does. The cause is still known: the server waits for its children and writes each one's exit status into
that child's status pipe (multiprocessing/forkserver.py, `main`: `os.waitstatus_to_exitcode`), which the worker's
`Process.exitcode` reads (multiprocessing/popen_forkserver.py, `poll`): -9 for SIGKILL. A forked or spawned worker's
`exitcode` comes from the training process's own `waitpid` (popen_fork.py).

The train loader (datamodules/resume.py, `ResumableLoader`) records each death here and starts its workers again
from its state as of the last batch it yielded, so that the training process goes on, in step with the other ranks,
to the next step where the ranks agree on stop signals; there every rank stops and saves (lightning_app/callbacks/
stop_signals.py, WORKER_DIED) and the run exits with EXIT_WORKER_DIED and `paragraph`. A fit's validation loader
does the same from the first batch it had not delivered (datamodules/processes/evaluation_loader.py): the
validation ends whole, and the ranks stop at their next agreement (the epoch's end, after an epoch's validation).
"""
from __future__ import annotations

import multiprocessing.connection
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

EXIT_WORKER_DIED = 4  # docs/clusters.md, "Faults": beside a bad setting (2), a diverged run (3), a lost peer (1)
RESTARTS_PER_ITERATOR = 3  # a worker that dies again at once (a crash on one sample) ends the run unsaved
READ_ERROR_WAIT_S = 5.0  # torch's own interval of worker checks (torch/utils/data/_utils/__init__.py)
# the two messages of torch (see the module doc)
_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly|is killed by signal)")


@dataclass
class DeadWorker:
    pid: int
    exitcode: int | None  # negative: the signal that ended it (multiprocessing's convention)
    rank: int = 0
    epoch: int | None = None  # from 1: the epoch and step the training process was in when it found the death
    step: int | None = None
    loader: str = "training"  # whose worker: "training", or "validation" (found at the end of a fit)

    def how(self) -> str:
        code = self.exitcode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        if code == 255:  # popen_forkserver.poll: the server gave no status (it may have been killed too)
            return "ended (its fork server gave no exit status: it may have been killed too)"
        return f"exited with status {code}" if code is not None else "ended"


recorded: list[DeadWorker] = []  # this process's, since the fit began (forget)
# whether a validation loader goes on with new workers after a death (datamodules/processes/evaluation_loader.py):
# in a fit, whose ranks then stop and save (set by lightning_app/callbacks/stop_signals.py)
restart_evaluation = False


def forget() -> None:
    recorded.clear()


def died_pids(error: BaseException) -> list[int]:
    """The worker pids torch's dead-worker error names, or [] when `error` is no such error."""
    found = _DIED.search(str(error))
    return [int(pid) for pid in found.group(1).replace(" ", "").split(",") if pid] if found else []


def record(error: BaseException, workers: list, wait_s: float = READ_ERROR_WAIT_S,
           loader: str = "training") -> list[DeadWorker]:
    """The workers (multiprocessing Process objects of a loader's iterator) that `error` shows dead, recorded; []
    when it shows none.

    torch's message names them. An error reading a batch (ConnectionError, or another OSError) may too: a batch's
    shared memory travels as a file descriptor that the training process fetches from the worker that made it
    (torch/multiprocessing/reductions.py, `rebuild_storage_fd` -> multiprocessing/resource_sharer.py), and a
    worker killed after it queued the batch no longer answers; torch raises that error as it is when the worker's
    death is not known yet (dataloader.py, `_try_get_data`: the server reports it a moment later); with pinned
    memory the pin thread, which reads the batches, ends on it, and torch says "Pin memory thread exited
    unexpectedly" (dataloader.py, `_get_data`). So for an error without a pid the workers are watched for up
    to `wait_s` seconds for one that ended."""
    pids = set(died_pids(error))
    deadline = time.monotonic() + wait_s
    while not pids and time.monotonic() < deadline:
        pids = {w.pid for w in workers if not w.is_alive()}
        if not pids:
            time.sleep(0.1)
    # and those torch did not name: killed with it, their deaths not reported yet (the fork server's zombies)
    known = {d.pid for d in recorded}
    pids |= {w.pid for w in workers if w.pid not in pids | known and (w.exitcode not in (None, 0) or _zombie(w))}
    dead = [DeadWorker(w.pid, w.exitcode, loader=loader) for w in workers if w.pid in pids]
    dead = dead or [DeadWorker(pid, None, loader=loader) for pid in sorted(pids)]
    recorded.extend(dead)
    return dead


def end_workers(iterator) -> None:
    """Ends a loader iterator's workers before new ones start: torch's shutdown, then SIGKILL for any it left alive
    (torch ends a stuck worker with SIGTERM, which ours ignore: datamodules/processes/loader_workers.py)."""
    workers = list(getattr(iterator, "_workers", []))
    iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            worker.kill()


def through_restarts(batches: Iterator, restart: Callable[[BaseException], Iterator], restarts: int = 0) -> Iterator:
    """`batches`; where one raises torch's error (RuntimeError, OSError), the rest from `restart(error)`, which
    records the death and starts new workers, or raises the error when it shows none. A worker that dies again at
    once (a crash on one sample) ends it: past RESTARTS_PER_ITERATOR restarts the error is raised, unrecorded. The
    train loader (datamodules/resume.py) and the validation loader (evaluation_loader.py) each go through here."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (RuntimeError, OSError) as error:
            if restarts >= RESTARTS_PER_ITERATOR:
                raise
            batches, restarts = restart(error), restarts + 1
            continue
        yield batch


def record_ended(workers: list, loader: str = "training") -> None:
    """Records the workers of a loader's iterator found ended and not yet recorded: at a stop, a death the loader
    has not met yet (it meets one only when it awaits that worker's next batch)."""
    known = {d.pid for d in recorded}  # exit status 0: a worker its loader shut down (an epoch's end)
    for worker in workers:
        if worker.pid not in known and (worker.exitcode not in (None, 0) or _zombie(worker)):
            recorded.append(DeadWorker(worker.pid, worker.exitcode, loader=loader))


def _zombie(worker, wait_s: float = READ_ERROR_WAIT_S) -> bool:
    """Whether `worker` has ended though its exit status is not known yet (then waited for, up to `wait_s`): a
    fork server's child stays a zombie until the server, woken by its SIGCHLD, reaps it and reports the status
    (multiprocessing/forkserver.py, `main`); on a loaded node that took seconds, and the death went unseen."""
    try:
        with open(f"/proc/{worker.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return False
    if state != "Z":
        return False
    multiprocessing.connection.wait([worker.sentinel], timeout=wait_s)
    return worker.exitcode != 0


def stamp(epoch: int, step: int) -> None:
    """Gives the deaths not yet placed the epoch and step (from 1) the training process is about to run."""
    for dead in recorded:
        if dead.epoch is None:
            dead.epoch, dead.step = epoch, step


def paragraph(deaths: list[DeadWorker], num_workers: int | None, world_size: int, saved: str | None,
              loader: str | None = None, finished: bool = False) -> str:
    """The one paragraph a fit stopped by dead loader workers ends with; `finished`: of a fit that ran to its end,
    the workers having died after their loader's last batch (`saved`: its last checkpoint)."""
    which = "; ".join(
        f"pid {d.pid}{f' (rank {d.rank})' if world_size > 1 else ''} {d.how()}"
        + (f" in epoch {d.epoch}, at step {d.step}" if d.epoch is not None else "") for d in deaths)
    killed = any(d.exitcode == -signal.SIGKILL for d in deaths)
    bus = any(d.exitcode == -signal.SIGBUS for d in deaths)
    workers = f" ({num_workers} per process now)" if num_workers else ""
    cause = ("A SIGKILL that no process of this run sent is most often the kernel's out-of-memory killer: "
             "`dmesg -T | grep -i -E 'out of memory|killed process'` (or `journalctl -k`) names the process it chose. "
             if killed else
             "A SIGBUS in a worker is most often a full shared memory (/dev/shm; `df -h /dev/shm`). " if bus else "")
    ranks = f" (all {world_size} processes stopped at the step they agreed on)" if world_size > 1 else ""
    kept = (f"The run saved {saved}{ranks} and stopped; resume with --ckpt_path last." if saved else
            "Nothing was saved; --ckpt_path last resumes from the last checkpoint on disk.")
    if loader is None:  # whose workers: "training", "validation", or both kinds
        kinds = {d.loader for d in deaths}
        loader = f"{kinds.pop()} loader" if len(kinds) == 1 else "loader"
    if finished:
        return (f"A {loader} worker died after its last batch of the fit: {which}. {cause}Nothing was lost: every "
                f"epoch was trained and scored, and {saved or 'the last checkpoint'} holds the end of the fit, so the "
                f"run ends as finished (exit status 0). Before the next run on this node, lower "
                f"--data.num_workers{workers} or --data.batch_size, or give the job more memory.")
    validated = sorted({d.epoch for d in deaths if d.loader == "validation" and d.epoch is not None})
    if saved and validated:
        which_epochs = " and ".join(str(e) for e in validated)
        kept = (f"The validation of epoch {which_epochs} went on with new workers from its first batch not delivered "
                f"and was scored whole, once. {kept}")
    return (f"A {loader} worker died: {which}. {cause}Lower --data.num_workers{workers} or --data.batch_size, "
            f"or give the job more memory. {kept}")


def unsaved_paragraph(error: BaseException) -> str | None:
    """The paragraph for a dead-worker error that ended the run unsaved (a worker of a validate or test command's
    loader; workers that kept dying), else None."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:  # the error and what it was raised from (Lightning re-raises)
        seen.add(id(e))
        pids = died_pids(e)
        if pids:
            deaths = ([d for d in recorded if d.pid in pids]
                      or [DeadWorker(pid, _exitcode_in_traceback(e, pid) or _signal_said(str(e))) for pid in pids])
            return paragraph(deaths, None, 1, None, "loader")
        deaths = _ended_behind_a_read_error(e)
        if deaths:
            return paragraph(deaths, None, 1, None, "loader")
        e = e.__cause__ or e.__context__
    return None


def _ended_behind_a_read_error(error: BaseException, wait_s: float = READ_ERROR_WAIT_S) -> list[DeadWorker]:
    """The workers of the loader iterator that raised `error` that have ended, when `error` is what reading a batch
    from a dead worker raises before torch knows of the death (see `record`): ConnectionRefusedError (the batch's
    storage lives in the dead worker), a connection reset, EOF, or "received 0 items of ancdata" (the transfer cut).
    Torch names the worker only when it already reads as dead, and under the fork server its death is reported a
    moment later, seconds on a loaded node: unnamed, the error ended the run in a traceback, or, worded "reset by
    peer" or "recv", as a lost peer. A worker's own exception that torch re-raises is never one of these."""
    if not (isinstance(error, (ConnectionError, EOFError, OSError)) or "ancdata" in str(error)) \
            or "in DataLoader worker process" in str(error):
        return []
    workers, tb = [], error.__traceback__
    while tb is not None:
        workers += [w for w in getattr(tb.tb_frame.f_locals.get("self"), "_workers", None) or [] if hasattr(w, "pid")]
        tb = tb.tb_next
    deadline = time.monotonic() + wait_s
    while workers:
        ended = [w for w in {w.pid: w for w in workers}.values() if w.exitcode not in (None, 0) or _zombie(w)]
        if ended or time.monotonic() >= deadline:
            return [DeadWorker(w.pid, w.exitcode) for w in ended]
        time.sleep(0.1)
    return []


def _exitcode_in_traceback(error: BaseException, pid: int) -> int | None:
    """The exit status of worker `pid` from the loader iterator that raised `error` (its `_workers`, the Process
    objects torch's `_try_get_data` checked): a validation loader's death is recorded by nobody, and under the fork
    server torch's message has no signal, so the paragraph said only "ended"; the fork server's status says -9."""
    tb = error.__traceback__
    while tb is not None:
        for worker in getattr(tb.tb_frame.f_locals.get("self"), "_workers", None) or []:
            if getattr(worker, "pid", None) == pid:
                return worker.exitcode
        tb = tb.tb_next
    return None


def _signal_said(message: str) -> int | None:
    """-signal for torch's "is killed by signal: Killed." (strsignal's words), else None."""
    said = re.search(r"is killed by signal: ([^.\n]+)", message)
    if said:
        for sig in signal.Signals:
            if signal.strsignal(sig) == said.group(1).strip():
                return -sig
    return None
