"""Two simulated hosts (network namespaces, a shaped veth link) with real node processes: a fit across the
link trains on the global batches of one process, a cut link ends both nodes within the timeout naming the
peer, the command-line tool removes its namespaces after success, failure and Ctrl-C.

Needs root or CAP_NET_ADMIN; skipped with the reason elsewhere. Every test checks that no pair is left."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from netsim import link as netlink
from netsim.link import _has_net_admin
from netsim.nodes import Nodes
from tests.helpers import REPO
from tests.helpers.callbacks import recorded_samples
from tests.helpers.cli import quick_args, run_main
from tests.helpers.event_files import event_file_scalars

pytestmark = pytest.mark.timeout(600)
WHY_NOT = netlink.unavailable()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=f"netsim: {WHY_NOT}")


@pytest.fixture(autouse=True)
def no_pair_left_behind():
    """After each test, also a failed one: the pairs made during it are gone (removed here if not, and failed)."""
    before = set(netlink.existing())
    yield
    left = set(netlink.existing()) - before
    for tag in left:
        netlink.down(tag)
    assert not left, f"namespaces left behind: {sorted(left)}"


def _node_args(data: Path, root: Path, epochs: int, extra: list[str] = ()) -> list[str]:
    return ["fit", "--trainer.strategy", "ddp", *quick_args(data, root, epochs=epochs, batch=32),
            "--trainer.num_sanity_val_steps", "0", *extra]


# ------------------------------------------------------------------------------ without namespaces

def test_rates_delays_and_losses_are_checked_before_anything_is_made():
    assert netlink.rate_bits("1gbit") == 1e9 and netlink.rate_bits("200mbit") == 2e8
    assert netlink.rate_bits("100mbps") == 8e8  # tc: bps is bytes per second
    with pytest.raises(netlink.NetsimError, match="'1gb' is not a tc rate: write e.g. 1gbit"):
        netlink.up(rate="1gb")
    with pytest.raises(netlink.NetsimError, match="'10' is not a tc time"):
        netlink.up(delay="10")
    with pytest.raises(netlink.NetsimError, match="'10' is not a percentage"):
        netlink.up(loss="10")


def test_dry_run_prints_both_nodes_with_the_layout_after_the_users_arguments():
    proc = subprocess.run(["bash", "scripts/netsim.sh", "run", "--rate", "200mbit", "--", "--config",
                           "configs/ddp.yaml"], cwd=REPO, env={**os.environ, "DRY_RUN": "1"}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        assert f"NODE_RANK={node}" in line and "MASTER_ADDR=10.213.0.1" in line
        assert re.search(rf"GLOO_SOCKET_IFNAME=fic\d+x0v{node} ", line)
        assert line.endswith("main.py fit --config configs/ddp.yaml --trainer.num_nodes 2 --trainer.devices 1 "
                             "--trainer.accelerator cpu")


def test_without_cap_net_admin_the_script_refuses_in_one_line():
    prefix = []
    if _has_net_admin():  # take it away: a root process whose bounding set lacks it loses it at exec
        if shutil.which("setpriv") is None:
            pytest.skip("this process has CAP_NET_ADMIN and setpriv is missing to drop it")
        prefix = ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin"]
    proc = subprocess.run([*prefix, "bash", "scripts/netsim.sh", "run", "--rate", "1gbit", "--", "--config",
                           "configs/ddp.yaml"], cwd=REPO, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"netsim: network namespaces need root or CAP_NET_ADMIN; this process (uid "
                                   f"{os.geteuid()}) does not have CAP_NET_ADMIN.")
    assert proc.stdout == ""


# ------------------------------------------------------------------------------ across the link

def _netem_missing() -> str | None:
    """Why this kernel cannot simulate loss (netlink's one line), or None when it can."""
    try:
        with netlink.simulated_link(loss="10%"):
            return None
    except netlink.NetsimError as error:
        return str(error)


@needs_namespaces
def test_netem_settings_are_refused_in_one_line_where_the_kernel_lacks_netem():
    why = _netem_missing()
    if why is None:
        pytest.skip("this kernel has netem: loss is simulated (test_ten_percent_loss_... uses it)")
    assert why.startswith("netem is not available in this kernel") and "--rate works (tbf)" in why


@needs_namespaces
@pytest.mark.slow
def test_ten_percent_loss_never_hangs_a_fit(tiny_data, tmp_path):
    why = _netem_missing()
    if why is not None:
        pytest.skip(f"netsim: {why}")
    timeout_s = 20
    with netlink.simulated_link(rate="100mbit", loss="10%") as link:
        nodes = Nodes(link, _node_args(tiny_data, tmp_path, epochs=1), env={"FIC_DDP_TIMEOUT_S": str(timeout_s)})
        try:
            codes = nodes.wait(240)
        finally:
            nodes.stop(grace_s=0)
    assert None not in codes, "a node still ran after 240 s on a lossy link"
    if codes != [0, 0]:  # TCP retransmits; if a collective still timed out, both say so in one paragraph
        for node in (0, 1):
            assert f"Distributed run failed on rank {node} of 2 processes" in nodes.output(node)


@needs_namespaces
@pytest.mark.slow
def test_two_nodes_across_the_link_train_on_the_global_batches_of_one_process(tiny_data, tmp_path):
    out = tmp_path / "samples"
    record = ["--trainer.log_every_n_steps", "1", "--trainer.callbacks+=tests.helpers.callbacks.SampleRecorder",
              f"--trainer.callbacks.out_dir={out}"]
    with netlink.simulated_link(rate="1gbit") as link:
        nodes = Nodes(link, _node_args(tiny_data, tmp_path / "nodes", epochs=1, extra=record))
        codes = nodes.wait(300)
        sent = [link.counters(node)["tx_bytes"] for node in (0, 1)]
    assert codes == [0, 0], nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in nodes.output(1)
    runs = recorded_samples(out)
    assert runs[0, 0]["world_size"] == 2 and runs[0, 0]["num_nodes"] == 2
    steps = runs[0, 0]["steps"]
    # the gradients crossed the veth: each node sent at least the model's gradients once per step
    params = sum(t.numel() for t in torch.load(tmp_path / "nodes" / "version_0" / "checkpoints" / "last.ckpt",
                                               weights_only=True)["state_dict"].values())
    assert min(sent) > steps * params * 4 * 0.5, sent

    one_out = tmp_path / "one"
    run_main(["fit", *quick_args(tiny_data, tmp_path / "one_run", epochs=1, batch=32),
              "--trainer.num_sanity_val_steps", "0", *record[:3], f"--trainer.callbacks.out_dir={one_out}"])
    single = recorded_samples(one_out)
    assert single[0, 0]["steps"] == steps
    assert not set(runs[0, 0]["indices"]) & set(runs[1, 0]["indices"]), "the nodes share samples"
    for k in range(steps):
        union = set(runs[0, 0]["batches"][k]) | set(runs[1, 0]["batches"][k])
        assert union == set(single[0, 0]["batches"][k]), f"step {k} differs"
    lrs = [[(e.step, round(e.value, 9)) for e in event_file_scalars(root / "version_0").Scalars("train/lr")]
           for root in (tmp_path / "nodes", tmp_path / "one_run")]
    assert len(lrs[0]) == steps and lrs[0] == lrs[1]


def _wait_for(nodes: Nodes, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes.procs):
            raise AssertionError(f"no {path} from the nodes:\n{nodes.output(0)[-3000:]}\n{nodes.output(1)[-3000:]}")
        time.sleep(0.2)


@needs_namespaces
@pytest.mark.slow
def test_a_cut_link_ends_both_nodes_within_the_timeout_naming_the_peer_and_its_address(tiny_data, tmp_path):
    """PowerSGD over many small buckets on a slow link first: an epoch must train (gloo once issued the
    buckets' chained all-reduces in a different order on each node, and the run hung), then the cut."""
    timeout_s = 15
    powersgd = ["--config", "configs/comm/powersgd.yaml", "--trainer.strategy.powersgd_start_iter", "2",
                "--trainer.strategy.bucket_cap_mb", "0.02"]
    args = _node_args(tiny_data, tmp_path, epochs=50, extra=powersgd)
    del args[1:3]  # --trainer.strategy ddp: the config's ClusterDDPStrategy, its timeout from FIC_DDP_TIMEOUT_S
    with netlink.simulated_link(rate="10mbit") as link:
        nodes = Nodes(link, args, env={"FIC_DDP_TIMEOUT_S": str(timeout_s)})
        try:
            _wait_for(nodes, tmp_path / "version_0" / "checkpoints" / "last.ckpt", 300)  # an epoch has trained
            link.set_state(up=False, node=0)
            cut = time.monotonic()
            codes = nodes.wait(timeout_s + 45)
            waited = time.monotonic() - cut
        finally:
            nodes.stop(grace_s=0)
    outputs = [nodes.output(0), nodes.output(1)]
    assert all(c not in (0, None) for c in codes), (codes, outputs[0][-2000:], outputs[1][-2000:])
    assert waited < timeout_s + 45
    print(f"\nlink cut: node exit codes {codes}, {waited:.1f} s after the cut")
    for node, other in ((0, 1), (1, 0)):
        paragraph = next(line for line in outputs[node].splitlines() if line.startswith("Distributed run failed"))
        print(f"[node {node}] {paragraph}")
        assert paragraph.startswith(f"Distributed run failed on rank {node} of 2 processes: timed out (collective "
                                    f"timeout {timeout_s} s); it lost rank {other} at {link.addresses[other]}")
        assert "Traceback" not in outputs[node]
    last = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] >= 7 and last["global_step"] % 7 == 0  # an epoch's end (7 steps of 2 x 16)
    # rank 0's error feedback in the checkpoint, rank 1's in its own file beside it (comm_hooks.side_path)
    assert last["ddp_comm_hook_state"]["world"] == 2 and last["ddp_comm_hook_state"]["error"]
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt.powersgd-rank1").exists()


