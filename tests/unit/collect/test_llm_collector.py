"""LLMCollector's loop with a scripted policy (pure logic; the real wrappers are in the compat tier)."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from rlpost.collect import LLMCollector
from rlpost.data import History
from rlpost.envs import AsyncEnvPool, DatasetChatEnv, Transform

pytestmark = pytest.mark.unit

ROWS = [{"query": f"q{i}"} for i in range(50)]


class Scripted:
    """Answers every row with "ok"; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, td):
        self.calls += 1
        n = td.batch_size[0]
        reply = History(role=["assistant"] * n, content=["ok"] * n, batch_size=(n,)).unsqueeze(-1)
        td["history"].full = td["history"].prompt.extend(reply, dim=-1, inplace=False)
        return td


class Buffer:
    def __init__(self):
        self.batches = []

    def extend(self, batch):
        self.batches.append(batch)


def env(num_envs=2, max_steps=2):
    return DatasetChatEnv(dataset=ROWS, shuffle=False, num_envs=num_envs, max_steps=max_steps)


def test_batches_of_dialog_turns_with_traj_ids():
    collector = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=6, total_dialog_turns=12)
    batches = list(collector)
    assert len(batches) == 2 and all(b.batch_size == (2, 3) for b in batches)
    first = batches[0]
    # two steps per episode: trajectories 0/1 (rows 0/1), then 2/3 after the resets
    assert first["collector", "traj_ids"].tolist() == [[0, 0, 2], [1, 1, 3]]
    assert first["next", "done"].squeeze(-1).tolist() == [[False, True, False], [False, True, False]]
    assert [first[0, t]["query"] for t in range(3)] == ["q0", "q0", "q2"]
    assert collector.total_dialog_turns == 12 and collector.dialog_turns_per_batch == 6


def test_completed_trajectories_and_last_steps():
    collector = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, yield_completed_trajectories=True,
                             total_dialog_turns=4)  # fmt: skip
    trajectories = list(collector)
    assert [t.batch_size for t in trajectories] == [torch.Size([2])] * 2
    assert trajectories[0]["next", "done"].squeeze(-1).tolist() == [False, True]
    last = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, yield_only_last_steps=True,
                        total_dialog_turns=2)  # fmt: skip
    steps = list(last)
    assert [s.batch_size for s in steps] == [torch.Size([1])] * 2 and all(s["next", "done"].all() for s in steps)


def test_replay_buffer_queue_flatten_and_postproc():
    buffer = Buffer()
    seen = []

    def postproc(batch):
        seen.append(batch.batch_size)
        return batch

    collector = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=4, total_dialog_turns=8,
                             replay_buffer=buffer, postproc=postproc)  # fmt: skip
    assert list(collector) == [None, None]
    assert [b.batch_size for b in buffer.batches] == [torch.Size([4])] * 2  # flattened with a buffer
    assert seen == [torch.Size([4])] * 2

    import queue

    q = queue.Queue()
    collector = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, total_dialog_turns=2, queue=q)
    list(collector)
    assert q.get_nowait().batch_size == (2,)
    with pytest.raises(RuntimeError, match="both a buffer and a queue"):
        LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, queue=q, replay_buffer=buffer)


def test_reset_at_each_iter_and_policy_factory():
    collector = LLMCollector(env(max_steps=5), policy_factory=Scripted, dialog_turns_per_batch=2, total_dialog_turns=4,
                             reset_at_each_iter=True)  # fmt: skip
    batches = list(collector)
    assert [b[0, 0]["query"] for b in batches] == ["q0", "q2"]  # each batch starts from a reset
    assert batches[1]["step_count"][0, 0].item() == 0


def test_policy_version_tracking_and_weight_updates():
    class Updater:
        def __init__(self):
            self.pushed = []

        def push_weights(self, weights):
            self.pushed.append(weights)

    collector = LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, total_dialog_turns=4,
                             track_policy_version=True, weight_updater=Updater)  # fmt: skip
    assert collector.policy_version == 0 and collector.get_policy_version() == 0
    batches = iter(collector)
    first = next(batches)
    collector.update_policy_weights_({"w": 1})
    second = next(batches)
    assert collector.weight_updater.pushed == [{"w": 1}] and collector.policy_version == 1
    assert first["next", "policy_version"].flatten().tolist() == [0, 0]
    assert second["next", "policy_version"].flatten().tolist() == [1, 1]  # the step served after the update
    assert LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2).policy_version is None


