"""PowerSGD's state, made to survive what torch's hook does not: a change of DDP's bucket layout, a checkpoint,
and an overflowing step under a GradScaler.

torch's powerSGD_hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py) keys its state by bucket index,
adds the stored error to the bucket, keeps Q for the next step's warm start and never checks either for inf or NaN.
`PowerSGDHookState` hands it a bucket whose index names its exact parameter layout (moving the state parameter by
parameter when a new layout appears), and `resumable_powersgd_hook` keeps the state finite and in unscaled units.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

Slots = tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (name, offset in the bucket, numel, shape) per parameter


class _NamedBucket:
    """A GradBucket whose index() names its parameter layout: torch's PowerSGD state, keyed by that index,
    then never applies one layout's error feedback or warm start to another."""

    def __init__(self, bucket: dist.GradBucket, key: int) -> None:
        self._bucket, self._key = bucket, key

    def index(self) -> int:
        return self._key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bucket, name)


class PowerSGDHookState:
    """torch's PowerSGDState plus the parameter names behind its buckets; exports and imports per parameter."""

    def __init__(self, rank: int, start_iter: int | None) -> None:
        # start 2 is a placeholder until the strategy knows the warm-up (set_start_iter); the state checks > 1
        self.torch_state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                  start_powerSGD_iter=start_iter or 2)
        self.rank = rank
        self.one_bucket_at_a_time = True  # the strategy turns it off on NCCL (resumable_powersgd_hook)
        self.in_flight: torch.futures.Future | None = None
        self.names: dict[int, str] = {}          # id(parameter) -> its name in the module
        self.numels: dict[str, int] = {}
        self._keys: dict[Slots, int] = {}        # bucket layout -> the index torch's state uses for it
        self._slots: dict[int, Slots] = {}       # and back
        self._owner: dict[str, int] = {}         # parameter name -> the key whose tensors hold its state
        self._pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}  # from a checkpoint
        # the GradScaler's scale as a device tensor (None: no loss scaling); the strategy points it at its scaler
        self.loss_scale: Callable[[], torch.Tensor | None] = lambda: None

    def set_start_iter(self, start: int) -> None:
        self.torch_state.start_powerSGD_iter = max(2, int(start))

    def name_parameters(self, module: torch.nn.Module) -> None:
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in params}
        self.numels = {n: p.numel() for n, p in params}

    # -- one compressed bucket ------------------------------------------------------------------------
    def guarded(self, key: int, run: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """`run()` (torch's hook on bucket `key`) with the error feedback in unscaled units and the state kept finite.

        The error is stored divided by the loss scale it was made under and handed to torch's hook multiplied by
        the current one, so a GradScaler that halves or grows its scale meets an error in the gradient's units.
        After the bucket, an error or a Q that is not all finite (a step the GradScaler will skip) is replaced
        by the previous finite one (zero error, a fresh Q the first time): on the device, with torch.where on a
        0-dim flag, so no step waits for the host.
        """
        ts = self.torch_state
        scale = self.loss_scale()
        kept = ts.error_dict.get(key)  # unscaled; torch's hook adds what the dict holds, then replaces the entry
        if kept is not None and scale is not None:
            ts.error_dict[key] = kept * scale
        q_memory = ts.q_memory_dict.get(key)
        q_kept = None if q_memory is None else q_memory.clone()  # torch writes the new Q into this same memory

        def settle(future: torch.futures.Future) -> Any:
            error = ts.error_dict[key]
            if scale is not None:
                error = error / scale
            ok = torch.isfinite(error).all()
            ts.error_dict[key] = torch.where(ok, error, kept if kept is not None else 0.0)
            q = ts.q_memory_dict.get(key)
            if q is not None:
                fresh = q_kept if q_kept is not None else _random_q(q, key)
                q.copy_(torch.where(torch.isfinite(q).all(), q, fresh))
            return future.value()

        return run().then(settle)

    # -- layouts -----------------------------------------------------------------------------------
    def prepare(self, bucket: dist.GradBucket) -> int:
        """The key of this bucket's layout; a layout seen for the first time gets its parameters' state."""
        buffer = bucket.buffer()
        slots = tuple((self.names.get(id(p), f"#{i}"), g.storage_offset() - buffer.storage_offset(), g.numel(),
                       tuple(g.shape))
                      for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients(), strict=False)))
        key = self._keys.get(slots)
        if key is None:
            key = self._keys[slots] = len(self._keys)
            self._slots[key] = slots
            self._move_into(key, slots, buffer)
        return key

    def _move_into(self, key: int, slots: Slots, buffer: torch.Tensor) -> None:
        ts = self.torch_state
        errors = {n: e for n in (s[0] for s in slots) if (e := self._take(n, "error")) is not None}
        if errors:
            flat = torch.zeros(buffer.numel(), device=buffer.device, dtype=buffer.dtype)
            for name, offset, numel, _ in slots:
                if name in errors:
                    flat[offset:offset + numel].copy_(errors[name].reshape(-1))
            ts.error_dict[key] = flat
        layout = pq_layout(slots, self.rank)
        qs = {n: self._take(n, "q") for n in layout}
        if layout and all(q is not None and q.numel() == layout[n][3] for n, q in qs.items()):
            p_total = sum(v[1] for v in layout.values())
            q_total = sum(v[3] for v in layout.values())
            ts.p_memory_dict[key] = torch.zeros(p_total, device=buffer.device, dtype=buffer.dtype)
            q_flat = ts.q_memory_dict[key] = torch.zeros(q_total, device=buffer.device, dtype=buffer.dtype)
            for name, (_, _, q_off, q_len) in layout.items():
                q_flat[q_off:q_off + q_len].copy_(qs[name].reshape(-1))
        for name, *_ in slots:
            old = self._owner.get(name)
            self._owner[name] = key
            if old is not None and old != key and old not in self._owner.values():
                for d in (ts.error_dict, ts.p_memory_dict, ts.q_memory_dict):  # no parameter left there
                    d.pop(old, None)

    def _take(self, name: str, kind: str) -> torch.Tensor | None:
        """This parameter's state of one kind: from a checkpoint, else from the layout that holds it now."""
        if name in self._pending[kind]:
            return self._pending[kind].pop(name)
        key = self._owner.get(name)
        return None if key is None else self._param_view(key, name, kind)

    def _param_view(self, key: int, name: str, kind: str) -> torch.Tensor | None:
        ts = self.torch_state
        slots = self._slots[key]
        if kind == "error":
            flat = ts.error_dict.get(key)
            slot = next(s for s in slots if s[0] == name)
            return None if flat is None else flat[slot[1]:slot[1] + slot[2]]
        # only Q is kept: the hook recomputes P = M Q before it reads P (warm start reuses Q alone)
        memory = ts.q_memory_dict.get(key)
        where = pq_layout(slots, self.rank).get(name)
        return None if memory is None or where is None else memory[where[2]:where[2] + where[3]]

    # -- checkpoint ----------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """This process's state, per parameter name (tensors on the CPU)."""
        ts = self.torch_state
        per_kind: dict[str, dict[str, torch.Tensor]] = {}
        for kind in ("error", "q"):
            found = {n: t.detach().cpu().clone() for n, t in self._pending[kind].items()}
            for name in self._owner:
                t = self._param_view(self._owner[name], name, kind)
                if t is not None:
                    found[name] = t.detach().cpu().clone()
            per_kind[kind] = found
        _, keys, pos, has_gauss, cached = ts.rng.get_state()  # ("MT19937", keys, ...)
        return {
            "hook": "powersgd", "rank": self.rank, "iter": int(ts.iter),
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached)},
            "stats": [int(ts.total_numel_before_compression), int(ts.total_numel_after_compression),
                      int(ts.next_stats_report)],
            "q": per_kind["q"], "error": per_kind["error"],
        }

    def load(self, saved: dict[str, Any], error: dict[str, torch.Tensor] | None) -> list[str]:
        """Take a checkpoint's state (its `error` for this process); returns what could not be restored."""
        import numpy as np

        ts = self.torch_state
        lost = []
        ts.iter = int(saved["iter"])
        rng = saved["rng"]
        ts.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                          rng["cached_gaussian"]))
        ts.total_numel_before_compression, ts.total_numel_after_compression, ts.next_stats_report = saved["stats"]
        for d in (ts.error_dict, ts.p_memory_dict, ts.q_memory_dict):
            d.clear()
        self._keys.clear()
        self._slots.clear()
        self._owner.clear()
        self._pending = {"error": dict(error or {}), "q": {}}
        if int(saved["rank"]) == self.rank:
            self._pending["q"] = dict(saved["q"])
        elif saved["q"]:
            lost.append(f"the warm start (saved with rank {saved['rank']}, now {self.rank})")
        return lost


