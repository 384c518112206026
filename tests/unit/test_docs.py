"""docs/ matches the code: the generated config reference is current, the contracts page names
every required metrics key, Ray gauge and command, and nothing cites documents outside the repo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlpost.config.reference import DOC_PATH, main, render
from rlpost.record.metrics import REQUIRED_KEYS, RayMetrics

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = (REPO / "docs" / "contracts.md").read_text()


def test_the_config_reference_is_generated_from_the_current_config():
    assert DOC_PATH.read_text() == render(), "docs/config.md is out of date: run python -m rlpost.config.reference"
    assert main(["--check"]) == 0
    text = render()
    for key in ("eval.interval", "logging.trackers", "logging.dashboard", "rollout.engine.max_model_len",
                "tools.python.timeout_s", "resources.learner.num_threads"):  # fmt: skip
        assert f"| `{key}` |" in text, key


def test_the_contracts_page_names_every_metric_gauge_and_command():
    named = set(re.findall(r"`(\w+)`", CONTRACTS))
    assert set(REQUIRED_KEYS) <= named
    assert set(RayMetrics.GAUGES) | set(RayMetrics.COUNTERS) <= named, set(RayMetrics.GAUGES) - named
    from rlpost.ops.cli import _build_parser

    subparsers = next(a for a in _build_parser()._actions if a.dest == "command")
    for command in subparsers.choices:
        assert f"`rlpost {command}" in CONTRACTS, command
    for actor in ("inference-<i>", "env-pool-<i>", "learner", "reference", "buffer", "rlpost-<run_name>"):
        assert f"`{actor}`" in CONTRACTS, actor


def test_no_file_cites_the_team_notes_outside_the_repository():
    cited = re.compile("|".join([r"DESIGN" + r"\.md", r"STYLE" + r" rule", r"REFERENCE" + r"\.md", r"seed" + r" 00\d"]))
    offenders = []
    for folder in ("rlpost", "tests", "bench", "examples", "scripts", "docs", "configs", "deploy"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yaml", ".yml", ".sh") and path.is_file():
                offenders += [f"{path.relative_to(REPO)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                              if cited.search(line)]  # fmt: skip
    assert not offenders, offenders
