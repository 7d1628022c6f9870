"""DDP gradient compression as one setting, `comm_hook: none | fp16 | bf16 | powersgd`, and a PowerSGD
state that survives a checkpoint.

The hooks are torch's (torch/distributed/algorithms/ddp_comm_hooks/): `default_hooks.fp16_compress_hook`
and `bf16_compress_hook` all-reduce the gradient buckets in 16 bits (half the bytes); `powerSGD_hook`
sends a rank-r approximation of every weight matrix (P = M Q, Q = M^T P) plus the small tensors
uncompressed, and keeps what the approximation missed as a per-process error fed back into the next
step. All three run on gloo (CPU) and NCCL (GPU): gloo's all-reduce handles Half and BFloat16
(GENERATE_ALL_TYPES in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) and the 2-process tests run
each hook on gloo. MPI has no 16-bit type (mpiDatatype in ProcessGroupMPI.cpp), and DDP refuses the
bf16 hook unless torch was built with CUDA and NCCL >= 2.10, whatever the backend
(DistributedDataParallel._check_comm_hook): both are refused here in one paragraph.

PowerSGD keeps its state per gradient *bucket*, keyed by bucket index, and DDP rebuilds its buckets
after the first step of every process (reducer `_rebuild_buckets`): a resumed run meets the state in
another bucket layout. `PowerSGDHookState` therefore hands torch's hook a bucket whose index names its
exact parameter layout, and moves the state parameter by parameter whenever a new layout appears; the
checkpoint holds it per parameter name (error feedback of every process, the warm-start Q, the step
counter, the random generator).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_app.errors import UserError

CommHook = Literal["none", "fp16", "bf16", "powersgd"]
HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
CHECKPOINT_KEY = "ddp_comm_hook_state"

Slots = tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (name, offset in the bucket, numel, shape) per parameter


def check_settings(hook: str, rank: int, start_iter: int | None, backend: str | None) -> None:
    """One paragraph for a setting or a backend that cannot do the hook."""
    if hook not in HOOKS:
        raise UserError(f"--trainer.strategy.comm_hook {hook!r} is not a hook; choose one of {', '.join(HOOKS)}.")
    if hook == "powersgd":
        if rank < 1:
            raise UserError(f"--trainer.strategy.powersgd_rank must be >= 1 (the rank of each gradient's "
                            f"approximation; 1, 2 or 4 are usual), got {rank}.")
        if start_iter is not None and start_iter < 2:
            raise UserError(
                f"--trainer.strategy.powersgd_start_iter must be >= 2, got {start_iter}: DDP rebuilds its gradient "
                "buckets after the first step, and PowerSGD's error feedback and warm start may only begin after "
                "that (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, PowerSGDState). Leave it null "
                "to start at the end of the learning-rate warm-up.")
    if hook in ("fp16", "bf16") and backend == "mpi":
        raise UserError(
            f"comm_hook {hook} cannot run on the MPI backend: torch's MPI process group has no 16-bit types "
            "(mpiDatatype in torch/csrc/distributed/c10d/ProcessGroupMPI.cpp). Use gloo (CPU) or NCCL (GPU) "
            "through --trainer.strategy.process_group_backend, or comm_hook powersgd, which sends 32-bit floats.")
    if hook == "bf16" and not _bf16_hook_allowed():
        raise UserError(
            "comm_hook bf16 needs a torch built with CUDA and NCCL >= 2.10, even on gloo: DDP checks that before it "
            "accepts the hook (DistributedDataParallel._check_comm_hook in torch/nn/parallel/distributed.py), and "
            f"this torch ({torch.__version__}) has none. Use comm_hook fp16 (the same bytes on the wire) or powersgd.")


def _bf16_hook_allowed() -> bool:
    try:
        return bool(torch.version.cuda) and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except (RuntimeError, AttributeError):
        return False


def build(hook: str, rank: int, start_iter: int | None) -> tuple[Callable | None, Any]:
    """(hook function, its state) for DDP's register_comm_hook; (None, None) for `none`."""
    if hook == "fp16":
        return default_hooks.fp16_compress_hook, None  # state None: the whole world
    if hook == "bf16":
        return default_hooks.bf16_compress_hook, None
    if hook == "powersgd":
        state = PowerSGDHookState(rank, start_iter)
        return resumable_powersgd_hook, state
    return None, None


class _NamedBucket:
    """A GradBucket whose index() names its parameter layout: torch's PowerSGD state, keyed by that index,
    then never applies one layout's error feedback or warm start to another."""

    def __init__(self, bucket: dist.GradBucket, key: int) -> None:
        self._bucket, self._key = bucket, key

    def index(self) -> int:
        return self._key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bucket, name)


# no annotations: DDP compares them to the classes, and here they are strings
def resumable_powersgd_hook(state, bucket):
    """torch's powerSGD_hook on a bucket named by its layout (PowerSGDHookState, dist.GradBucket -> Future).

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
    future = powersgd.powerSGD_hook(state.torch_state, _NamedBucket(bucket, key))
    state.in_flight = future if state.one_bucket_at_a_time else None
    return future


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

    def set_start_iter(self, start: int) -> None:
        self.torch_state.start_powerSGD_iter = max(2, int(start))

    def name_parameters(self, module: torch.nn.Module) -> None:
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in params}
        self.numels = {n: p.numel() for n, p in params}

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


def gather_state(state: PowerSGDHookState, device: torch.device, rank: int, world: int) -> dict[str, Any] | None:
    """The checkpoint's PowerSGD entry: the shared state, and every process's error feedback gathered on rank 0.

    A collective: every rank calls it (Lightning's Trainer.save_checkpoint runs on all ranks). Before
    PowerSGD starts there is no error feedback and nothing is gathered (the same on every rank: the step
    counter and the start are).
    """
    saved = state.export()
    local = saved.pop("error")
    ts = state.torch_state
    names = list(state.names.values())
    numels = [state.numels[n] for n in names]
    saved.update(error_names=names, error_numels=numels, errors=[])
    if ts.iter < ts.start_powerSGD_iter:
        return saved
    flat = torch.cat([local[n].reshape(-1).float() if n in local else torch.zeros(k)
                      for n, k in zip(names, numels, strict=False)]).to(device)
    if world > 1:
        chunks = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
        dist.gather(flat, chunks, dst=0)
    else:
        chunks = [flat]
    saved["errors"] = [c.cpu() for c in chunks] if rank == 0 else []
    return saved


def restore_state(state: PowerSGDHookState, saved: dict[str, Any], rank: int, world: int) -> list[str]:
    """Load a checkpoint's PowerSGD entry into `state` for this rank; returns what could not be restored."""
    lost = []
    errors = None
    if saved.get("errors"):
        if len(saved["errors"]) == world:
            flat = saved["errors"][rank]
            errors, offset = {}, 0
            for name, numel in zip(saved["error_names"], saved["error_numels"], strict=False):
                errors[name] = flat[offset:offset + numel]
                offset += numel
        else:
            lost.append(f"the error feedback (saved by {len(saved['errors'])} processes, now {world})")
    return lost + state.load(saved, errors)
