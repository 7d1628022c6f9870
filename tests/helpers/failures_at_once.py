"""A pytest plugin (tests/conftest.py loads it): each failing test's id, and why, printed the moment it fails.

`pytest -q` prints an F, and names the test only in the summary at the end: a run cut off by a time limit (a CI
step's, `timeout`) ends without one and never says what failed.
"""
from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = crash.message.splitlines()[0][:200] if crash is not None and crash.message else ""
    phase = "" if report.when == "call" else f" (in its {report.when})"
    reporter = _reporter()
    line = f"FAILED {report.nodeid}{phase}" + (f": {why}" if why else "")
    if reporter is not None:
        reporter.write("\n")  # after -q's row of dots and Fs
        reporter.write_line(line, red=True, bold=True)
        reporter.flush()


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def _reporter():
    return _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
