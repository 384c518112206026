"""The load policy's decisions on signal traces (rlpost.service.autoscale).

Each trace is a list of metrics.jsonl-like rows, read the way the supervisor reads a live run
(``step_load``), on a clock the test steps: ten seconds a step unless a row says otherwise.
"""

from __future__ import annotations

import pytest

from rlpost.config.rollout import AutoscaleConfig, RolloutConfig
from rlpost.service.autoscale import LoadPolicy, StepLoad, _predicted_wait, step_load

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**overrides) -> AutoscaleConfig:
    # one actor a grow unless a test says otherwise (the proportional grow has its own tests)
    fixed = {"enabled": True, "cooldown_s": 20.0, "hold_s": 300.0, "room_wait_s": 120.0, "grow_wait": 0.5,
             "shrink_wait": 0.1, "max_grow_factor": 1.0}  # fmt: skip
    return AutoscaleConfig(**{**fixed, **overrides})


class Run:
    """A policy fed one row a step; the fleet's wanted counts take each decision, its serving
    counts follow at once (unless told)."""

    def __init__(self, ranges=None, targets=None, async_mode=False, **overrides):
        self.clock = Clock()
        ranges = ranges or {"inference": (1, 4), "env_pools": (1, 2)}
        targets = targets or {role: low for role, (low, _) in ranges.items()}
        self.policy = LoadPolicy(settings(**overrides), ranges, clock=self.clock)
        self.wanted, self.serving = dict(targets), dict(targets)
        self.async_mode = async_mode
        self.totals = {"groups_put": 0, "groups_trained": 0, "groups_dropped_stale": 0}
        self.previous: dict | None = None
        self.decisions = []

    def step(self, wait: float, busy: float | None = 0.9, put: int = 8, stale: int = 0, fill: float = 0.0,
             step_s: float = 10.0, follow: bool = True, waiting: dict | None = None):  # fmt: skip
        self.clock.now += step_s
        self.totals["groups_put"] += put
        self.totals["groups_trained"] += 8
        self.totals["groups_dropped_stale"] += stale
        row = {"step_time_s": step_s, "collect_s": wait * step_s, "inference_workers": self.serving["inference"],
               "env_pools": self.serving.get("env_pools", 1), "autoscale_engine_busy": busy, "buffer_fill": fill,
               **self.totals}  # fmt: skip
        load = step_load(row, self.previous, self.async_mode)
        self.previous = row
        decision = self.policy.observe(load, self.wanted, waiting)
        if decision is not None:
            self.decisions.append(decision)
            self.wanted[decision.role] = decision.after
            if follow:
                self.serving[decision.role] = decision.after
        return decision


def test_a_generation_heavy_run_grows_its_engines_while_each_pays_and_undoes_the_one_that_did_not():
    run = Run()  # one actor at a time
    moves = []
    for _ in range(60):
        # 8 groups a step; generation scales with the workers up to 3 (the 4th adds nothing), the learner 2 s
        collect = 8 / min(run.serving["inference"], 3)
        decision = run.step(wait=collect / (collect + 2), step_s=collect + 2)
        if decision:
            moves.append((decision.before, decision.after, decision.reason))
    assert moves == [(1, 2, "engines_bound"), (2, 3, "engines_bound"), (3, 4, "engines_bound"), (4, 3, "no_gain")]
    assert run.wanted == {"inference": 3, "env_pools": 1}


def test_a_grow_asks_for_the_count_the_wait_predicts_within_its_factor_and_keeps_what_the_rise_is_worth():
    """Proportional grows (the default max_grow_factor, 4) on a range to 8, the learner 1.5 s a
    step. Generation scales up to 3 workers: 1 -> 4 is worth 2 workers and pays (2.5 needed), the
    next grow adds at most those 2 (4 -> 6), adds nothing and is undone whole. Up to 5 workers:
    1 -> 4 is worth 3, 4 -> 7 is worth 1 of the 1.5 it must be (min_gain 0.5 of 3) and keeps 1."""
    moves = []

    def practise(useful: int) -> Run:
        run = Run(ranges={"inference": (1, 8)}, max_grow_factor=AutoscaleConfig().max_grow_factor)
        for _ in range(60):
            collect = 8 / min(run.serving["inference"], useful)
            decision = run.step(wait=collect / (collect + 1.5), step_s=collect + 1.5)
            if decision:
                moves.append((decision.before, decision.after, decision.reason))
        return run

    run = practise(useful=3)
    assert moves == [(1, 4, "engines_bound"), (4, 6, "engines_bound"), (6, 4, "no_gain")]
    assert run.wanted["inference"] == 4  # held there: one too many, the price of moving in big steps
    moves.clear()
    run = practise(useful=5)
    assert moves == [(1, 4, "engines_bound"), (4, 7, "engines_bound"), (7, 5, "no_gain")]
    assert "from 4.00 to 5.00 groups/s with 7 inference workers (needed 5.50)" in run.decisions[-1].why
    # a learner a little over the band: the predicted count, not the cap (wait 0.55, target 0.3:
    # 2 x 0.55 x 0.7 / (0.3 x 0.45) = 5.7 -> 6 of the range's 8)
    run = Run(ranges={"inference": (2, 8)}, max_grow_factor=4.0)
    assert [run.step(wait=0.55) for _ in range(3)][-1].after == 6
    run = Run(ranges={"inference": (2, 8)}, max_grow_factor=4.0, grow_wait=0.3, shrink_wait=0.25)
    assert [run.step(wait=0.31) for _ in range(3)][-1].after == 3  # just over grow_wait: one more
    # the range's top and a hold bound it as they bound a grow of one
    run = Run(ranges={"inference": (1, 3)}, max_grow_factor=2.0)
    assert [run.step(wait=0.9) for _ in range(3)][-1].after == 2
    run.clock.now += 100
    assert [run.step(wait=0.9, put=16) for _ in range(4)][-1].after == 3  # (the step it joined in not read)


