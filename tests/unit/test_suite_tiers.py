"""The suite's tiers (tests/conftest.py): a test file in tests/<tier>/ without its tier's marker is
a collection error that names it, and the tiers run in the order unit, compat, integration, e2e
whatever the files' names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

MARKED = """
import pytest

pytestmark = pytest.mark.{tier}


def test_{name}():
    print("test ran: {tier}/{name}")
"""


def suite(root: Path, files: dict[str, str]) -> Path:
    """A copy of the suite's conftest.py under root/tests/, and the given test files in it."""
    tests = root / "tests"
    tests.mkdir()
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tests / "conftest.py")
    for name, text in files.items():
        (tests / name).parent.mkdir(exist_ok=True)
        (tests / name).write_text(text)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    unit\n    compat\n    integration\n    e2e\n")
    return root


def run_pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(root), "-s", *args, "tests"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)


def ran(out: subprocess.CompletedProcess) -> list[str]:
    """The tests that ran, in order (each prints ``test ran: <tier>/<name>``)."""
    return re.findall(r"test ran: (\S+)", out.stdout)


def test_a_file_without_its_tiers_marker_is_named_and_nothing_runs(tmp_path):
    root = suite(
        tmp_path,
        {
            "unit/test_marked.py": MARKED.format(tier="unit", name="marked"),
            "unit/test_unmarked.py": "def test_plain():\n    pass\n",
            "integration/test_wrong.py": MARKED.format(tier="unit", name="wrong"),
        },
    )
    out = run_pytest(root, "-m", "unit")
    assert out.returncode != 0
    assert "missing in: tests/integration/test_wrong.py, tests/unit/test_unmarked.py" in out.stdout + out.stderr
    assert ran(out) == []


def test_tiers_run_fast_first_and_each_runs_alone(tmp_path):
    root = suite(
        tmp_path,
        {
            f"{tier}/test_{tier}.py": MARKED.format(tier=tier, name=tier)
            for tier in ("e2e", "integration", "compat", "unit")
        },
    )
    out = run_pytest(root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ran(out) == ["unit/unit", "compat/compat", "integration/integration", "e2e/e2e"]
    assert ran(run_pytest(root, "-m", "compat")) == ["compat/compat"]


RECORDING_ENGINE = """
import pytest


@pytest.fixture
def plain_llm(shared_engines):
    # the shared engine's bookkeeping with an engine that only says when it starts and stops
    return shared_engines("plain_llm", lambda: print("engine started") or "engine", lambda _: print("engine stopped"))
"""

USES_ENGINE = """
import pytest

pytestmark = pytest.mark.{tier}


def test_{name}_first(plain_llm):
    print("test ran: {tier}/{name}_first")


def test_{name}_second(plain_llm):
    print("test ran: {tier}/{name}_second")
"""


def test_a_shared_engine_starts_once_its_users_go_first_in_their_tier_and_it_stops_after_the_last(tmp_path):
    files = {f"{tier}/conftest.py": RECORDING_ENGINE for tier in ("compat", "integration")}
    files |= {
        "compat/test_a_compat_plain.py": MARKED.format(tier="compat", name="plain"),
        "compat/test_b_compat_engine.py": USES_ENGINE.format(tier="compat", name="engine"),
        "integration/test_a_integration_plain.py": MARKED.format(tier="integration", name="plain"),
        "integration/test_b_integration_engine.py": USES_ENGINE.format(tier="integration", name="engine"),
    }
    root = suite(tmp_path, files)
    out = run_pytest(root)
    assert out.returncode == 0, out.stdout + out.stderr
    events = re.findall(r"test ran: \S+|engine \w+", out.stdout)
    assert events == [
        "engine started",
        "test ran: compat/engine_first",
        "test ran: compat/engine_second",
        "test ran: compat/plain",
        "test ran: integration/engine_first",
        "test ran: integration/engine_second",
        "engine stopped",  # right after its last user, before the next test
        "test ran: integration/plain",
    ]
    # the last user among the selected tests
    events = re.findall(r"test ran: \S+|engine \w+", run_pytest(root, "-m", "compat", "-k", "first").stdout)
    assert events == ["engine started", "test ran: compat/engine_first", "engine stopped"]


LOGGED = """
import os

import pytest

pytestmark = pytest.mark.{tier}


def log(event):
    with open(os.environ["EVENTS"], "a") as out:
        out.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + " " + event + "\\n")
"""

LOGGING_ENGINE = (
    LOGGED
    + """

@pytest.fixture
def plain_llm(shared_engines):
    return shared_engines("plain_llm", lambda: log("engine started") or "engine", lambda _: log("engine stopped"))
"""
)

LOGGED_TESTS = (
    LOGGED
    + """

def test_{name}_first({fixture}):
    log("ran {name}_first")


def test_{name}_second():
    log("ran {name}_second")
"""
)


def test_under_xdist_a_worker_takes_a_file_whole_and_an_engines_users_together(tmp_path, monkeypatch):
    """`make test`'s ``-n 2 --dist loadfile``: each file's tests run on one worker (its module's
    fixtures start once), and every file with a user of a shared engine runs on the worker that
    started it, which starts it once and stops it after its last user."""
    files = {f"{tier}/conftest.py": LOGGING_ENGINE.format(tier=tier) for tier in ("compat", "integration")}
    for tier in ("compat", "integration"):
        files[f"{tier}/test_{tier}_engine.py"] = LOGGED_TESTS.format(
            tier=tier, name=f"{tier}_engine", fixture="plain_llm"
        )
        for k in range(3):
            name = f"{tier}_plain{k}"
            files[f"{tier}/test_{name}.py"] = LOGGED_TESTS.format(tier=tier, name=name, fixture="tmp_path")
    root = suite(tmp_path, files)
    monkeypatch.setenv("EVENTS", str(root / "events.txt"))
    out = run_pytest(root, "-n", "2", "--dist", "loadfile")
    assert out.returncode == 0, out.stdout + out.stderr
    events = [line.split(" ", 1) for line in (root / "events.txt").read_text().splitlines()]
    worker = {}  # file -> the workers that ran its tests
    for who, event in events:
        if event.startswith("ran "):
            worker.setdefault(event[4:].rsplit("_", 1)[0], set()).add(who)
    assert len(worker) == 8 and all(len(workers) == 1 for workers in worker.values()), events
    assert {next(iter(w)) for w in worker.values()} == {"gw0", "gw1"}  # both workers took files
    engine = [(who, event) for who, event in events if event.startswith("engine")]
    assert [event for _, event in engine] == ["engine started", "engine stopped"], events
    host = engine[0][0]
    assert worker["compat_engine"] == worker["integration_engine"] == {host}
    on_host = [event for who, event in events if who == host]
    assert on_host.index("engine stopped") == on_host.index("ran integration_engine_first") + 1  # its last user
