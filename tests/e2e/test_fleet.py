"""A fleet without a training loop: ``Fleet.start(cfg)`` places and starts every actor of the tiny
job on the tier's shared cluster, its clients serve (the engine and the learner score alike, an
env pool collects into the buffer, the buffer hands the groups out), its own methods mend and
grow it with no supervisor (a vacant slot's pool started, a new buffer, the bus's next
generation), and ``fleet.stop()`` ends every actor and placement group."""

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_fleet_starts_serves_and_stops_without_a_training_loop(tiny_model_path, connect_driver):
    from rlpost.config import load_config
    from rlpost.runtime.actors import actor_state
    from rlpost.service.fleet import Fleet
    from rlpost.service.loop import probe_sequence

    ray = connect_driver("rlpost-e2e-fleet")
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [f"model.name_or_path={tiny_model_path}", "logging.run_name=e2e-fleet", "trainer.prompts_per_step=2",
         "rollout.num_env_pools=1..2"],
    )  # fmt: skip
    fleet = Fleet.start(cfg)
    handles = fleet.named_handles()
    try:
        assert [name for name, _ in handles] == ["inference-0", "env-pool-0", "learner", "buffer", "control"]
        # what serves now: the range's second pool is a slot the cluster has room for, not started yet
        assert fleet.sizes() == {"inference_workers": 1, "inference_workers_vacant": 0, "inference_workers_target": 1,
                                 "env_pools": 1, "env_pools_vacant": 1, "env_pools_target": 2}  # fmt: skip
        assert fleet.wanted() == {"inference": 1, "env_pools": 2}

        probe = probe_sequence(cfg)
        served = fleet.inference[0].score([probe], cfg.rollout.temperature, timeout_s=120)[0]
        learned = fleet.learner.score([probe], timeout_s=120)[0]
        assert len(served) == len(learned) == len(probe)
        assert max(abs(a - b) for a, b in zip(served, learned)) < 1e-3  # one model on both sides of the bus

        pool = fleet.env_pools[0]
        pool.start(2)  # two groups, put through the pool's copy of the buffer's client
        taken = fleet.buffer.take(2, timeout_s=120)
        assert [g.producer for g in taken.groups] == ["env-pool-0", "env-pool-0"]
        assert all(len(g.samples) == cfg.data.group_size for g in taken.groups)
        assert pool.wait(60.0) is True  # its run ended with the two groups

        # what the supervisor would do, done by hand: a new buffer that knows what was taken,
        # the vacant slot's pool started, the bus's next generation with the weights published
        assert fleet.placed(fleet.pool_slots) == [1]
        acknowledged = {"env-pool-0": max(g.seq for g in taken.groups)}
        assert acknowledged == {"env-pool-0": 2}
        assert fleet.restart_buffer(acknowledged) == {"env-pool-0": 0}  # both groups were taken
        assert fleet.start_pool(1, collecting=False) == (None, False)  # a new slot: its shard's start
        assert [p.name for p in fleet.env_pools] == ["env-pool-0", "env-pool-1"]
        assert fleet.sizes()["env_pools"] == 2 and fleet.sizes()["env_pools_vacant"] == 0
        assert fleet.reform_bus() == 1
        assert fleet.publish()["policy_version"] == 0
        fleet.env_pools[1].start(1)
        assert [g.producer for g in fleet.buffer.take(1, timeout_s=120).groups] == ["env-pool-1"]
        handles = fleet.named_handles()
    finally:
        fleet.stop()
    assert {name: actor_state(handle) for name, handle in handles} == {name: "DEAD" for name, _ in handles}
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
