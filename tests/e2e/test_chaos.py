"""The chaos harness, short: real `rlpost train` runs of the tiny job that lose actors.

scripts/chaos.py ends actors at random moments in random ways (`make chaos`: 20 runs). Here one
fixed plan, a sync run, loses an inference worker's process by SIGKILL (bus re-form, request
re-issue), then an env pool's process exiting on SIGTERM (a pool restart). The harness's other
fixed plans are the frozen-actor runs (tests/e2e/test_frozen_actors.py: every role, the learner's
restart from a checkpoint and the async buffer's rebuild among them); the learner's death by
SIGKILL is tests/e2e/test_fault_tolerance.py's, ``ray.kill`` the fault tests' and the watchdog's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_script import load_chaos  # tests/chaos_script.py

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 10


def test_a_run_finishes_with_consistent_accounting_when_actors_are_killed(tmp_path, tiny_model_path):
    chaos = load_chaos()
    # two losses: a step takes ~0.5 s here, so each kill comes early enough that the run is still
    # going (a kill planned after line 8 + 0.8 s could find it finished)
    kills = [chaos.Kill("inference-0", 2, 0.6, "SIGKILL"), chaos.Kill("env-pool-0", 5, 0.2, "SIGTERM")]
    plan = chaos.Plan("chaos-inference-pool", "sync", kills, steps=STEPS)
    outcome = chaos.run_plan(plan, tmp_path, tiny_model_path, steps=STEPS, timeout_s=480)
    assert outcome.killed == ["inference-0", "env-pool-0"], outcome
    assert outcome.passed, outcome.problems
    assert outcome.restarts == {"restarts_inference": 1, "restarts_env_pool": 1, "learner_resumes": 0}
    rows = [json.loads(line) for line in (tmp_path / plan.name / "metrics.jsonl").read_text().splitlines()]
    # every prompt of every step trained once, none dropped
    assert rows[-1]["groups_trained"] == STEPS * 8 and rows[-1]["groups_put"] == STEPS * 8
    assert all(r["groups_dropped_stale"] == 0 and r["groups_in_buffer"] == 0 for r in rows)
    assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)
