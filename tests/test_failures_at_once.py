"""A failing test is named the moment it fails, so a run cut off before its summary still says what failed."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_a_run_cut_off_after_a_failure_has_already_named_it(tmp_path):
    tests = tmp_path / "test_cut.py"
    tests.write_text("import os\n\n"
                     "def test_fails():\n    assert 1 == 2\n\n"
                     "def test_cut_off():\n    os._exit(3)  # a time limit's kill: no summary\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.failures_at_once",
                           "-p", "no:cacheprovider", str(tests)], check=False, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FAILED test_cut.py::test_fails: assert 1 == 2" in done.stdout, done.stdout