def test_no_change_within_the_cooldown_nor_before_a_full_window():
    run = Run(cooldown_s=100.0)
    assert [run.step(wait=0.9) for _ in range(2)] == [None, None]  # the window holds 3 steps
    first = run.step(wait=0.9)
    assert first is not None and first.after == 2
    # 9 steps of 10 s: the window is full again after 3, but the cooldown (100 s) has not passed
    assert [run.step(wait=0.9, put=16) for _ in range(9)] == [None] * 9
    assert run.step(wait=0.9, put=16) is not None


def test_the_window_restarts_while_the_fleet_is_not_what_was_asked():
    run = Run()
    for _ in range(3):
        decision = run.step(wait=0.9, follow=False)  # the new worker is not serving yet
    assert decision.after == 2
    for _ in range(5):  # its slot waits for room (within room_wait_s): nothing is decided meanwhile
        assert run.step(wait=0.9, waiting={"inference": 50.0}) is None
    run.serving["inference"] = 2
    run.clock.now += 100
    # the step it joined in is not read (its engine warmed up in it); then a window of 3
    assert [run.step(wait=0.9, put=16) for _ in range(3)] == [None, None, None]
    assert run.step(wait=0.9, put=16).after == 3


def test_idle_engines_and_a_starving_learner_grow_the_env_pools():
    run = Run()
    decision = [run.step(wait=0.8, busy=0.3) for _ in range(3)][-1]
    assert (decision.role, decision.after, decision.reason) == ("env_pools", 2, "env_bound")
    assert "engines busy 30%" in decision.why
    run.clock.now += 100
    # at the env pools' top (2) with engines still idle: nothing more to do (engines would not help)
    assert [run.step(wait=0.8, busy=0.3, put=16) for _ in range(6)] == [None] * 6


def test_a_grow_that_does_not_pay_is_undone_and_held():
    run = Run()
    for _ in range(3):
        run.step(wait=0.9)
    assert run.serving["inference"] == 2
    run.clock.now += 100
    decisions = [run.step(wait=0.9, put=8) for _ in range(4)]  # the same throughput with 2 workers
    undo = decisions[-1]
    assert (undo.role, undo.before, undo.after, undo.reason) == ("inference", 2, 1, "no_gain")
    assert "from 0.89 to 0.89 groups/s with 2 inference workers (needed 1.33)" in undo.why
    # held at one worker for hold_s (300 s) although the learner still waits
    run.clock.now += 100
    assert [run.step(wait=0.9) for _ in range(10)] == [None] * 10
    run.clock.now += 200
    assert run.step(wait=0.9).after == 2  # tried again once the hold ends (the window was full)


def test_a_grow_without_room_in_the_cluster_is_given_up():
    run = Run()
    for _ in range(3):
        run.step(wait=0.9, follow=False)
    assert run.step(wait=0.9, waiting={"inference": 60.0}) is None
    undo = run.step(wait=0.9, waiting={"inference": 121.0})
    assert (undo.before, undo.after, undo.reason) == (2, 1, "no_room")
    run.clock.now += 100
    assert [run.step(wait=0.9) for _ in range(6)] == [None] * 6  # held while hold_s runs


def test_an_async_learner_bound_run_shrinks_engines_then_pools_to_their_minimum():
    run = Run(targets={"inference": 3, "env_pools": 2}, async_mode=True)
    moves = []
    for _ in range(30):
        decision = run.step(wait=0.02, stale=3, fill=1.0)
        if decision:
            moves.append((decision.role, decision.after, decision.reason))
            run.clock.now += 30
    assert moves == [("inference", 2, "learner_bound"), ("inference", 1, "learner_bound"),
                     ("env_pools", 1, "learner_bound")]  # fmt: skip
    assert "38% of the groups trained dropped as stale" in run.decisions[0].why


def test_an_async_run_that_keeps_up_exactly_is_left_alone():
    run = Run(targets={"inference": 2, "env_pools": 1}, async_mode=True)
    # the learner barely waits, but nothing goes stale and the buffer is not full: no surplus
    assert [run.step(wait=0.05, stale=0, fill=0.5) for _ in range(12)] == [None] * 12


