"""Node 0 and node 1 of a 2-node `python main.py fit`, one process per namespace of a Link.

Each node gets MASTER_ADDR = node 0's address, NODE_RANK, GLOO_SOCKET_IFNAME = its end of the veth (gloo
otherwise picks the address of the host name, which is no route to the peer), half of this machine's CPUs
(taskset, and OMP_NUM_THREADS to match), and the layout flags after the user's arguments (jsonargparse
applies them left to right): --trainer.num_nodes 2 --trainer.devices 1 --trainer.accelerator cpu. The
nodes are CPU processes: two namespaces on a GPU machine would share its GPUs.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from netsim.link import Link

REPO = Path(__file__).resolve().parents[1]
MASTER_PORT = 29500  # any port is free: each namespace has its own
LAYOUT = ["--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.accelerator", "cpu"]


def cpu_halves() -> tuple[list[int], list[int]]:
    """This process's CPUs split in two (both halves the same single CPU on a 1-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    half = max(1, len(cpus) // 2)
    return cpus[:half], (cpus[half:half * 2] or cpus[:half])


def node_env(link: Link, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    cpus = cpu_halves()[node]
    return {"MASTER_ADDR": link.addresses[0], "MASTER_PORT": str(MASTER_PORT), "NODE_RANK": str(node),
            "GLOO_SOCKET_IFNAME": link.interfaces[node], "OMP_NUM_THREADS": str(len(cpus)),
            "PYTHONUNBUFFERED": "1", **(extra or {})}


def node_command(link: Link, node: int, main_args: Sequence[str], layout: Sequence[str] = LAYOUT,
                 python: str | None = None) -> list[str]:
    """The argv that runs `python main.py ARGS` as `node` inside its namespace, pinned to its CPUs, and killed
    if the process that started it dies (setpriv --pdeathsig: no node outlives a killed `run` or benchmark)."""
    pin = ["taskset", "-c", ",".join(map(str, cpu_halves()[node]))] if shutil.which("taskset") else []
    orphan = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    return [*link.in_namespace(node), *orphan, *pin, python or sys.executable, "main.py", *main_args, *layout]


def shell_line(link: Link, node: int, main_args: Sequence[str]) -> str:
    """The node's command as one shell line, environment first (what --dry-run prints)."""
    env = node_env(link, node)
    keep = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
    return " ".join([*(f"{k}={env[k]}" for k in keep),
                     shlex.join(node_command(link, node, main_args, python="python"))])


class Nodes:
    """The two node processes, each in its own session (so one signal reaches a node and its loader workers),
    their output read line by line into `lines` and handed to `echo`."""

    def __init__(self, link: Link, main_args: Sequence[str] | Sequence[Sequence[str]],
                 env: dict[str, str] | None = None,
                 echo: Callable[[int, str], None] | None = None, layout: Sequence[str] = LAYOUT) -> None:
        per_node = main_args if main_args and not isinstance(main_args[0], str) else [main_args, main_args]
        self.link, self.echo = link, echo
        self.lines: list[list[str]] = [[], []]
        self.procs: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
        try:
            for node in (0, 1):
                proc = subprocess.Popen(
                    node_command(link, node, per_node[node], layout), cwd=REPO,
                    env={**os.environ, **node_env(link, node, env)}, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
                self.procs.append(proc)
                reader = threading.Thread(target=self._read, args=(node, proc), daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _read(self, node: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.lines[node].append(line)
            if self.echo:
                self.echo(node, line)

    def output(self, node: int) -> str:
        return "\n".join(self.lines[node])

    def wait(self, timeout_s: float | None = None) -> list[int | None]:
        """Exit codes once both ended (None for a node still running at the timeout)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for proc in self.procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                break
        self._join_readers()
        return [p.poll() for p in self.procs]

    def signal(self, sig: int, node: int | None = None) -> None:
        for i, proc in enumerate(self.procs):
            if (node is None or node == i) and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGINT, as Ctrl-C in a terminal (Lightning stops at once, without a collective or a checkpoint), then
        SIGKILL after grace_s; whole process groups. Not SIGTERM: the nodes would stop at their next agreement
        and save (lightning_app/callbacks/stop_signals.py), up to log_every_n_steps steps later, which on a
        shaped link can be past the grace period."""
        if grace_s > 0:
            self.signal(signal.SIGINT)
            self.wait(grace_s)
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._join_readers()

    def _join_readers(self) -> None:
        for reader in self._readers:
            if not any(p.poll() is None for p in self.procs):
                reader.join(5)


def exit_status(codes: Sequence[int | None]) -> int:
    """0 when both nodes succeeded; else the first failure, a signal as 128 + its number."""
    for code in codes:
        if code is None:
            return 1
        if code != 0:
            return 128 - code if code < 0 else code
    return 0
