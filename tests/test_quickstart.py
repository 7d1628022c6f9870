"""The README's first command, as a newcomer runs it, reaches the promised accuracy."""
from __future__ import annotations

import re

import pytest

from tests.helpers.cli import run_main


@pytest.mark.slow
@pytest.mark.every_ci  # the README's first promise
def test_quickstart_reaches_90_percent(tmp_path):
    # about a minute on a 2-core VM; below pytest's 600 s (pyproject.toml), so a hang ends as this run's TimeoutExpired
    proc = run_main(["fit", "--config", "configs/ddp_amp.yaml", "--trainer.default_root_dir", str(tmp_path)],
                    timeout=540)
    out = proc.stdout + proc.stderr
    match = re.search(r"Done: best val/acc1 ([0-9.]+); (\d+) epochs?; ([0-9,]+) images/s", out)
    assert match, out[-3000:]
    assert float(match.group(1)) >= 0.90
    assert int(match.group(2)) == 15
    assert "Where the time went:" in out
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