def pq_layout(slots: Slots, rank: int, min_compression_rate: float = 2) -> dict[str, tuple[int, int, int, int]]:
    """name -> (P offset, P length, Q offset, Q length) in a bucket's P and Q memory.

    Mirrors powerSGD_hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, not batched): a
    gradient is viewed as (shape[0], rest), compressed when _should_compress says so, and the compressed
    ones are laid out grouped by matrix shape in order of first appearance.
    """
    groups: dict[tuple[int, int], list[str]] = {}
    for name, _, numel, shape in slots:
        n = shape[0] if shape else 1
        m = numel // max(1, n)
        r = min(n, m, rank)
        if powersgd._should_compress(n, m, r, min_compression_rate)[0]:
            groups.setdefault((n, m), []).append(name)
    out, p_off, q_off = {}, 0, 0
    for (n, m), names in groups.items():
        r = min(n, m, rank)
        for name in names:
            out[name] = (p_off, n * r, q_off, m * r)
            p_off += n * r
            q_off += m * r
    return out


def _random_q(like: torch.Tensor, key: int) -> torch.Tensor:
    """A random Q for a bucket's first compressed step, the same in every process (a generator on the device, seeded
    alike everywhere); used only where that step was not finite."""
    g = torch.Generator(device=like.device).manual_seed(key)
    return torch.randn(like.shape, generator=g, device=like.device, dtype=like.dtype)


