"""Gradient compression (comm_hook) on gloo: each hook changes what the all-reduce delivers, PowerSGD's state
survives a checkpoint and a change of DDP's bucket layout, and settings a backend cannot do are refused."""
from __future__ import annotations

import copy
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_app.errors import UserError
from lightning_app.strategies import comm_hooks
from tests.helpers.cli import quick_args, run_main
from tests.helpers.processes import in_processes


def _fit(data: Path, root: Path, hook: str, epochs: int, extra: list[str] = ()) -> list[str]:
    return ["fit", "--config", "configs/ddp.yaml", "--config", f"configs/comm/{hook}.yaml",
            *quick_args(data, root, epochs=epochs, batch=40), "--trainer.devices", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.deterministic", "true", *extra]


def _probe(out: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.GradientProbe", f"--trainer.callbacks.out_dir={out}"]


def _probed(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"grads_rank{rank}.json").read_text())


@pytest.mark.slow
def test_fp16_from_its_config_delivers_16_bit_gradients_to_both_processes(tiny_data, tmp_path):
    out = tmp_path / "probe"
    proc = run_main(_fit(tiny_data, tmp_path, "fp16", epochs=1, extra=[*_probe(out), "--trainer.limit_train_batches",
                                                                      "3", "--trainer.limit_val_batches", "0"]))
    assert "DDP gradients: fp16 compression (gloo)" in proc.stdout
    for rank in (0, 1):
        seen = _probed(out, rank)
        assert seen["comm_hook"] == "fp16_compress_hook" and seen["world_size"] == 2
        assert len(seen["steps"]) == 3
        # what arrives went through a 16-bit all-reduce: every value survives a round trip through float16
        assert all(s["fp16_exact"] for s in seen["steps"]) and not any(s["bf16_exact"] for s in seen["steps"])


def _two_gloo_processes(rank: int, store_path: str, out_dir: str) -> None:
    """One of two real gloo processes: a few DDP steps with each hook built by comm_hooks.build."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    report = {}
    for hook in ("fp16", "bf16", "powersgd"):
        net = _net()
        ddp = nn.parallel.DistributedDataParallel(net)
        fn, state = comm_hooks.build(hook, rank=1, start_iter=2)
        if state is not None:
            state.name_parameters(net)
        ddp.register_comm_hook(state, fn)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = []
        for step in range(4):
            g = torch.Generator().manual_seed(100 * rank + step)  # each process its own data
            x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            opt.step()
        last = grads[-1]
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        report[hook] = {
            "same_weights": torch.equal(both[0], both[1]),
            "fp16_exact": all(torch.equal(t, t.half().float()) for t in last),
            "bf16_exact": all(torch.equal(t, t.bfloat16().float()) for t in last),
            "rank_of_linear": int(torch.linalg.matrix_rank(last[4], rtol=1e-4)),  # 5.weight, 24 x 512
        }
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_hook_trains_two_real_gloo_processes(tmp_path):
    if not comm_hooks._bf16_hook_allowed():
        pytest.skip("this torch has no NCCL >= 2.10: DDP refuses the bf16 hook (the refusal is tested below)")
    in_processes(_two_gloo_processes, 2, str(tmp_path / "store"), str(tmp_path), timeout=300)
    for rank in (0, 1):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(r["same_weights"] for r in report.values()), report
        assert report["fp16"]["fp16_exact"] and not report["fp16"]["bf16_exact"]
        assert report["bf16"]["bf16_exact"]
        assert report["powersgd"]["rank_of_linear"] == 1  # rank-1 PowerSGD from step 2 on


@pytest.mark.slow
def test_powersgd_resumes_with_its_state_to_the_weights_of_an_uninterrupted_run(tiny_data, tmp_path):
    # 240 train images, global batch 40: 6 steps an epoch; PowerSGD (rank 2) from step 3
    every_epoch = ["--trainer.strategy.powersgd_rank", "2", "--trainer.strategy.powersgd_start_iter", "3",
                   "--checkpoint.save_top_k", "-1",
                   "--checkpoint.filename", "e{epoch}"]
    out = tmp_path / "probe"
    whole = run_main(_fit(tiny_data, tmp_path / "whole", "powersgd", epochs=3, extra=[*every_epoch, *_probe(out)]))
    assert "DDP gradients: PowerSGD rank 2 (gloo)" in whole.stdout
    steps = _probed(out)["steps"]
    assert _probed(out)["comm_hook"] == "resumable_powersgd_hook"
    assert all(s["max_matrix_rank"] > 2 for s in steps[:3])  # plain all-reduce before the start
    assert all(s["max_matrix_rank"] <= 2 for s in steps[3:])  # then every weight gradient is rank 2 at most

    checkpoints = tmp_path / "whole" / "version_0" / "checkpoints"
    after_2 = torch.load(checkpoints / "e2.ckpt", map_location="cpu", weights_only=True)  # names count from 1
    saved = after_2[comm_hooks.CHECKPOINT_KEY]
    assert after_2["global_step"] == 12 and saved["iter"] == 12
    assert saved["error"] and saved["world"] == 2  # rank 0's error feedback, per parameter
    own = torch.load(f"{checkpoints / 'e2.ckpt'}.powersgd-rank1", weights_only=True)[comm_hooks.CHECKPOINT_KEY]
    assert own["iter"] == 12 and set(own["error"]) == set(saved["error"])  # rank 1's, in a file of its own
    assert any(not torch.equal(own["error"][k], saved["error"][k]) for k in saved["error"])
    assert saved["q"] and all(q.abs().sum() > 0 for q in saved["q"].values())
    assert sorted(p.name for p in checkpoints.iterdir()) == [  # every checkpoint with its side file, and only those
        *[n for e in (1, 2, 3) for n in (f"e{e}.ckpt", f"e{e}.ckpt.powersgd-rank1")], "last.ckpt",
        "last.ckpt.powersgd-rank1"]

    resume_from = tmp_path / "copy" / "e2.ckpt"  # outside any run folder: the resumed run gets its own
    resume_from.parent.mkdir()
    for name in ("e2.ckpt", "e2.ckpt.powersgd-rank1"):  # the side file travels with its checkpoint
        shutil.copy(checkpoints / name, resume_from.parent / name)
    resumed = run_main(_fit(tiny_data, tmp_path / "resumed", "powersgd", epochs=3,
                            extra=[*every_epoch, "--ckpt_path", str(resume_from)]))
    assert "PowerSGD state restored at its step 12 (error feedback, warm start)." in resumed.stdout
    a = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                   weights_only=True)
    assert a["global_step"] == b["global_step"] == 18
    for k in a["state_dict"]:
        torch.testing.assert_close(b["state_dict"][k], a["state_dict"][k], rtol=0, atol=1e-7, msg=f"{k} differs")
    torch.testing.assert_close(b[comm_hooks.CHECKPOINT_KEY]["error"], a[comm_hooks.CHECKPOINT_KEY]["error"],
                               rtol=0, atol=1e-7)


@pytest.mark.slow
def test_powersgd_checkpoint_is_the_same_size_with_2_and_4_processes(tiny_data, tmp_path):
    sizes = {}
    for n in (2, 4):
        run_main(_fit(tiny_data, tmp_path / str(n), "powersgd", epochs=1, extra=[
            "--trainer.devices", str(n), "--trainer.strategy.powersgd_start_iter", "2",
            "--trainer.limit_val_batches", "0"]), env={"OMP_NUM_THREADS": "1"})
        path = tmp_path / str(n) / "version_0" / "checkpoints" / "last.ckpt"
        entry = torch.load(path, map_location="cpu", weights_only=True)[comm_hooks.CHECKPOINT_KEY]
        assert entry["iter"] == 6  # 240 images, global batch 40: PowerSGD ran from step 2, its error is saved
        buffer = io.BytesIO()
        torch.save(entry, buffer)
        sides = {p.stat().st_size for p in path.parent.glob("last.ckpt.powersgd-rank*")}
        sizes[n] = (path.stat().st_size, buffer.tell(), sides)
    assert sizes[4][1] == sizes[2][1], sizes  # the PowerSGD entry, to the byte
    assert abs(sizes[4][0] - sizes[2][0]) < 1024, sizes  # the file: what else names the world size
    assert len(sizes[4][2]) == 1 and sizes[4][2] == sizes[2][2], sizes  # each other rank's file: its own error


def _overflow_once(rank: int, store_path: str, inf_step: int) -> dict:
    """One of two gloo processes: PowerSGD from step 2 under a real GradScaler; at `inf_step` process 1's loss is inf
    (what a GradScaler expects now and then under 16-mixed)."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net)
    hook, state = comm_hooks.build("powersgd", rank=2, start_iter=2)
    state.name_parameters(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10_000)
    state.loss_scale = lambda: scaler._scale  # what ClusterDDPStrategy hands it from Lightning's MixedPrecision
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)  # each process its own batch, the same every step
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    out = {"loss": [], "finite": [], "scale": []}
    for step in range(12):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        out["loss"].append(loss.item())
        scaler.scale(loss * float("inf") if step == inf_step and rank == 1 else loss).backward()
        out["finite"].append(all(bool(p.grad.isfinite().all()) for p in net.parameters()))
        scaler.step(opt)
        scaler.update()
        out["scale"].append(scaler.get_scale())
    ts = state.torch_state
    out["state_finite"] = all(bool(t.isfinite().all()) for t in [*ts.error_dict.values(), *ts.q_memory_dict.values()])
    # no destroy_process_group: called right after the hook's last callbacks it has aborted a process
    # (std::system_error "Resource deadlock avoided": a gloo thread joining itself); the group ends with the process
    dist.barrier()
    return out


