"""LLMCollector.as_remote: the collector in a Ray actor, built from an env constructor and a
policy factory (what TorchRL's Ray collector does), on a real local Ray cluster."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_remote_collector_yields_batches_and_versions(ray_cluster):
    import ray

    from rlpost.collect import LLMCollector

    # defined here so that Ray ships them by value (the actor cannot import this test module)
    def make_env():
        from rlpost.envs import DatasetChatEnv

        return DatasetChatEnv(dataset=[{"query": f"q{i}"} for i in range(20)], shuffle=False, num_envs=2, max_steps=1)

    class Scripted:
        """Answers every row with "ok" (built inside the actor by the policy factory)."""

        def __call__(self, td):
            from rlpost.data import History

            n = td.batch_size[0]
            reply = History(role=["assistant"] * n, content=["ok"] * n, batch_size=(n,)).unsqueeze(-1)
            td["history"].full = td["history"].prompt.extend(reply, dim=-1, inplace=False)
            return td

    remote = LLMCollector.as_remote(num_cpus=0).remote(make_env, policy_factory=Scripted, dialog_turns_per_batch=4,
                                                       track_policy_version=True)  # fmt: skip
    assert ray.get(remote.is_initialized.remote(), timeout=120)
    first = ray.get(remote.next.remote(), timeout=120)
    second = ray.get(remote.next.remote(), timeout=120)
    assert first.batch_size == (2, 2) and second.batch_size == (2, 2)
    assert [first[0, t]["query"] for t in range(2)] == ["q0", "q2"]
    assert [second[0, t]["query"] for t in range(2)] == ["q4", "q6"]  # the actor keeps its position
    ray.get(remote.increment_version.remote(), timeout=60)
    assert ray.get(remote.get_policy_version.remote(), timeout=60) == 1
    ray.kill(remote)
