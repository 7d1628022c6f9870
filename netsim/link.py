"""Two simulated hosts: two network namespaces joined by a veth pair, an address each, the link shaped by tc.

Every name starts with `fic<owner pid>x<n>`: namespaces `...n0`/`...n1`, interfaces `...v0`/`...v1`
(at most 15 characters, the kernel's limit), so parallel runs never collide and `down` finds what a killed
run left behind (its owner is gone). Node 0 is 10.213.0.1, node 1 10.213.0.2, on a /30 of their own: no
route leads out of the pair, so traffic stays inside it.

Rate: tbf on each end's egress. Latency and loss: netem, where the kernel has it (many minimal kernels
do not: "Specified qdisc kind is unknown"); then they are refused in one line and the rate still works.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PREFIX = "fic"
ADDRESSES = ("10.213.0.1", "10.213.0.2")
_TAG = re.compile(rf"^({PREFIX}(\d+)x[0-9a-z]+)n[01]$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME = re.compile(r"^\d+(?:\.\d+)?(us|ms|s)$")
_LOSS = re.compile(r"^\d+(?:\.\d+)?%$")
_counter = itertools.count()


class NetsimError(Exception):
    """One line saying what cannot be done here and why (the command-line tool exits 2 with it)."""


def rate_bits(rate: str) -> float:
    """A tc rate ("1gbit", "200mbit", "100mbps" = bytes/s) in bits per second."""
    m = _RATE.match(rate.strip())
    if not m:
        raise NetsimError(f"rate {rate!r} is not a tc rate: write e.g. 1gbit, 200mbit, 500kbit (bits/s) "
                          "or 100mbps (bytes/s)")
    return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]


def _check_time(value: str, what: str) -> str:
    if not _TIME.match(value):
        raise NetsimError(f"{what} {value!r} is not a tc time: write e.g. 10ms, 500us or 1s")
    return value


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetsimError(f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (one line), or None when they can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespaces need the `{tool}` command (iproute2), which is not installed"
    if not _has_net_admin():  # root in a container often lacks it too
        return (f"network namespaces need root or CAP_NET_ADMIN; this process (uid {os.geteuid()}) does not have "
                "CAP_NET_ADMIN")
    probe = f"{PREFIX}{os.getpid()}xprobe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip() or made.returncode}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _has_net_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:")).split()[1]
        return bool(int(caps, 16) & (1 << 12))  # CAP_NET_ADMIN = 12 (linux/capability.h)
    except (OSError, StopIteration, ValueError):
        return False


@dataclass
class Link:
    tag: str
    rate: str | None = None
    delay: str | None = None
    loss: str | None = None

    @property
    def namespaces(self) -> tuple[str, str]:
        return f"{self.tag}n0", f"{self.tag}n1"

    @property
    def interfaces(self) -> tuple[str, str]:
        return f"{self.tag}v0", f"{self.tag}v1"

    addresses = ADDRESSES

    def in_namespace(self, node: int) -> list[str]:
        """The prefix that runs a command on `node`: ["ip", "netns", "exec", <its namespace>]."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets `node`'s interface has sent and received (the kernel's counters)."""
        out = _run(["ip", "-n", self.namespaces[node], "-j", "-s", "link", "show", "dev", self.interfaces[node]])
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def set_state(self, up: bool, node: int = 0) -> None:
        """Cut (`up=False`) or restore the link at `node`'s end: `ip link set ... down|up`."""
        _run(["ip", "-n", self.namespaces[node], "link", "set", self.interfaces[node], "up" if up else "down"])

    def describe(self) -> str:
        shape = ", ".join(x for x in (self.rate and f"rate {self.rate} (tbf)", self.delay and f"delay {self.delay}",
                                      self.loss and f"loss {self.loss}") if x) or "unshaped"
        nodes = "; ".join(f"node {i}: namespace {ns}, {addr} on {dev}" for i, (ns, addr, dev) in
                          enumerate(zip(self.namespaces, self.addresses, self.interfaces, strict=False)))
        return f"{self.tag}: {nodes}; link {shape}"


def up(rate: str | None = None, delay: str | None = None, loss: str | None = None,
       owner: int | None = None) -> Link:
    """Make the pair and shape its link; on any failure nothing is left behind."""
    if rate is not None:
        rate_bits(rate)
    if delay is not None:
        _check_time(delay, "delay")
    if loss is not None and not _LOSS.match(loss):
        raise NetsimError(f"loss {loss!r} is not a percentage: write e.g. 1% or 0.5%")
    link = Link(f"{PREFIX}{owner or os.getpid()}x{_base36(next(_counter))}", rate, delay, loss)
    try:
        for ns in link.namespaces:
            _run(["ip", "netns", "add", ns])
        v0, v1 = link.interfaces
        _run(["ip", "link", "add", v0, "type", "veth", "peer", "name", v1])
        for node in (0, 1):
            ns, dev = link.namespaces[node], link.interfaces[node]
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{link.addresses[node]}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _shape(ns, dev, rate, delay, loss)
    except BaseException:
        down(link.tag)
        raise
    return link


def _shape(ns: str, dev: str, rate: str | None, delay: str | None, loss: str | None) -> None:
    if delay or loss:
        netem = ["netem", "limit", "100000", *(["delay", delay] if delay else []), *(["loss", loss] if loss else []),
                 *(["rate", rate] if rate else [])]
        made = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *netem], check=False)
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines()[0].removeprefix("Error: ").rstrip(".") if made.stderr.strip()
                   else f"exit {made.returncode}")
            raise NetsimError(f"netem is not available in this kernel ({why}): --delay and --loss cannot be "
                              "simulated here; --rate works (tbf)")
        return
    if rate:
        # burst: 10 ms at the rate (tbf needs at least rate/HZ); latency bounds the queue at 50 ms
        burst = max(65536, int(rate_bits(rate) / 8 / 100))
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
              "latency", "50ms"])


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def existing() -> dict[str, int]:
    """Tags of the pairs this tool made that exist now -> their owner's pid."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    found = {}
    for line in out.splitlines():
        m = _TAG.match(line.split()[0]) if line.strip() else None
        if m:
            found[m.group(1)] = int(m.group(2))
    return found


def down(tag: str) -> None:
    """Remove a pair (deleting a namespace deletes its veth end, and the peer with it)."""
    for ns in (f"{tag}n0", f"{tag}n1"):
        _run(["ip", "netns", "del", ns], check=False)


def down_stale(all_pairs: bool = False) -> list[str]:
    """Remove the pairs whose owner is no longer running (all of this tool's with all_pairs); their tags."""
    removed = []
    for tag, pid in existing().items():
        if all_pairs or not _alive(pid):
            down(tag)
            removed.append(tag)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def simulated_link(rate: str | None = None, delay: str | None = None, loss: str | None = None) -> Iterator[Link]:
    """A pair for the duration of a `with` block, removed on the way out whatever happens."""
    link = up(rate, delay, loss)
    try:
        yield link
    finally:
        down(link.tag)
