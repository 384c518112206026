"""The test suite's own exit: pytest's verdict is the process's exit status even when a library's
teardown crashes at interpreter exit (tests/conftest.py's ``pytest_sessionfinish``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CRASHING_TEARDOWN = """
import atexit
import ctypes

atexit.register(lambda: ctypes.string_at(0))  # a segfault while the interpreter shuts down


def test_passes():
    pass


def test_verdict():
    assert {outcome}
"""


def run_pytest(folder: Path) -> subprocess.CompletedProcess:
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder), str(folder)]
    return subprocess.run(run, cwd=folder, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fails, code", [(False, 0), (True, 1)])
def test_a_crash_in_teardown_leaves_the_verdict_as_the_exit_status(tmp_path, fails, code):
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_crash.py").write_text(CRASHING_TEARDOWN.format(outcome=not fails))
    out = run_pytest(tmp_path)
    assert out.returncode == code, out.stdout + out.stderr
    assert ("1 failed, 1 passed" if fails else "2 passed") in out.stdout  # the output was flushed


def test_without_the_hook_the_same_crash_takes_the_exit_status(tmp_path):
    """The check above would pass vacuously if the crash never happened."""
    (tmp_path / "test_crash.py").write_text(CRASHING_TEARDOWN.format(outcome=True))
    out = run_pytest(tmp_path)
    assert out.returncode == -11 and "2 passed" in out.stdout