def _netsim(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(["bash", "scripts/netsim.sh", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@needs_namespaces
@pytest.mark.slow
def test_run_removes_its_namespaces_after_a_node_is_killed_and_reports_the_lost_node(tiny_data, tmp_path):
    kill_node_1 = ["--trainer.callbacks+=tests.helpers.callbacks.SignalAt", "--trainer.callbacks.epoch=1",
                   "--trainer.callbacks.batch=1", "--trainer.callbacks.sig=SIGKILL", "--trainer.callbacks.rank=1"]
    proc = _netsim(["run", "--rate", "1gbit", "--", *_node_args(tiny_data, tmp_path, epochs=3, extra=kill_node_1)[1:]],
                   env={"FIC_DDP_TIMEOUT_S": "15"})
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode not in (0, None), out[-3000:]
    tag = re.search(r"netsim: (fic\d+x\w+): node 0", out).group(1)
    assert f"netsim: node exit codes [1, -9]; removing {tag}." in out, out[-3000:]
    assert re.search(r"\[node 0\] Distributed run failed on rank 0 of 2 processes: lost a peer .*; it lost rank 1 at "
                     r"10\.213\.0\.2", out), out[-3000:]
    assert tag not in netlink.existing()
    torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


@needs_namespaces
@pytest.mark.slow
def test_ctrl_c_stops_the_nodes_and_removes_the_namespaces(tiny_data, tmp_path):
    proc = _netsim(["run", "--", *_node_args(tiny_data, tmp_path, epochs=50)[1:]])
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Initializing distributed: GLOBAL_RANK: 1" in line:
            break
    tag = re.search(r"netsim: (fic\d+x\w+): node 0", "".join(seen)).group(1)
    assert tag in netlink.existing()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest[-2000:]
    assert "netsim: SIGINT: stopping the nodes" in rest
    assert tag not in netlink.existing()


@needs_namespaces
def test_down_removes_only_pairs_whose_owner_is_gone():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale = netlink.up(owner=int(dead))
    live = netlink.up()
    try:
        proc = subprocess.run(["bash", "scripts/netsim.sh", "down"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0 and stale.tag in proc.stdout and live.tag not in proc.stdout
        assert stale.tag not in netlink.existing() and live.tag in netlink.existing()
    finally:
        netlink.down(live.tag)
        netlink.down(stale.tag)
