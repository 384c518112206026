"""Frozen and hung actors in whole runs (`rlpost train` of the tiny job, real actors throughout).

Each role's process is stopped with SIGSTOP mid-run, one after the other: alive in Ray's record,
answering nothing, as a stuck collective, a deadlock holding the GIL or a frozen node leaves it.
The run's watchdog finds each (no heartbeat within ``watchdog.<role>.answer_s``), kills it, and
the supervisor replaces it as it replaces the dead: the run finishes every step with consistent
accounting (the roles in the async run; the mailbox in the sync run too). A learner whose working
thread blocks for ever inside its step (a custom loss that never returns: it still answers
heartbeats) is killed as hung once its work shows no progress for ``watchdog.learner.progress_s``,
and the sync run resumes from its last checkpoint; a frozen learner rank:
tests/e2e/test_learner_group_runs.py. The harness is scripts/chaos.py's (`make chaos` draws
SIGSTOP among its ways, in both modes).
"""

from __future__ import annotations

import json
import re

import pytest
from chaos_script import load_chaos  # tests/chaos_script.py

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]

DEADLINE = ["watchdog.interval_s=1"] + [
    f"watchdog.{role}.answer_s=4" for role in ("inference", "env_pool", "learner", "reference", "reward", "buffer",
                                               "control")
]  # fmt: skip


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check(outcome, run_dir, log_text, victims):
    assert outcome.killed == victims, outcome
    assert outcome.passed, outcome.problems
    for victim in victims:
        assert re.search(rf"watchdog: {victim} is frozen: no answer to its heartbeat for \d+ s", log_text), victim
    assert all(seconds is not None for _, seconds in outcome.replaced_s), outcome.replaced_s
    rows = rows_of(run_dir)
    assert rows[-1]["watchdog_kills"] >= len([v for v in victims if v != "learner"])
    assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows if r.get("sync_logprob_diff") is not None)
    return rows


def test_a_frozen_mailbox_and_a_hung_learner_in_a_sync_run_are_replaced(tmp_path, tiny_model_path, monkeypatch):
    """The run's mailbox stopped (the async run below stops every other role, one after the
    other), then the learner's step blocked for ever in its loss (one micro-batch a step: the 8th
    call is step 8's): killed as hung, the run resumes from step 6."""
    chaos = load_chaos()
    flag = tmp_path / "blocked"
    monkeypatch.setenv("RLPOST_BLOCKING_LOSS_FLAG", str(flag))
    monkeypatch.setenv("RLPOST_BLOCKING_LOSS_AT", "8")
    victims = ["control"]
    overrides = [*DEADLINE, "watchdog.learner.progress_s=6", "loss.custom_fn=tests.blocking_loss:loss_that_blocks_once"]
    plan = chaos.Plan("frozen-sync", "sync", [chaos.Kill(v, 1 + 3 * i, 0.3, "SIGSTOP") for i, v in enumerate(victims)],
                      steps=12, overrides=overrides, resumes=1)  # fmt: skip
    outcome = chaos.run_plan(plan, tmp_path, tiny_model_path, steps=12, timeout_s=900)
    log_text = (tmp_path / "frozen-sync.log").read_text()
    rows = check(outcome, tmp_path / plan.name, log_text, victims)
    # every prompt of every step trained once (the hung learner's restart repeats the steps since its checkpoint)
    assert rows[-1]["groups_trained"] == 12 * 8 and rows[-1]["groups_put"] == 12 * 8
    assert all(r["groups_dropped_stale"] == 0 for r in rows)
    assert "the run's control mailbox failed (was killed by the watchdog (frozen" in log_text
    assert flag.read_text().startswith("blocked in process")
    assert re.search(r"watchdog: learner is hung: its work \(train_step\) made no progress for \d+ s", log_text)
    assert "the watchdog killed it" in log_text and "auto_resume: restarting the run" in log_text
    assert rows[-1]["learner_resumes"] == 1 and re.search(r"resumed from \S*step_6: step 6,", log_text)


def test_each_role_frozen_in_an_async_run_is_replaced(tmp_path, tiny_model_path):
    """The roles whose replacement async mode changes, stopped one after the other while the pools
    collect on their own, the mailbox last (its freeze does not slow the run, so that a stop after
    it would find the run ended). A frozen learner ends in the resume the sync run above tests (as
    a hung one), and the reward actor is replaced as the reference is (a new stateless actor, its
    callers waiting; tests/e2e/test_task_runs.py kills it): neither is frozen here, which saves a
    whole run's restart."""
    chaos = load_chaos()
    victims = ["inference-0", "env-pool-0", "reference", "buffer", "control"]
    pace = chaos.ASYNC_PACE
    steps = (2 + 2 * pace * len(victims)) + 3 * pace  # room after the last stop for the watchdog to find it
    plan = chaos.Plan("frozen-async", "async", [chaos.Kill(v, 2 + 2 * pace * i, 0.3, "SIGSTOP")
                                                for i, v in enumerate(victims)],
                      steps=steps, overrides=DEADLINE)  # fmt: skip
    outcome = chaos.run_plan(plan, tmp_path, tiny_model_path, steps=steps, timeout_s=900)
    log_text = (tmp_path / "frozen-async.log").read_text()
    check(outcome, tmp_path / plan.name, log_text, victims)
    assert "the run's control mailbox failed (was killed by the watchdog (frozen" in log_text
