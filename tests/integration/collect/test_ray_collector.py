"""LLMCollector.as_remote: the collector in a Ray actor, built from an env constructor and a
policy factory (what TorchRL's Ray collector does), on a real local Ray cluster."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _scripted_parts():
    """An env constructor and a policy answering "ok", defined locally so that Ray ships them by
    value (the actors cannot import this test module)."""

    def make_env():
        from rlpost.envs import DatasetChatEnv

        return DatasetChatEnv(dataset=[{"query": f"q{i}"} for i in range(40)], shuffle=False, num_envs=2, max_steps=1)

    class Scripted:
        def __call__(self, td):
            from rlpost.data import History

            n = td.batch_size[0]
            reply = History(role=["assistant"] * n, content=["ok"] * n, batch_size=(n,)).unsqueeze(-1)
            td["history"].full = td["history"].prompt.extend(reply, dim=-1, inplace=False)
            return td

    return make_env, Scripted


def test_remote_collector_yields_batches_and_versions(ray_cluster):
    import ray

    from rlpost.collect import LLMCollector

    make_env, Scripted = _scripted_parts()
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


def test_ray_collector_writes_to_a_ray_replay_buffer_in_lock_step_and_in_the_background(ray_cluster):
    """TorchRL's distributed pair: RayLLMCollector's actor writes into RayReplayBuffer's actor,
    iterated step by step, then collecting on its own thread (start / is_running / async_shutdown)."""
    import time
    from functools import partial

    import ray

    from rlpost.collect import RayLLMCollector
    from rlpost.data import LazyStackStorage, RayReplayBuffer, ReplayBuffer, SamplerWithoutReplacement

    make_env, Scripted = _scripted_parts()
    rb = RayReplayBuffer(storage=partial(LazyStackStorage, 100), sampler=SamplerWithoutReplacement, batch_size=4)
    assert isinstance(rb, ReplayBuffer) and rb.write_count == 0 and len(rb) == 0
    collector = RayLLMCollector(make_env, policy_factory=Scripted, dialog_turns_per_batch=4, replay_buffer=rb,
                                track_policy_version=True, total_dialog_turns=8, timeout_s=120)  # fmt: skip
    assert collector.dialog_turns_per_batch == 4 and collector.total_dialog_turns == 8
    assert list(collector) == [None, None]  # two batches of 4 turns, written by the actor, not returned
    assert rb.write_count == 8 and len(rb) == 8
    batches = list(rb)  # one pass without replacement, sampled in the buffer's actor
    assert [b.batch_size for b in batches] == [(4,), (4,)]
    assert sorted(q for b in batches for q in b["query"]) == sorted(f"q{i}" for i in range(8))
    collector.increment_version()
    assert collector.policy_version == 1
    collector.shutdown()  # ends the actor (ray.kill takes effect shortly after)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            collector.is_running()
            time.sleep(0.1)

    rb.empty()
    background = RayLLMCollector(make_env, policy_factory=Scripted, dialog_turns_per_batch=2, replay_buffer=rb,
                                 timeout_s=120)  # fmt: skip
    background.start()
    deadline = time.monotonic() + 120
    while rb.write_count < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rb.write_count >= 6 and background.is_running()
    background.async_shutdown(timeout=60)
    assert not background.is_running() and background.collection_failure() is None
    written = rb.write_count
    time.sleep(0.5)
    assert rb.write_count == written  # stopped
    background.shutdown()
    rb.close()
    assert not rb.is_alive


def test_a_failed_background_collection_is_kept_and_reported(ray_cluster):
    from functools import partial

    from rlpost.collect import RayLLMCollector
    from rlpost.data import LazyStackStorage, RayReplayBuffer

    class Broken:
        def __call__(self, td):
            raise ValueError("the policy broke")

    make_env, _ = _scripted_parts()
    rb = RayReplayBuffer(storage=partial(LazyStackStorage, 10), batch_size=2)
    collector = RayLLMCollector(make_env, policy_factory=Broken, dialog_turns_per_batch=2, replay_buffer=rb,
                                timeout_s=60)  # fmt: skip
    collector.start()
    collector.async_shutdown(timeout=60, close_env=False)
    assert not collector.is_running()
    assert collector.collection_failure() == "ValueError: the policy broke"
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample()
    collector.shutdown()
    rb.close()


def test_envs_naming_one_data_loading_actor_draw_one_prompt_stream_and_resume_it(ray_cluster):
    """TorchRL's ray_backend=True: every env naming the actor draws from one stream (the copies of
    a prompt keep one prompt_id wherever they land), and its position saves and restores."""
    from rlpost.envs import GSM8KEnv

    rows = [{"question": f"q{i}", "answer": "#### 1"} for i in range(6)]

    def make(name="shared-prompts"):
        return GSM8KEnv(dataset=rows, shuffle=False, repeats=2, ray_backend=True, dataloader_actor_name=name)

    first, second = make(), make()

    def draw(env):
        td = env.reset()
        return td["query"][0], int(td["prompt_id"][0])

    assert [draw(first), draw(second), draw(first), draw(second)] == [("q0", 0), ("q0", 0), ("q1", 1), ("q1", 1)]
    saved = second.primer.state_dict()
    assert draw(first) == ("q2", 2)
    second.primer.load_state_dict(saved)
    assert [draw(second), draw(first)] == [("q2", 2), ("q2", 2)]
    assert draw(make("another-stream")) == ("q0", 0)  # another name, another stream


@pytest.mark.long  # the buffer's actor restarts: ~15 s
def test_a_killed_replay_buffer_actor_restarts_empty_and_says_what_was_lost(ray_cluster, caplog):
    import logging
    from functools import partial

    import ray
    import torch
    from tensordict import TensorDict

    from rlpost.data import LazyStackStorage, RayReplayBuffer, SamplerWithoutReplacement

    rb = RayReplayBuffer(storage=partial(LazyStackStorage, 10), sampler=SamplerWithoutReplacement, batch_size=2,
                         timeout_s=120)  # fmt: skip
    rb.extend(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
    assert rb.write_count == 4 and rb.restarts == 0
    before = ray.get(rb._rb.read.remote("write_count"), timeout=60)[0]  # the actor's incarnation
    ray.kill(rb._rb, no_restart=False)  # Ray restarts the actor
    while True:  # the kill takes effect shortly after: until then calls still reach the old actor
        try:
            if ray.get(rb._rb.read.remote("write_count"), timeout=60)[0] != before:
                break
        except ray.exceptions.RayActorError:  # dying or restarting
            break
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3]))  # waits for the restart, then writes
    assert rb.restarts == 1 and len(rb) == 3 and rb.write_count == 3
    assert "restarted; it starts empty: what it held of the 4 items written before" in caplog.text
    assert sorted(rb.sample(3)["x"].tolist()) == [0, 1, 2]  # nothing written twice
    rb.close()
