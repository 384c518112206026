"""Shared fixtures and the suite's order. The tiny model is built once into .cache/tiny-model (or
$RLPOST_TINY_MODEL), its tool-using variant into .cache/tiny-model-tools (or $RLPOST_TINY_TOOL_MODEL).

Each folder of tests/ is a tier, and every test in it carries the tier's marker (a collection
error names a file that does not), so `pytest -m unit` runs exactly tests/unit. The tiers run
in the order of TIERS: the fast, pure ones first, so that a broken function fails the run in
minutes, and the whole runs last, after the integration tier's Ray cluster is gone."""

from __future__ import annotations

import atexit
import fcntl
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "compat", "integration", "e2e")


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder of tests/ it is in (None outside tests/<tier>/)."""
    parts = Path(path).resolve().parts[len(REPO.parts) :]
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


def unmarked_files(items) -> list[str]:
    """The test files (relative to the repository) with a test that lacks its tier's marker."""
    return sorted(
        {
            "/".join(Path(item.path).resolve().parts[len(REPO.parts) :])
            for item in items
            if tier_of(item.path) is not None and item.get_closest_marker(tier_of(item.path)) is None
        }
    )


def pytest_collection_modifyitems(config, items):
    unmarked = unmarked_files(items)
    if unmarked:
        raise pytest.UsageError(
            "every test in tests/<tier>/ carries its tier's marker (pytestmark = pytest.mark.<tier>); "
            f"missing in: {', '.join(unmarked)}"
        )
    items.sort(key=lambda item: TIERS.index(tier_of(item.path)) if tier_of(item.path) else len(TIERS))


def tiny_model_dir() -> Path:
    return Path(os.environ.get("RLPOST_TINY_MODEL", REPO / ".cache" / "tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Path of the offline tiny model, built on first use (a file lock keeps parallel sessions safe)."""
    path = tiny_model_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        from rlpost.tiny_model import ensure_tiny_model

        ensure_tiny_model(path)  # builds, or rebuilds a cache made from an older spec
    return path


@pytest.fixture(scope="session")
def tiny_tool_model_path() -> Path:
    """The tool_arithmetic variant (``make-tiny-model --task tool_arithmetic``), built on first use
    (~2.5 min on 2 cores) and rebuilt when its spec changes."""
    from rlpost.tiny_model import TOOL_SPEC, ensure_tiny_model

    path = Path(os.environ.get("RLPOST_TINY_TOOL_MODEL", REPO / ".cache" / "tiny-model-tools"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".tiny-model-tools.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_tiny_model(path, TOOL_SPEC)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """End the test process with pytest's verdict, skipping the interpreter's teardown.

    This process has hosted vLLM clients, Ray drivers, gloo process groups and their native
    threads over ~1500 tests. Once, in CI, it died with SIGSEGV while Python tore those down,
    after pytest had printed "1581 passed", and the crash's exit status replaced the verdict.
    Each tier alone exits cleanly, and no test relies on what teardown would do (every fixture
    cleans up explicitly; the CLI's own exits are checked by the e2e tests, in their own
    processes). So the last atexit handler to be registered, which runs first, flushes the
    output and leaves with the verdict's code."""

    code = int(exitstatus)

    def leave_with_the_verdict() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave_with_the_verdict)
