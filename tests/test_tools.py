"""Every command-line tool (`python -m datamodules.*`, `python -m bench`) ends bad input in one paragraph with exit
status 2, Ctrl-C in one line with exit status 130 and SIGTERM in one line with exit status 143, never with a
traceback; a Ctrl-C or a SIGTERM to the whole process group (the tool and its worker processes) ends it once, no
process the tool started survives it (datamodules/processes/exits.py), and a rerun completes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datamodules.processes.exits import descendants
from tests.helpers import REPO
from tests.helpers.processes import running

SETTLE_S = 15
STOPPED = {signal.SIGINT: ("stopped by SIGINT (Ctrl-C)", 130), signal.SIGTERM: ("stopped by SIGTERM", 143)}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    missing = tmp / "no-such-tree"
    (tmp / "a-file").write_text("not a folder")
    return [
        (["-m", "datamodules.lmdb", "--src", str(missing), "--dst", str(tmp / "x.lmdb")], f"--src {missing} is not"),
        (["-m", "datamodules.downscale", "--src", str(missing), "--dst", str(tmp / "d"), "--max-size", "64"],
         f"--src {missing} is not"),
        (["-m", "datamodules.shards", "--src", str(missing), "--dst", str(tmp / "s")], f"--src {missing} is not"),
        (["-m", "datamodules.builtin", "--dst", str(tmp / "a-file" / "tiny"), "--preset", "tiny", "--quiet"],
         str(tmp / "a-file")),
        (["-m", "bench", "loaders", "--data-dir", str(missing), "--max-batches", "200", "--out", str(tmp / "o")],
         f"--data-dir {missing} is not a folder"),
        (["-m", "bench", "train", "--data-dir", str(missing), "--out", str(tmp / "o")],
         f"--data-dir {missing} is not a folder"),
        (["-m", "bench", "gpu", "--out", str(tmp / "o")], "no usable CUDA device"),
        (["-m", "bench", "train", "--data-dir", str(missing), "--out", str(tmp / "o")],
         f"--data-dir {missing} is not a folder"),
        (["-m", "bench.progressive", "--data-dir", str(missing), "--out", str(tmp / "o")],
         f"--data-dir {missing} is not a folder"),
        (["-m", "bench", "nodes", "--rate", "fast", "--out", str(tmp / "o")], "rate 'fast' is not a tc rate"),
    ]


def test_bad_input_ends_in_one_paragraph_with_exit_2(tmp_path):
    for args, named in _bad_inputs(tmp_path):
        proc = _run(args)
        tool = " ".join(args[1:3])
        assert proc.returncode == 2, f"{tool}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert named in proc.stderr, f"{tool}: {proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, f"{tool}: {proc.stderr}"
    assert not (tmp_path / "o").exists() and not (tmp_path / "x.lmdb").exists()


def _larger(tree: Path, root: Path, copies: int = 20) -> Path:
    """`tree` `copies` times over, hard-linked (no new bytes): long enough to stop the fast tools midway."""
    for image in tree.rglob("*.png"):
        for k in range(copies):
            target = root / image.relative_to(tree).with_name(f"{k}-{image.name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(image, target)
    return root


def _stop_midway(args: list[str], started: Path | float, sig: int = signal.SIGINT,
                 whole_group: bool = True) -> tuple[int, str]:
    """Start the tool in a process group of its own, wait until `started` exists (it is working) or that many
    seconds have passed since it started its workers, then signal the whole group (or the tool alone)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while isinstance(started, float) and not descendants(proc.pid) and proc.poll() is None:
        assert time.monotonic() < deadline, f"{args}: never started its workers"
        time.sleep(0.05)
    if isinstance(started, float):
        time.sleep(started)
    while isinstance(started, Path) and not started.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, f"{args}: never started working ({started} never appeared)"
        time.sleep(0.05)
    time.sleep(0.2)  # its workers started
    assert proc.poll() is None, f"{args}: finished before it could be stopped"
    started_by_it = descendants(proc.pid)
    os.killpg(proc.pid, sig) if whole_group else os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    # no worker of the tool outlives it, nor anything it started elsewhere (zombies are dead: a container's PID 1
    # may not reap what a SIGKILLed tool leaves it). A fit's fork server started just before the signal reads its
    # alive pipe's end-of-file only once its preload is imported (multiprocessing/forkserver.py, `main`: seconds of
    # torch), and its resource tracker ends after it: they get SETTLE_S to end by themselves.
    deadline = time.monotonic() + SETTLE_S
    while (alive := [pid for pid in {*started_by_it, *_group(proc.pid)} if running(pid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"{args}: {[_command(pid) for pid in alive]} outlived the tool\n{(out + err)[-2000:]}"
    return proc.returncode, out + err


def _group(pgid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(entry)) == pgid:
                found.append(int(entry))
        except OSError:
            continue
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)


def _stopped_once(code: int, output: str, sig: int) -> None:
    said, status = STOPPED[sig]
    assert code == status, output[-3000:]
    assert sum(said in line for line in output.splitlines()) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_a_packer_stops_it_in_one_line_and_a_rerun_finishes(sig, slow_tree, tmp_path):
    dst = tmp_path / "out.lmdb"
    args = ["-m", "datamodules.lmdb", "--src", str(slow_tree), "--dst", str(dst), "--workers", "2",
            "--commit-every", "10", "--quiet"]
    code, output = _stop_midway(args, tmp_path / ".out.lmdb.partial", sig)
    _stopped_once(code, output, sig)
    assert f"{STOPPED[sig][0]}; rerun the same command" in output and not dst.exists(), output[-3000:]
    again = _run(args)
    assert again.returncode == 0 and dst.is_dir(), again.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tool", ["downscale", "shards", "builtin"])
def test_a_stop_signal_to_the_whole_group_stops_each_tool_in_one_line(tool, sig, slow_tree, tmp_path):
    dst, tree = tmp_path / "out", _larger(slow_tree, tmp_path / "tree")
    args, started = {
        "downscale": (["-m", "datamodules.downscale", "--src", str(tree), "--dst", str(dst), "--max-size", "64",
                       "--workers", "2", "--quiet"], dst),
        # the pack's folder appears with its last chunk: stop it 0.5 s after its workers started (a fresh
        # clone's whole pack of this tree took 1.7 s)
        "shards": (["-m", "datamodules.shards", "--src", str(tree), "--dst", str(dst), "--workers", "2",
                    "--chunk-mb", "1", "--quiet"], 0.5),
        # its folder is renamed into place when complete: stop it 1 s after its workers started
        "builtin": (["-m", "datamodules.builtin", "--dst", str(dst), "--preset", "small", "--workers", "2",
                     "--quiet"], 1.0),
    }[tool]
    code, output = _stop_midway(args, started, sig)
    _stopped_once(code, output, sig)
    again = _run(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert dst.is_dir() and not list(tmp_path.glob(".*partial*")), list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_bench_loaders_stops_its_s3_server_too(sig, tiny_data, tmp_path):
    """The S3 row starts a moto_server (bench/loaders/streaming.py): the tool alone signalled while the server
    runs (a signal to the group would reach the server directly) ends in one line, and the server with it."""
    work = tmp_path / "work"
    args = ["-m", "bench", "loaders", "--data-dir", str(tiny_data), "--backends", "streaming-s3", "--max-batches",
            "2", "--rounds", "1", "--warm-epochs", "1", "--no-ceilings", "--num-workers", "1", "--image-size", "32",
            "--work-dir", str(work), "--out", str(tmp_path / "o")]
    code, output = _stop_midway(args, work / "moto.log", sig, whole_group=False)
    _stopped_once(code, output, sig)
    assert not (tmp_path / "o").exists(), output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tool", ["train", "progressive"])
def test_a_stop_signal_to_the_group_of_a_long_bench_stops_it_and_its_fits_in_one_line(tool, sig, tiny_data,
                                                                                      tmp_path):
    """The long benchmarks run each row as a `main.py fit` subprocess: a signal to the whole group, 4 s after the
    first one started, ends the tool in one line, writes no result, and leaves no fit behind."""
    out = tmp_path / "o"
    args = {
        "train": ["-m", "bench", "train", "--data-dir", str(tiny_data), "--epochs", "30", "--image-size", "16",
                  "--batch-size", "16", "--num-workers", "1", "--overhead-pairs", "1", "--out", str(out)],
        "progressive": ["-m", "bench.progressive", "--data-dir", str(tiny_data), "--image-size", "32",
                        "--start-size", "16", "--step", "8", "--epochs", "30", "--batch-size", "16",
                        "--num-workers", "1", "--out", str(out)],
    }[tool]
    code, output = _stop_midway(args, 4.0, sig)
    _stopped_once(code, output, sig)
    assert "no result was written" in output and not out.exists(), output[-3000:]
