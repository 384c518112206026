"""scripts/chaos.py's pure parts: the plans it draws and the replacement times it reads from a run's log."""

from __future__ import annotations

import datetime

import pytest
from chaos_script import load_chaos  # tests/chaos_script.py

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def chaos():
    return load_chaos()


def test_plans_draw_every_way_of_ending_an_actor(chaos):
    plans = chaos.make_plans(20, seed=0, steps=10)
    ways = {kill.way for plan in plans for kill in plan.kills}
    assert ways == set(chaos.WAYS)
    assert [p.name for p in chaos.make_plans(20, seed=0, steps=10)] == [p.name for p in plans]  # reproducible
    assert plans == chaos.make_plans(20, seed=0, steps=10)


def test_replacement_times_come_from_the_runs_log(chaos):
    def stamp(seconds: float) -> str:
        when = datetime.datetime(2026, 11, 28, 5, 0, 0) + datetime.timedelta(seconds=seconds)
        return when.strftime("%Y-%m-%d %H:%M:%S,") + f"{when.microsecond // 1000:03d}"

    killed_at = datetime.datetime(2026, 11, 28, 5, 0, 0).timestamp()
    log = "\n".join(
        [
            f"{stamp(1.0)} rlpost WARNING inference-0 died; starting it again",
            f"{stamp(9.5)} rlpost WARNING inference-0 replaced: serving again 8.4 s after its loss was noticed",
            f"{stamp(30.25)} rlpost INFO resumed from runs/x/checkpoints/step_2: step 2, policy version 2",
            "a line of Ray's own",
        ]
    )
    times = chaos.replacement_times(log, [("inference-0", killed_at), ("learner", killed_at + 10), ("buffer", 0.0)])
    assert times == [("inference-0", 9.5), ("learner", 20.25), ("buffer", None)]