def test_powersgd_state_stays_finite_after_a_gradscaler_overflow(tmp_path):
    inf_step = 5  # PowerSGD runs from step 2
    for got in in_processes(_overflow_once, 2, str(tmp_path / "store"), inf_step, timeout=120):
        assert got["finite"][:inf_step] == [True] * inf_step and not got["finite"][inf_step]
        assert all(got["finite"][inf_step + 1:]), got["finite"]  # every later all-reduced gradient is finite
        assert got["scale"][-1] == 2.0 ** 9  # one skipped step: the scale halved once
        assert got["state_finite"]
        assert got["loss"][-1] < got["loss"][inf_step]  # and training goes on


# ------------------------------------------------------------------------------ one process, in this one

@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _net() -> nn.Module:
    """Weight shapes that recur apart from each other (24 x 24 at 7 and 13): PowerSGD groups them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 4 * 4, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 16),
                         nn.ReLU(), nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 10))


def _steps(ddp: nn.Module, opt: torch.optim.Optimizer, first: int, count: int) -> None:
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _powersgd_ddp(net: nn.Module, bucket_cap_mb: float, state: comm_hooks.PowerSGDHookState):
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    state.name_parameters(net)
    ddp.register_comm_hook(state, comm_hooks.resumable_powersgd_hook)
    return ddp, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def test_powersgd_state_moves_to_another_bucket_layout_unchanged(one_process_group):
    """A state exported under one bucket layout and loaded under another gives the steps it would have given."""
    net = _net()
    state = comm_hooks.PowerSGDHookState(rank=2, start_iter=2)
    ddp, opt = _powersgd_ddp(net, 25, state)  # one bucket (after DDP's rebuild)
    _steps(ddp, opt, 0, 5)
    saved, weights, momentum = state.export(), copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved["iter"] == 5 and saved["error"] and saved["q"]
    _steps(ddp, opt, 5, 3)
    expected = net.state_dict()

    other = _net()
    other.load_state_dict(weights)
    state2 = comm_hooks.PowerSGDHookState(rank=2, start_iter=2)
    assert state2.load(saved, saved["error"]) == []
    ddp2, opt2 = _powersgd_ddp(other, 0.001, state2)  # a bucket per parameter or so: another layout
    opt2.load_state_dict(momentum)
    _steps(ddp2, opt2, 5, 3)
    assert len(state2._keys) > 2  # it did meet other layouts
    for k, v in other.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6, msg=f"{k} differs")


def test_pq_layout_matches_the_memory_torch_allocates(one_process_group):
    net = _net()
    state = comm_hooks.PowerSGDHookState(rank=2, start_iter=2)
    ddp, opt = _powersgd_ddp(net, 25, state)
    _steps(ddp, opt, 0, 4)
    compressed = set()
    for key, slots in state._slots.items():
        if key in state.torch_state.q_memory_dict:
            layout = comm_hooks.pq_layout(slots, 2)
            assert sum(v[1] for v in layout.values()) == state.torch_state.p_memory_dict[key].numel()
            assert sum(v[3] for v in layout.values()) == state.torch_state.q_memory_dict[key].numel()
            compressed |= set(layout)
    assert compressed == {f"{i}.weight" for i in (0, 2, 5, 7, 9, 11, 13, 15)}  # the biases go uncompressed


def _train_scaled(scaler: torch.amp.GradScaler | None) -> tuple[dict, dict]:
    net = _net()
    state = comm_hooks.PowerSGDHookState(rank=2, start_iter=2)
    ddp, opt = _powersgd_ddp(net, 25, state)
    state.loss_scale = (lambda: scaler._scale) if scaler is not None else (lambda: None)
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return net.state_dict(), state.export()["error"]


def test_powersgd_error_feedback_does_not_depend_on_a_changing_loss_scale(one_process_group):
    """A loss scale that doubles every step (a GradScaler growing after clean steps) trains the same weights, with
    the same stored error feedback, as no loss scaling."""
    plain, plain_error = _train_scaled(None)
    growing = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_factor=2.0, growth_interval=1)
    scaled, scaled_error = _train_scaled(growing)
    assert growing.get_scale() == 2.0 ** 12 and plain_error
    for k, v in plain.items():
        torch.testing.assert_close(scaled[k], v, rtol=1e-4, atol=1e-6, msg=f"{k} differs")
    for k, v in plain_error.items():
        torch.testing.assert_close(scaled_error[k], v, rtol=1e-3, atol=1e-6, msg=f"error of {k} differs")


@pytest.mark.parametrize(("hook", "precision", "scaled", "warned"), [
    ("fp16", "bf16-mixed", False, True), ("fp16", "32-true", False, True), ("fp16", "16-mixed", True, False),
    ("bf16", "bf16-mixed", False, False), ("powersgd", "32-true", False, False),
])
def test_fp16_hook_without_loss_scaling_is_warned_about(hook, precision, scaled, warned):
    said = comm_hooks.precision_warning(hook, precision, scaled)
    assert (said is not None) == warned
    if warned:
        assert "--trainer.strategy.comm_hook bf16" in said and "--trainer.precision 16-mixed" in said


@pytest.mark.slow
def test_fp16_hook_with_bf16_mixed_warns_once_from_the_cli(tiny_data, tmp_path):
    proc = run_main(_fit(tiny_data, tmp_path, "fp16", epochs=1, extra=[
        "--trainer.precision", "bf16-mixed", "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "0"]),
        env={"OMP_NUM_THREADS": "1"})
    said = proc.stdout + proc.stderr
    assert said.count("comm_hook fp16 with precision bf16-mixed (no loss scaling)") == 1, said[-3000:]


# ------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize(("args", "names"), [
    (("powersgd", 0, None, "gloo"), "powersgd_rank must be >= 1"),
    (("powersgd", 2, 1, "gloo"), "powersgd_start_iter must be >= 2"),
    (("fp16", 2, None, "mpi"), "comm_hook fp16 cannot run on the MPI backend"),
    (("bf16", 2, None, "mpi"), "comm_hook bf16 cannot run on the MPI backend"),
    (("int8", 2, None, "gloo"), "'int8' is not a hook"),
])
def test_settings_a_backend_cannot_do_are_refused_in_one_paragraph(args, names):
    with pytest.raises(UserError, match=names):
        comm_hooks.check_settings(*args)


def test_bf16_without_nccl_is_refused_naming_the_torch_check(monkeypatch):
    monkeypatch.setattr(comm_hooks, "_bf16_hook_allowed", lambda: False)
    with pytest.raises(UserError, match=r"NCCL >= 2.10.*_check_comm_hook.*Use comm_hook fp16"):
        comm_hooks.check_settings("bf16", 2, None, "gloo")


def test_a_bad_hook_setting_stops_the_cli_with_exit_2(tiny_data, tmp_path):
    proc = run_main(["fit", "--config", "configs/ddp.yaml", "--config", "configs/comm/powersgd.yaml",
                     *quick_args(tiny_data, tmp_path), "--trainer.strategy.powersgd_start_iter", "1"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "powersgd_start_iter must be >= 2" in proc.stderr and "Traceback" not in proc.stderr
