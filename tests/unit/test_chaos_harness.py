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


def test_plans_lose_a_node_every_fifth_run_and_two_actors_at_once_by_turns(chaos):
    plans = chaos.make_plans(20, seed=0, steps=10)
    nodes = [p for p in plans if p.rejoin_s is not None]
    assert [p.name for p in nodes] == [f"chaos-0-{i}" for i in (4, 9, 14, 19)]
    assert all([k.victim for k in p.kills] == [chaos.NODE] and 5.0 <= p.rejoin_s <= 30.0 for p in nodes)
    pairs = [p for p in plans if len(p.kills) == 2]
    together = [p for p in pairs if p.kills[0].with_next]
    assert together and len(together) < len(pairs)  # both kinds of pairs
    assert all(p.kills[0].after_line == p.kills[1].after_line for p in together)
    node_overrides = chaos.overrides(nodes[0], chaos.REPO / "models" / "tiny-model", 10)
    assert "rollout.num_inference_workers=2" in node_overrides and "rollout.num_env_pools=2" in node_overrides
    assert all("resources" not in o for o in chaos.overrides(plans[0], chaos.REPO, 10))


def test_a_node_counts_as_replaced_once_both_of_its_actors_serve(chaos):
    killed_at = datetime.datetime(2026, 11, 28, 5, 0, 0).timestamp()

    def line(seconds, text):
        when = datetime.datetime(2026, 11, 28, 5, 0, 0) + datetime.timedelta(seconds=seconds)
        return when.strftime("%Y-%m-%d %H:%M:%S,") + f"{when.microsecond // 1000:03d} rlpost WARNING {text}"

    log = "\n".join([
        line(4.0, "inference-1 died and the cluster has no room for it"),
        line(20.0, "inference-1 replaced: serving again 16.0 s after its loss was noticed"),
        line(26.5, "env-pool-1 replaced: serving again 22.0 s after its loss was noticed"),
    ])  # fmt: skip
    assert chaos.replacement_times(log, [(chaos.NODE, killed_at)]) == [(chaos.NODE, 26.5)]
    assert chaos.replacement_times(log.rsplit("\n", 1)[0], [(chaos.NODE, killed_at)]) == [(chaos.NODE, None)]


def test_a_node_actor_still_waiting_for_room_at_the_end_counts_as_handled(chaos):
    """A node's worker or pool with no room left the fleet and the run ended before room came
    back: its slot is vacant on the last line, which is the loss handled; a loss neither
    restarted nor vacant is reported."""
    served = {"restarts_inference": 1, "restarts_env_pool": 1, "inference_workers_vacant": 0, "env_pools_vacant": 0}
    away = {"restarts_inference": 0, "restarts_env_pool": 0, "inference_workers_vacant": 1, "env_pools_vacant": 1}
    assert chaos.unrecovered([chaos.NODE], [], [served], False) == []
    assert chaos.unrecovered([chaos.NODE], [], [away], False) == []
    lost = {**away, "env_pools_vacant": 0}
    assert chaos.unrecovered([chaos.NODE], [], [lost], False) == ["node was lost but restarts_env_pool is 0"]
    assert chaos.unrecovered(["env-pool-0"], [], [away], False) == ["env-pool-0 was lost but restarts_env_pool is 0"]
    assert chaos.unrecovered(["env-pool-0"], ["env-pool-0"], [away], False) == []  # killed during the last step


def test_node_runs_get_the_steps_of_async_runs(chaos):
    plans = chaos.make_plans(20, seed=0, steps=10)
    assert all(p.steps == 10 * chaos.ASYNC_PACE for p in plans if p.rejoin_s is not None or p.mode == "async")
    assert all(p.steps == 10 for p in plans if p.rejoin_s is None and p.mode == "sync")
