"""The chaos harness, short: real `rlpost train` runs of the tiny job that lose actors.

scripts/chaos.py ends actors at random moments in random ways (`make chaos`: 20 runs). Here
one fixed plan covers the roles whose loss costs the most state: in a sync run an inference
worker's process killed by SIGKILL (bus re-form, request re-issue), then the learner killed by
SIGKILL (auto-resume from a checkpoint), then an env pool's process exiting on SIGTERM (a pool
restart); ``ray.kill`` is the e2e fault tests' and the watchdog's, whose frozen-actor runs
(tests/e2e/test_frozen_actors.py) also lose the buffer of an async run (rebuilt from the ledger and
the pools' outboxes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_script import load_chaos  # tests/chaos_script.py

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 10  # the three-loss run's


def test_runs_finish_with_consistent_accounting_when_actors_are_killed(tmp_path, tiny_model_path):
    chaos = load_chaos()
    plans = [
        # one run, three losses: resumed steps take ~0.5 s here, so each kill comes early enough
        # that the run is still going (a kill planned after line 8 + 0.8 s could find it finished)
        chaos.Plan(
            "chaos-inference-learner-pool",
            "sync",
            [
                chaos.Kill("inference-0", 2, 0.6, "SIGKILL"),
                chaos.Kill("learner", 4, 0.2, "SIGKILL"),
                chaos.Kill("env-pool-0", 6, 0.2, "SIGTERM"),
            ],
            steps=STEPS,
        ),
    ]
    for plan in plans:
        outcome = chaos.run_plan(plan, tmp_path, tiny_model_path, steps=8, timeout_s=480)
        steps = plan.steps or 8
        assert outcome.killed == [k.victim for k in plan.kills], outcome
        assert outcome.passed, (plan.name, outcome.problems)
        rows = [json.loads(line) for line in (tmp_path / plan.name / "metrics.jsonl").read_text().splitlines()]
        if plan.mode == "sync":  # every prompt of every step trained once, none dropped
            assert rows[-1]["groups_trained"] == steps * 8 and rows[-1]["groups_put"] == steps * 8
            assert all(r["groups_dropped_stale"] == 0 and r["groups_in_buffer"] == 0 for r in rows)
        assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)
