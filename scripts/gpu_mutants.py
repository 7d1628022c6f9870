"""The GPU decode's CUDA tests, each seen failing with its defect put back (a part of scripts/gpu_check.py).

The CUDA tests of CUDA_TESTS run as they are, and must pass; at the same time each entry of MUTANTS runs its test
with FIC_MUTANT set to its name, under which that test puts its defect back itself (tests/helpers/mutants.py), and
must fail: a test that passes with its defect back could not have caught it. Only a run whose tests fail counts as
caught (pytest's exit status 1), never one that could not collect or start. All runs go at once, each its own
pytest process (mostly start-up: torch, CUDA; the tests are small). Without CUDA the tests skip, and so does every
defect: said, exit status 0.

A defect no monkeypatch can put back (a line of a Triton kernel, which triton compiles from its source) is a
SOURCE_EDITS entry instead: its run goes in a copy of the repository with that one line changed.

`python scripts/gpu_mutants.py [--tests FILE ...] [--mutant NODE=NAME ...]` runs other tests or mutants instead of
the lists below (a rerun of one, or a new test tried before it joins MUTANTS).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTANT_ENV = "FIC_MUTANT"  # tests/helpers/mutants.py
CUDA_TESTS = ["tests/test_device_decode.py", "tests/test_device_resize.py", "tests/test_decode_ring.py",
              "tests/test_banded_resize.py"]
DECODE = "tests/test_device_decode.py"
RING = "tests/test_decode_ring.py"
BANDED = "tests/test_banded_resize.py"
# (the defect, the test that must catch it, the FIC_MUTANT name under which that test puts it back)
MUTANTS = [
    ("the training stream does not wait for the side stream's event",
     f"{DECODE}::test_the_training_stream_waits_for_the_side_streams_batch", "event-not-waited"),
    ("the batch decoded on the training stream, not a side stream (pytorch/vision PR 9606)",
     f"{DECODE}::test_training_stream_memory_is_never_written_by_a_decode_it_did_not_wait_for",
     "decode-on-training-stream"),
    ("the resize's weights in one part of 16 bits, which TF32 and bf16 round",
     f"{BANDED}::test_every_mode_on_the_gpu_gives_the_cpus_dense_pixels", "one-weight-part"),
    ("a ring slot written again before the training stream's event",
     f"{RING}::test_a_ring_slot_is_written_again_only_after_the_training_stream_is_done_with_it",
     "ring-slot-reused-early"),
    ("decoded images released before the host saw their resize finish",
     f"{RING}::test_decoded_images_live_until_the_host_saw_their_resize_finish", "images-released-early"),
    ("the side streams at the step's priority",
     f"{RING}::test_the_resize_stream_has_a_higher_priority_than_the_step", "step-priority"),
    ("the resize kernels' horizontal taps one column off",
     f"{BANDED}::test_every_mode_on_the_gpu_gives_the_cpus_dense_pixels", "kernel-column-off"),
]
# name -> (the file, the line as it is, the line with the defect): defects put back in a copy of the repository
SOURCE_EDITS = {
    "one-weight-part": ("datamodules/sample/dense_resize.py", "return _round(torch.baddbmm(torch.bmm(a, b_low), a, b))",
                        "return _round(torch.bmm(a, b + b_low))"),
    "kernel-column-off": ("datamodules/sample/resize_kernel.py", "column = tl.minimum(start + k, width - 1)",
                          "column = tl.minimum(start + k + 1, width - 1)"),
}
COPY_SKIP = shutil.ignore_patterns(".git", ".venv*", ".wheelhouse", "out", "__pycache__", "*.egg-info", "logs",
                                   "lightning_logs", "data", ".gpu-check*")
PYTEST = ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:randomly", "--timeout", "120",
          "-rfEs", "--tb=line"]


def start(args: list[str], mutant: str | None, cwd: Path, scratch: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != MUTANT_ENV}
    if mutant is not None:
        env[MUTANT_ENV] = mutant
    if mutant in SOURCE_EDITS and scratch is not None:
        cwd = edited_copy(cwd, scratch / mutant, *SOURCE_EDITS[mutant])
    return subprocess.Popen([sys.executable, *PYTEST, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def edited_copy(repo: Path, copy: Path, path: str, good: str, bad: str) -> Path:
    """`repo` copied to `copy` with the one line `good` of `path` made `bad`."""
    shutil.copytree(repo, copy, ignore=COPY_SKIP)
    text = (copy / path).read_text()
    if text.count(good) != 1:
        raise SystemExit(f"gpu_mutants: {path} no longer holds `{good}` once: update SOURCE_EDITS")
    (copy / path).write_text(text.replace(good, bad))
    return copy


def outcome(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'skipped' | 'error', pytest's last line): failed only when tests failed (exit 1)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return "error", f"timed out after {timeout:.0f} s"
    last = ([line for line in out.splitlines() if line.strip()] or [""])[-1]
    if proc.returncode == 0:
        return ("passed" if " passed" in last else "skipped"), last
    return ("failed" if proc.returncode == 1 else "error"), last


def run(tests: list[str], mutants: list[tuple[str, str, str]], cwd: Path = REPO, timeout: float = 240,
        cuda: bool | None = None) -> int:
    """The tests as they are and every mutant at once; 0 when the tests pass and every mutant fails (or without
    CUDA, where all skip), else 1. Each outcome said on its own line."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="gpu-mutants-"))
    try:
        return _run(tests, mutants, cwd, timeout, cuda, scratch, t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(tests: list[str], mutants: list[tuple[str, str, str]], cwd: Path, timeout: float, cuda: bool,
         scratch: Path, t0: float) -> int:
    as_is = start(tests, None, cwd)
    runs = [(defect, node, name, start([node], name, cwd, scratch)) for defect, node, name in mutants] if cuda else []
    print(f"gpu_mutants: {' '.join(tests)} as they are" + (f", and {len(runs)} defects put back, each in its own "
          "pytest at once" if runs else " (no CUDA here: no defect to put back)"), flush=True)
    status, last = outcome(as_is, timeout)
    print(f"gpu_mutants: as they are: {status} ({last})", flush=True)
    missed = []
    for defect, node, name, proc in runs:
        caught, line = outcome(proc, timeout)
        seen = caught == "failed"
        print(f"gpu_mutants: {defect} ({MUTANT_ENV}={name}): {node.split('::')[-1]} "
              f"{'fails' if seen else 'PASSES' if caught == 'passed' else caught.upper()} ({line})", flush=True)
        if not seen:
            missed.append(defect)
    if status == "skipped" and not runs:
        print("gpu_mutants: no CUDA: nothing to put back", flush=True)
        return 0
    print(f"gpu_mutants: {len(runs) - len(missed)} of {len(runs)} defects caught in {time.perf_counter() - t0:.0f} s"
          + (f"; missed: {'; '.join(missed)}" if missed else "")
          + ("" if status == "passed" else f"; the tests as they are: {status}"), flush=True)
    return 0 if status == "passed" and not missed else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="+", default=CUDA_TESTS, help="the test files run as they are")
    ap.add_argument("--mutant", nargs="+", default=None, metavar="NODE=NAME",
                    help="instead of MUTANTS: a test's node id and the FIC_MUTANT name it reads")
    args = ap.parse_args(argv)
    mutants = MUTANTS if args.mutant is None else [(f"{m.rsplit('=', 1)[1]} put back", *m.rsplit("=", 1))
                                                    for m in args.mutant]
    return run(args.tests, mutants)


if __name__ == "__main__":
    sys.exit(main())
