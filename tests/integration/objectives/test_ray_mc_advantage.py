"""RayMCAdvantage on a real local Ray cluster: TorchRL's test_ray_mc_advantage, groups completed by
copies in other processes, a named actor reused and owned by its creator, bounded calls."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import LazyStackStorage, ReplayBuffer
from rlpost.objectives import MCAdvantageSelector, RayMCAdvantage

pytestmark = pytest.mark.integration

HALF_SQRT2 = 2**-0.5  # the advantages of returns (0, 1): -/+ 1/sqrt(2), to within rlpost's eps


@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    """The integration tier's shared local Ray cluster (one start for the tier)."""
    return ray_cluster


def group_traj(group_id, rewards):
    n_steps = len(rewards)
    return TensorDict(
        {
            "group_id": torch.full((n_steps,), group_id),
            ("next", "reward"): torch.tensor(rewards).reshape(n_steps, 1),
            ("next", "done"): torch.tensor([False] * (n_steps - 1) + [True]).reshape(n_steps, 1),
        },
        batch_size=[n_steps],
    )


def test_torchrl_ray_mc_advantage(ray_session):
    """TorchRL's test_ray_mc_advantage, with the advantages' values, then as a buffer's transform."""
    adv_t = RayMCAdvantage(
        grpo_size=2,
        prompt_key="group_id",
        trajectory_return="sum",
        ray_init_config={"ignore_reinit_error": True, "include_dashboard": False, "num_cpus": 1},
        remote_config={"num_cpus": 0},
    )
    try:
        assert adv_t.is_shared and adv_t.share_memory_() is adv_t
        assert adv_t.inv(group_traj(0, [0.0])) is None
        out = adv_t.inv(group_traj(0, [1.0]))
        assert out["advantage"].flatten().tolist() == pytest.approx([-HALF_SQRT2, HALF_SQRT2], abs=2e-4)
        assert (adv_t.queued_groups, adv_t.completed_groups, adv_t.written_groups) == (0, 1, 1)
        adv_t.reset_stats()
        assert adv_t.completed_groups == 0
        assert adv_t.inv(group_traj(1, [0.0])) is None
        assert adv_t.queued_groups == 1 and [len(q) for q in adv_t.queues.values()] == [1]
        adv_t.queues.clear()
        assert adv_t.queued_groups == 0 and not adv_t.queues

        rb = ReplayBuffer(storage=LazyStackStorage(16), transform=adv_t, batch_size=2)
        rb.extend(group_traj(2, [1.0, 1.0]))
        assert len(rb) == 0
        rb.extend(group_traj(2, [0.0]))
        assert len(rb) == 3 and sorted(rb[:]["advantage"].flatten().tolist()) == pytest.approx(
            [-HALF_SQRT2, HALF_SQRT2, HALF_SQRT2], abs=2e-4
        )
        stats = adv_t.get_stats()
        assert (stats["completed_trajectories"], stats["written_groups"], stats["queued_groups"]) == (3, 1, 0)
        adv_t.written_groups = 7  # the counters are the actor's, both ways
        assert adv_t.written_groups == 7
    finally:
        adv_t.close()
    with pytest.raises(RuntimeError, match="inv after close"):
        adv_t.inv(group_traj(0, [0.0]))


@pytest.mark.long  # a Ray task per writer: ~9 s, more than make test's budget has room for
def test_copies_in_other_processes_complete_one_group(ray_session):
    ray = ray_session
    adv_t = RayMCAdvantage(
        grpo_size=3, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9),
        candidate_group_size=4,
    )  # fmt: skip

    @ray.remote(num_cpus=1)
    def write(transform, traj):
        out = transform.inv(traj)
        transform.close()  # a copy does not own the actor: this only lets go of it
        return out

    try:
        assert adv_t.inv(group_traj(0, [0.0])) is None
        assert ray.get(write.remote(adv_t, group_traj(0, [0.0])), timeout=120) is None
        assert adv_t.inv(group_traj(0, [0.0])) is None  # 3 candidates, no useful 3 of them yet
        out = ray.get(write.remote(adv_t, group_traj(0, [1.0])), timeout=120)
        # rescued: 3 of the 4 candidates, returns (0, 0, 1) in some order
        assert sorted(out["next", "reward"].flatten().tolist()) == [0.0, 0.0, 1.0]
        assert (adv_t.written_groups, adv_t.rescued_groups, adv_t.unselected_trajectories) == (1, 1, 1)
    finally:
        adv_t.close()


def test_a_named_actor_is_reused_and_owned_by_its_creator(ray_session):
    ray = ray_session
    creator = RayMCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", actor_name="mc-groups")
    try:
        assert creator.inv(group_traj(5, [0.0])) is None
        user = RayMCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", actor_name="mc-groups")
        out = user.inv(group_traj(5, [1.0]))
        assert out["advantage"].flatten().tolist() == pytest.approx([-HALF_SQRT2, HALF_SQRT2], abs=2e-4)
        user.close()  # not the creator: the actor lives on
        assert creator.written_groups == 1
        with pytest.raises(ValueError, match="'mc-groups' groups with .*'grpo_size': 2"):
            RayMCAdvantage(grpo_size=4, prompt_key="group_id", trajectory_return="sum", actor_name="mc-groups")
        assert "actor_name='mc-groups'" in repr(creator)
    finally:
        creator.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # killed: its name is released
        try:
            ray.get_actor("mc-groups")
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the creator's close() did not kill the named actor")


@pytest.mark.long  # waits out a bound: ~8 s, more than make test's budget has room for
def test_a_call_past_its_bound_raises_timeout_error_naming_it(ray_session):
    class Slow(MCAdvantageSelector):  # defined here: pickled by value to the actor
        def select(self, candidates, *, group_size, keep_return_bounds=None):
            time.sleep(3.0)
            return super().select(candidates, group_size=group_size, keep_return_bounds=keep_return_bounds)

    adv_t = RayMCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", candidate_selector=Slow())
    try:
        assert adv_t.inv(group_traj(0, [0.0])) is None  # one candidate: no selection, no wait
        with pytest.raises(TimeoutError, match="RayMCAdvantage: inv did not return within 0.5 s"):
            adv_t.call("inv", group_traj(0, [1.0]), timeout_s=0.5)
        assert adv_t.call("get_stats", timeout_s=30)["written_groups"] == 1  # it ran, past the bound
    finally:
        adv_t.close()
