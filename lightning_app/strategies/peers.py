"""Who is where in a distributed run (each rank's host, address, process and GPU, exchanged once at start-up, and
said in one line per rank and one table), and the paragraph that names a lost peer by its rank and address when a
collective fails."""
from __future__ import annotations

import os
import re
import socket

import torch.distributed as dist

# rank -> (host name, address); filled on every rank by exchange()
PEERS: dict[int, tuple[str, str]] = {}
# rank -> (pid, device): what each rank runs on, for the start-up lines
PLACES: dict[int, tuple[int, str]] = {}


def own_address() -> str:
    """The address this process reaches MASTER_ADDR from (the routing table's choice; a UDP connect sends
    nothing). MASTER_ADDR itself on the master's node."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500") or 29500)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def own_device() -> str:
    """This rank's GPU as the node knows it: its CUDA_VISIBLE_DEVICES entry (the launcher's name for it), model and
    UUID (nvidia-smi -L lists the same), or "CPU". Lightning has set the rank's device before the process group
    exists (Strategy.setup_environment, CUDAAccelerator.setup_device)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "CPU"
    index = torch.cuda.current_device()
    listed = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    props = torch.cuda.get_device_properties(index)
    name = listed[index] if index < len(listed) else str(index)
    uuid = getattr(props, "uuid", None)
    return f"GPU {name} ({props.name}{f', GPU-{uuid}' if uuid else ''})"


def exchange(rank: int, world: int) -> None:
    """Every rank's (host, address) into PEERS and (pid, device) into PLACES; a collective, called once after the
    process group is up."""
    PEERS.clear()
    PLACES.clear()
    mine = (socket.gethostname(), own_address(), os.getpid(), own_device())
    if world < 2 or not dist.is_initialized():
        found = {rank: mine}
    else:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        found = dict(enumerate(gathered))
    for r, v in found.items():
        if v:
            PEERS[r], PLACES[r] = (v[0], v[1]), (v[2], v[3])


def own_line(rank: int, world: int) -> str:
    """'rank 3 of 8: host b (10.0.0.2), pid 4242, GPU 3 (NVIDIA H200, GPU-...)': what a rank says at start, so a
    stalled rank's log names where it runs."""
    host, address = PEERS.get(rank, ("?", "?"))
    pid, device = PLACES.get(rank, (os.getpid(), "?"))
    return f"rank {rank} of {world}: host {host} ({address}), pid {pid}, {device}"


def layout_table() -> str:
    """'ranks by host: a (10.0.0.1) 0-7; b (10.0.0.2) 8-15': which ranks each host runs (rank 0 says it)."""
    by_host: dict[tuple[str, str], list[int]] = {}
    for r, v in sorted(PEERS.items()):
        by_host.setdefault(v, []).append(r)
    return "ranks by host: " + "; ".join(f"{host} ({address}) {_spans(ranks)}"
                                         for (host, address), ranks in by_host.items())


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def describe_lost(rank: int | str, error_text: str) -> str:
    """'rank 1 at 10.0.0.2 (host b)': the peer the error names by its address, else the ranks on other
    addresses than this rank's (other nodes), else every other rank, else MASTER_ADDR."""
    mine = PEERS.get(rank) if isinstance(rank, int) else None
    others = {r: v for r, v in PEERS.items() if r != rank}
    elsewhere = {r: v for r, v in others.items() if mine is None or v[1] != mine[1]}
    named = {r: v for r, v in elsewhere.items() if v[1] in error_text}
    chosen = named or elsewhere or others
    if not chosen:
        master = os.environ.get("MASTER_ADDR")
        return f"the master at {master}" if master else "a peer"
    by_address: dict[tuple[str, str], list[int]] = {}
    for r, v in sorted(chosen.items()):
        by_address.setdefault(v, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} at {addr} (host {host})"
             for (host, addr), rs in by_address.items()]
    return parts[0] if len(parts) == 1 else "one of " + ", ".join(parts)


def taken_port_words(address: str, port: int | str) -> str:
    """The words that name a rendezvous whose port another process held (the sweep looks for them in a trial's
    log, sweep/runner.py)."""
    return f"could not listen on its rendezvous {address}:{port}"


def describe_taken_port(error: BaseException) -> str | None:
    """One paragraph when rank 0's TCPStore could not listen on MASTER_PORT because another process holds it
    (torch's DistNetworkError, "code: -98, name: EADDRINUSE": torch/csrc/distributed/c10d/socket.cpp), else None.
    A setting, not a lost peer: the other ranks never met this one."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if "eaddrinuse" in str(error).lower():
            break
        error = error.__cause__ or error.__context__
    else:
        return None
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = re.search(r"port: (\d+)", str(error))
    port = port.group(1) if port else os.environ.get("MASTER_PORT", "?")
    return (f"Rank 0 {taken_port_words(address, port)}: another process already listens on port {port} "
            "(EADDRINUSE). Set MASTER_PORT to a free port (every rank the same), or leave it unset on one node so "
            "that Lightning picks a free one; with torchrun, --master-port or --rdzv-endpoint HOST:PORT.")


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "recv", "send",
              "timed out", "timeout", "nccl", "gloo", "socket", "store", "distbackenderror", "watchdog")


def describe_distributed_failure(error: BaseException, timeout_s: float | None,
                                 rank: tuple[int, int] | None = None) -> str | None:
    """A one-paragraph explanation when `error` is a lost peer or a collective timeout, else None."""
    if timeout_s is None:  # no DDP run was set up in this process
        return None
    text = f"{type(error).__name__}: {error}".lower()
    if not any(k in text for k in _PEER_LOST):
        return None
    rank, world = rank if rank else (os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?"))
    limit = f"{timeout_s:g} s"
    kind = "timed out" if ("timeout" in text or "timed out" in text) else "lost a peer"
    lost = describe_lost(rank, str(error))
    # a comm hook's chained futures wrap the error once per link of the chain
    original = re.sub(r"(Got the following error when running the callback: \w+: )+", "", str(error).strip())
    return (
        f"Distributed run failed on rank {rank} of {world} processes: {kind} (collective timeout {limit}); "
        f"it lost {lost}. That process (or its node, or the network to it) died or stopped answering; "
        "its own log says why. "
        "Restart all processes with --ckpt_path last to resume. "
        "Set the timeout with --trainer.strategy.timeout_s or FIC_DDP_TIMEOUT_S. "
        f"Original error: {original.splitlines()[0][:300] if original else type(error).__name__}"
    )