def test_bad_arguments():
    with pytest.raises(TypeError, match="exactly one of policy"):
        LLMCollector(env(), dialog_turns_per_batch=2)
    with pytest.raises(TypeError, match="yield_completed_trajectories=True"):
        LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, yield_only_last_steps=True,
                     yield_completed_trajectories=False)  # fmt: skip
    with pytest.raises(TypeError, match="flatten_data"):
        LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, yield_only_last_steps=True, flatten_data=True)
    with pytest.raises(RuntimeError, match="AsyncEnvPool instance"):
        LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2, async_envs=True)
    with pytest.raises(RuntimeError, match="weight_updater"):
        LLMCollector(env(), policy=Scripted(), dialog_turns_per_batch=2).update_policy_weights_()


def test_an_env_constructor_is_called():
    collector = LLMCollector(env, policy=Scripted(), dialog_turns_per_batch=2, total_dialog_turns=2)
    assert collector.is_initialized() and len(list(collector)) == 1
    td = collector.env.reset(TensorDict(batch_size=[2]))
    assert td["query"] == ["q2", "q3"]


# ---------------------------------------------------------------------------- AsyncEnvPool


class SlowReward(Transform):
    """Row-dependent step time: env 0 is slow, so the others finish first."""

    def __init__(self, delay_s):
        super().__init__()
        self.delay_s = delay_s

    def on_step(self, td, next_td):
        time.sleep(self.delay_s)
        return next_td


def pool(delays=(0.3, 0.0, 0.0), max_steps=1):
    def maker(i):
        rows = [{"query": f"env{i}-q{j}"} for j in range(10)]
        return lambda: DatasetChatEnv(dataset=rows, shuffle=False, num_envs=1, max_steps=max_steps).append_transform(
            SlowReward(delays[i])
        )

    return AsyncEnvPool([maker(i) for i in range(len(delays))])


def test_async_pool_returns_rows_as_they_finish():
    envs = pool()
    td = envs.reset()
    assert td.batch_size == (3,) and td["env_index"].tolist() == [0, 1, 2]
    envs.async_step_and_maybe_reset_send(Scripted()(td))
    step, next_root = envs.async_step_and_maybe_reset_recv(min_get=1)
    assert 0 not in step["env_index"].tolist()  # the slow env is not back yet
    rest, _ = envs.async_step_and_maybe_reset_recv(min_get=3)
    assert sorted(step["env_index"].tolist() + rest["env_index"].tolist()) == [0, 1, 2]
    assert next_root[0]["query"].startswith(f"env{step[0]['env_index'].item()}-q1")  # done rows were reset
    with pytest.raises(RuntimeError, match="no step is running"):
        envs.async_step_and_maybe_reset_recv()
    envs.close()


def test_async_collector_yields_trajectories_as_they_complete():
    envs = pool(delays=(0.3, 0.0, 0.0), max_steps=2)
    collector = LLMCollector(envs, policy=Scripted(), dialog_turns_per_batch=2, yield_completed_trajectories=True,
                             total_dialog_turns=12)  # fmt: skip
    assert collector.async_envs
    trajectories = list(collector)
    assert all(t.batch_size == (2,) for t in trajectories) and len(trajectories) == 6
    first_envs = [t[0]["env_index"].item() for t in trajectories[:2]]
    assert 0 not in first_envs  # the fast envs finish their episodes first
    assert all(len(set(t["env_index"].tolist())) == 1 for t in trajectories)  # one env per trajectory
    with pytest.raises(RuntimeError, match="policy version tracking"):
        LLMCollector(pool(), policy=Scripted(), dialog_turns_per_batch=2, track_policy_version=True)
    envs.close()