# no annotations: DDP compares them to the classes, and here they are strings
def resumable_powersgd_hook(state, bucket):
    """torch's powerSGD_hook on a bucket named by its layout, its state kept finite (PowerSGDHookState,
    dist.GradBucket -> Future).

    With `state.one_bucket_at_a_time` (every backend but NCCL), a bucket starts only when the previous one's
    chain has finished. torch's hook issues its P and Q all-reduces from future callbacks; gloo runs those on
    its own threads when the previous all-reduce completes, so two processes can issue "this bucket's P" and
    "the next bucket's first all-reduce" in different orders: a collective mismatch (gloo: "Received data size
    doesn't match expected size"), seen on a 1 Gbit/s link with ResNet-50. NCCL completes a future when the
    collective is enqueued, so its callbacks run in order in the calling thread.
    """
    if state.one_bucket_at_a_time and state.in_flight is not None:
        state.in_flight.wait()
    key = state.prepare(bucket)
    ts = state.torch_state
    named = _NamedBucket(bucket, key)
    if ts.iter < ts.start_powerSGD_iter:  # torch's hook all-reduces plainly and keeps no state
        future = powersgd.powerSGD_hook(ts, named)
    else:
        future = state.guarded(key, lambda: powersgd.powerSGD_hook(ts, named))
    state.in_flight = future if state.one_bucket_at_a_time else None
    return future
