""".ci/run, CI's entry point, with a stand-in `make` that records its targets: every step's wall
time is printed, `make test` past its alarm prints a warning and goes on, and a failing step
fails the run with its time still printed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

FAKE_MAKE = """#!/usr/bin/env bash
echo "$*" >> "{log}"
[ "$*" != "{failing}" ]
"""


def run_ci(tmp_path: Path, failing: str = "", warn_s: int = 1200) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "make.log"
    (bin_dir / "make").write_text(FAKE_MAKE.format(log=log, failing=failing))
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MAKE_TEST_WARN_S": str(warn_s)}
    out = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    return out, log.read_text().splitlines() if log.exists() else []


def timeless(line: str) -> str:
    """``line`` with its durations as ``M min SS s``: the fake steps take no time, but a step that
    starts just before a second ticks over is timed at 1 s (``date +%s`` counts whole seconds)."""
    return re.sub(r"\d+ min \d\d s", "M min SS s", line)


def test_each_step_is_timed_and_the_targets_run_in_order(tmp_path):
    out, targets = run_ci(tmp_path)
    assert out.returncode == 0, out.stderr
    assert targets == ["install-dev monitoring-tools", "test", "test-long"]
    lines = [timeless(line) for line in out.stdout.splitlines()]
    assert lines[0] == "ci: set-up (make install-dev monitoring-tools) took M min SS s (exit 0)"
    assert lines[1:] == [
        "ci: make test took M min SS s (exit 0)",
        "ci: make test-long took M min SS s (exit 0)",
        "ci: all steps took M min SS s",
    ]


def test_make_test_past_its_alarm_warns_and_ci_goes_on(tmp_path):
    out, targets = run_ci(tmp_path, warn_s=-1)
    assert out.returncode == 0 and targets[-1] == "test-long"
    warnings = [timeless(line) for line in out.stdout.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith("ci: WARNING: make test took M min SS s, over its ")


def test_a_failing_step_fails_ci_with_its_time_printed(tmp_path):
    out, targets = run_ci(tmp_path, failing="test")
    assert out.returncode == 1
    assert targets == ["install-dev monitoring-tools", "test"]  # test-long never ran
    assert timeless(out.stdout.splitlines()[-1]) == "ci: make test took M min SS s (exit 1)"