def test_a_sync_shrink_that_would_grow_back_is_skipped():
    assert _predicted_wait(0.2, 2) == pytest.approx(0.4 / 1.2)
    run = Run(targets={"inference": 2, "env_pools": 1}, shrink_wait=0.1, grow_wait=0.15)
    assert [run.step(wait=0.09) for _ in range(6)] == [None] * 6  # predicted 16.5% >= 15%
    run = Run(targets={"inference": 2, "env_pools": 1}, shrink_wait=0.1, grow_wait=0.5)
    assert [run.step(wait=0.09) for _ in range(3)][-1].after == 1


def test_a_pinned_role_is_left_alone_until_released():
    run = Run()
    run.policy.pin("inference")  # an operator asked for 3
    run.wanted["inference"] = run.serving["inference"] = 3
    assert [run.step(wait=0.9) for _ in range(6)] == [None] * 6
    run.policy.release("inference")
    run.clock.now += 100
    assert [run.step(wait=0.9) for _ in range(3)][-1].after == 4


def test_a_reversed_move_holds_the_new_count():
    run = Run(targets={"inference": 2, "env_pools": 1})
    assert [run.step(wait=0.05) for _ in range(3)][-1].after == 1  # learner bound: shrink
    run.clock.now += 100
    grown = [run.step(wait=0.9) for _ in range(4)][-1]  # now it starves: grow back
    assert grown.after == 2
    run.clock.now += 100
    assert [run.step(wait=0.05, put=16) for _ in range(6)] == [None] * 6  # held at 2 for hold_s


def test_a_grow_is_not_judged_by_its_gain_once_the_learner_no_longer_starves():
    run = Run(targets={"inference": 1, "env_pools": 1})
    assert [run.step(wait=0.9) for _ in range(3)][-1].after == 2
    run.clock.now += 100
    # the learner became the bottleneck: generation's throughput is the same, but it is the
    # learner-bound rule that shrinks, not the grow's lack of gain
    decision = [run.step(wait=0.05, put=8) for _ in range(4)][-1]
    assert (decision.after, decision.reason) == (1, "learner_bound")


def test_step_load_reads_a_metrics_row():
    row = {"step_time_s": 4.0, "collect_s": 3.0, "inference_workers": 2, "env_pools": 1, "groups_put": 20,
           "groups_trained": 16, "groups_dropped_stale": 2, "buffer_fill": 0.75, "autoscale_engine_busy": 0.5}  # fmt: skip
    previous = {"groups_put": 12, "groups_trained": 8, "groups_dropped_stale": 0}
    sync = step_load(row, previous, async_mode=False)
    assert sync == StepLoad(wait_share=0.75, generated=8, generating_s=3.0, inference=2, env_pools=1,
                            engine_busy=0.5, stale_share=0.25, buffer_fill=None)  # fmt: skip
    assert step_load(row, previous, async_mode=True).generating_s == 4.0
    assert step_load(row, None, async_mode=True).buffer_fill == 0.75


def test_the_config_needs_a_range_and_a_band():
    with pytest.raises(ValueError, match="needs a range to move in"):
        RolloutConfig(num_inference_workers=2, autoscale={"enabled": True})
    with pytest.raises(ValueError, match="must be below grow_wait"):
        AutoscaleConfig(grow_wait=0.2, shrink_wait=0.3)
    cfg = RolloutConfig(num_inference_workers="1..4", num_env_pools=2, autoscale={"enabled": True})
    assert cfg.autoscale_ranges() == {"inference": (1, 4)}
    assert cfg.inference_worker_target() == 1 and cfg.env_pool_target() == 2  # starts at the minimum
    assert RolloutConfig(num_inference_workers="1..4").inference_worker_target() == 4  # off: the top


def test_a_recorded_run_replays_to_the_decisions_it_made():
    """tests/data/autoscale_trace_env_bound.jsonl: the metrics of a real run (bench_autoscale's
    policy case with min_gain 0.25: sync, env pools 1..4, a reward behind a 20 ms round trip), read
    on the run's own clock (its elapsed_s): the policy decides what the run decided, at the same
    steps: three env-bound grows as each new pool joined, then the fourth pool undone for too
    little gain."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "data" / "autoscale_trace_env_bound.jsonl")
            .read_text().splitlines()]  # fmt: skip
    clock = Clock()
    # recorded before grows were proportional: one actor at a time
    settings_ = AutoscaleConfig(enabled=True, window_steps=2, cooldown_s=10, min_gain=0.25, max_grow_factor=1.0)
    policy = LoadPolicy(settings_, {"env_pools": (1, 4)}, clock=clock)
    wanted, replayed, previous = {"inference": 1, "env_pools": 1}, [], None
    for row in rows:
        clock.now = row["elapsed_s"]
        decision = policy.observe(step_load(row, previous, async_mode=False), wanted)
        previous = row
        if decision is not None:
            wanted[decision.role] = decision.after
            replayed.append((row["step"], decision.reason, decision.after))
    recorded = [(r["step"], r["autoscale_reason"], r["env_pools_target"]) for r in rows if r.get("autoscale_reason")]
    assert replayed == recorded == [(2, "env_bound", 2), (7, "env_bound", 3), (13, "env_bound", 4), (21, "no_gain", 3)]
