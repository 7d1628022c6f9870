"""Processes for multi-process tests, started one way: command lines (`main.py` nodes on 127.0.0.1 above all) with
start_command / start_main / start_nodes, waited for with finish / finish_all, which kill what runs past its
time; Python functions in processes of their own, all released at once, with in_processes (in_child: one; in_fork:
one, forked). And a free port on 127.0.0.1."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- where a process that ran past its time stood -------------------------------------------------------------

def _py_spy() -> str | None:
    """py-spy, where it may attach to this user's processes (root, or Yama's ptrace_scope 0; CI runners have 1)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = 0
    return exe if exe and (os.geteuid() == 0 or scope == 0) else None


PY_SPY = _py_spy()


def stack_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child `stop_tree` may stop: without py-spy, faulthandler on, so that SIGABRT prints its stacks."""
    return env if PY_SPY else {**env, "PYTHONFAULTHANDLER": "1"}


def running(pid: int) -> bool:
    """Whether process `pid` runs: there, and not a zombie (a dead child not yet waited for), proc(5)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    """pid and every descendant of it (Linux /proc), parents first."""
    tree = [pid]
    for parent in tree:  # grows while it is walked
        try:
            tree += [int(child) for task in os.listdir(f"/proc/{parent}/task")
                     for child in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return tree


def _stack(pid: int) -> str:
    """py-spy's dump of `pid`; without py-spy, its faulthandler's, into its own stderr after a line naming it."""
    try:
        if PY_SPY is None:
            with open(f"/proc/{pid}/fd/2", "a") as err:
                err.write(f"\n--- pid {pid}, SIGABRT:\n")
            os.kill(pid, signal.SIGABRT)
            time.sleep(0.3)  # one at a time: the processes of a tree share their stderr
            return ""
        dump = subprocess.run([PY_SPY, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=20, check=False)
        return f"--- pid {pid}:\n{dump.stdout}{dump.stderr}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--- pid {pid}: {e}\n"


def stop_tree(proc: subprocess.Popen) -> str:
    """For a test's failure output, once `proc` ran past its time: where each process of its tree stood (py-spy
    dump --native, else the stacks faulthandler prints on SIGABRT, stack_env), then the tree killed, and the end
    of what `proc` wrote."""
    tree = process_tree(proc.pid)

    def stop() -> list[str]:
        stacks = [_stack(pid) for pid in tree]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return stacks

    with ThreadPoolExecutor(1) as pool:  # its pipes read meanwhile: a process writing into a full one would block
        stopping = pool.submit(stop)
        try:
            out = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            out = ("(its output is still held open)",)
        stacks = stopping.result()
    first = [part.find("\n--- pid ") if part else -1 for part in out]  # from the first SIGABRT stack on, all
    written = "\n".join(part[max(0, at - 5000) if at >= 0 else -20000:]
                        for part, at in zip(out, first, strict=True) if part)
    return f"stacks of processes {tree}:\n" + "".join(stacks) + f"\n--- what it wrote last:\n{written}"


# -- command lines -------------------------------------------------------------------------------------------

def start_command(cmd: list[str], env: dict[str, str] | None = None, *, log: Path | None = None,
                  session: bool = False, cwd: Path = REPO) -> subprocess.Popen:
    """`cmd` started in `cwd` (the repository), not waited for: stdout and stderr together into a pipe (text) or
    the file `log`. env: the whole environment (default: this process's, unbuffered). session: in a session (and
    process group) of its own, which a signal to the group reaches without reaching the tests."""
    env = stack_env({**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env)
    if log is None:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=session)
    with open(log, "w") as out:  # the child writes to its own copy
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=session)


def start_main(args: list[str], env: dict[str, str] | None = None, *, log: Path | None = None,
               session: bool = False, cwd: Path = REPO) -> subprocess.Popen:
    """`python main.py ARGS` started as a user starts it (cli.run_main is the same, waited for), in `cwd`."""
    script = "main.py" if cwd == REPO else str(REPO / "main.py")
    return start_command([sys.executable, script, *args], env, log=log, session=session, cwd=cwd)


def start_nodes(args: list[str] | Callable[[int], list[str]], nodes: int = 2, env: dict[str, str] | None = None, *,
                logs: list[Path] | None = None, cwds: list[Path] | None = None) -> list[subprocess.Popen]:
    """`python main.py ARGS` once per node, as `nodes` machines start it: NODE_RANK 0 to nodes - 1, their master
    at 127.0.0.1 on a free port, OpenMP on one thread each. args: the same for every node, or a function of the
    node's rank. env: what they start from (default: this process's environment). cwds: each node's working
    directory (default: the repository); a relative path then names a different folder on each node, as a
    node-local disk mounted at the same place does."""
    args_of = args if callable(args) else (lambda _rank: args)
    common = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return [start_main(args_of(rank), {**common, "NODE_RANK": str(rank)}, log=logs[rank] if logs else None,
                       cwd=cwds[rank] if cwds else REPO)
            for rank in range(nodes)]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """(exit status, output) of `proc` once it ends ("" where it writes to a file); killed if it runs past
    `timeout` seconds (subprocess.TimeoutExpired is raised) or the wait is interrupted."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired as e:
        e.add_note(stop_tree(proc))
        raise
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out or ""


def finish_all(procs: list[subprocess.Popen], timeout: float = 300) -> tuple[list[int], list[str]]:
    """finish() of every process at the same time (no pipe fills while another process is waited for): their
    exit statuses and outputs. Where one fails to end in time, every one still running is killed."""
    with ThreadPoolExecutor(len(procs)) as pool:
        waits = [pool.submit(finish, proc, timeout) for proc in procs]
        try:
            done = [wait.result() for wait in waits]
        except BaseException:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            raise
    return [code for code, _ in done], [out for _, out in done]


# -- Python functions ----------------------------------------------------------------------------------------

def _run_one(fn, rank: int, args: tuple, start, results, timeout: float, spawned: bool) -> None:
    if spawned:
        # A spawned child takes "spawn" as its default start method (multiprocessing/spawn.py, `prepare`), so a
        # DataLoader of fn's would start each worker as a fresh interpreter: back to the default of a process
        # started as `python` is (fork up to 3.13), as a rank torchrun starts has.
        multiprocessing.set_start_method(None, force=True)
    try:
        start.wait(timeout)  # every process released at the same instant
        outcome = (rank, True, fn(rank, *args))
    except BaseException as e:  # noqa: BLE001 - raised again in the caller's process
        e.add_note(f"in process {rank} of {fn.__qualname__} (pid {os.getpid()}):\n{traceback.format_exc()}")
        outcome = (rank, False, e)
    try:
        pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - what cannot travel is named instead
        outcome = (rank, False, RuntimeError(f"process {rank}: {outcome[2]!r} cannot be pickled back"))
    results.put(outcome)


def _the_others(procs: list, results, got: dict, failed: int, wait: float = 5) -> str:
    """What the processes other than `failed` did, given `wait` seconds to say: which of them raised what first
    is not always the cause (a rank whose peer crashed reports a closed connection)."""
    said, until = {}, time.monotonic() + wait
    while len(said) + len(got) + 1 < len(procs) and time.monotonic() < until:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        said[rank] = "returned" if ok else f"raised {type(value).__name__}: {value}"
    lines = []
    for rank, proc in enumerate(procs):
        if rank != failed and rank not in got:
            state = "still running" if proc.exitcode is None else f"exit status {proc.exitcode}"
            lines.append(f"process {rank}: {said.get(rank, 'said nothing')} ({state})")
    return "the other processes: " + ("; ".join(lines) or "all had returned")


def in_processes(fn, n: int, *args, method: str = "spawn", timeout: float = 120) -> list:
    """[fn(0, *args), ..., fn(n - 1, *args)], each call in a process of its own, all released at once. An exception
    raised in one is raised here (its traceback in a note); a process that dies, or runs past `timeout` seconds, is
    an error too. Every process has ended when this returns.

    method: spawn (a fresh interpreter; fn a module's top-level function, args picklable), or fork. Not fork from
    pytest: its process holds the threads of every earlier test (moto's server, pools, tqdm's monitor), and a child
    forked while one of them holds a lock waits on it for ever (a forked child hung that way in CI)."""
    ctx = multiprocessing.get_context(method)
    start, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_run_one, args=(fn, rank, args, start, results, timeout, method == "spawn"))
             for rank in range(n)]
    for proc in procs:
        proc.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < n:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if rank not in got and p.exitcode]
                if dead:
                    try:  # what it sent just before it ended may still be in the pipe
                        rank, ok, value = results.get(timeout=1)
                    except queue.Empty:
                        raise RuntimeError(f"process {dead[0][0]} of {fn.__qualname__} died (exit status "
                                           f"{dead[0][1]})") from None
                elif time.monotonic() > deadline:
                    late = TimeoutError(f"{n - len(got)} of {n} processes of {fn.__qualname__} still ran after "
                                        f"{timeout} s")
                    late.add_note("".join(_stack(p.pid) for rank, p in enumerate(procs) if rank not in got)
                                  or "(faulthandler printed their stacks to stderr)")
                    raise late from None
                else:
                    continue
            if not ok:
                value.add_note(_the_others(procs, results, got, rank))
                raise value
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [got[rank] for rank in range(n)]


def _call(_rank: int, fn, args: tuple):
    return fn(*args)


def in_child(fn, *args, timeout: float = 120):
    """fn(*args) in a fresh interpreter (fn a module's top-level function), its result (or exception) brought back;
    past `timeout` seconds, an error.

    For what starts obstore's tokio runtime (an S3 GET through obstore): started in the pytest process, it
    has crashed that process (SIGSEGV in tokio's io driver) once DataLoader workers were forked after it.
    LitData itself keeps obstore out of a process that forks workers (downloader.py, obstore_usable).
    """
    return in_processes(_call, 1, fn, args, timeout=timeout)[0]


def in_fork(fn, *args):
    """fn(*args) in a child forked from this process: for a script whose fork is the point (never pytest's
    process: in_processes says why)."""
    return in_processes(lambda _rank: fn(*args), 1, method="fork")[0]
