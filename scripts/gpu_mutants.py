"""The GPU decode's CUDA tests, each seen failing with its defect put back (a part of scripts/gpu_check.py).

First the tests as they are, which must pass; then, for each defect, a copy of the repository with one line of
the template changed to the defect and its test run there, which must fail. A test that passes with its defect
back could not have caught it. Without CUDA the tests skip, and so does every defect: said, exit status 0.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DECODE = "datamodules/sample/device_decode.py"
RESIZE = "datamodules/sample/dense_resize.py"
KERNEL = "datamodules/sample/resize_kernel.py"
TESTS = "tests/test_device_decode.py"
# (the defect, the file, the line as it is, the line with the defect, the test that must catch it)
DEFECTS = [
    ("the training stream does not wait for the side stream's event", DECODE,
     "training.wait_event(decoded.ready)", "pass",
     f"{TESTS}::test_the_training_stream_waits_for_the_side_streams_batch"),
    ("the batch decoded on the training stream, not a side stream (pytorch/vision PR 9606)", DECODE,
     "torch.cuda.stream(self.stream), torch.no_grad()",
     "torch.cuda.stream(torch.cuda.current_stream(self.device)), torch.no_grad()",
     f"{TESTS}::test_training_stream_memory_is_never_written_by_a_decode_it_did_not_wait_for"),
    ("the dense resize's weights in one part of 16 bits, which bf16 rounds", RESIZE,
     "return _round(torch.baddbmm(torch.bmm(a, b_low), a, b))", "return _round(torch.bmm(a, b + b_low))",
     "tests/test_banded_resize.py::test_every_mode_on_the_gpu_gives_the_cpus_dense_pixels"),
    ("the resize kernels' horizontal taps one column off", KERNEL,
     "column = tl.minimum(start + k, width - 1)", "column = tl.minimum(start + k + 1, width - 1)",
     "tests/test_banded_resize.py::test_every_mode_on_the_gpu_gives_the_cpus_dense_pixels"),
]
SKIP = shutil.ignore_patterns(".git", ".venv", ".wheelhouse", "gc", "out", "__pycache__", "*.egg-info",
                              "lightning_logs")


def pytest(where: Path, *args: str) -> tuple[str, str]:
    """('passed' | 'failed' | 'skipped', pytest's last line)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "--timeout", "120", "-rfEs", "--tb=line", *args],
                          cwd=where, capture_output=True, text=True, check=False)
    last = ([line for line in proc.stdout.splitlines() if line.strip()] or [""])[-1]
    if proc.returncode == 0:
        return ("skipped" if " passed" not in last else "passed"), last
    return "failed", last


def main() -> int:
    status, last = pytest(REPO, TESTS)
    print(f"gpu_mutants: {TESTS} as it is: {last}", flush=True)
    if status != "passed":
        print(f"gpu_mutants: {'no CUDA: nothing to put back' if status == 'skipped' else 'the tests fail as they are'}")
        return 0 if status == "skipped" else 1
    missed = []
    with tempfile.TemporaryDirectory(prefix="gpu-mutant-") as tmp:
        for defect, path, good, bad, test in DEFECTS:
            copy = Path(tmp) / "repo"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(REPO, copy, ignore=SKIP)
            text = (copy / path).read_text()
            if text.count(good) != 1:
                print(f"gpu_mutants: {path} no longer holds `{good}` once: update scripts/gpu_mutants.py")
                return 1
            (copy / path).write_text(text.replace(good, bad))
            status, last = pytest(copy, test)
            seen = status == "failed"
            print(f"gpu_mutants: {defect}: {test.split('::')[1]} {'fails' if seen else 'PASSES'} ({last})",
                  flush=True)
            if not seen:
                missed.append(defect)
    print(f"gpu_mutants: {len(DEFECTS) - len(missed)} of {len(DEFECTS)} defects caught"
          + (f"; missed: {'; '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
