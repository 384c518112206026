"""LLMCollector's whole-episodes mode, PolicyVersion and GroupCollector on a real vLLM engine with the tiny model.

One in-process engine serves the module. Engine calls go through a recording
client, so the tests compare every sample with the exact ids and log-probs the engine returned.
"""

import copy
import threading
import time

import pytest
import torch

from rlpost.actors.calls import InferenceWorkerLost
from rlpost.actors.env_pool import EnvPoolSettings, GroupCollector
from rlpost.algo import group_advantages
from rlpost.collect import LLMCollector, WholeEpisodes
from rlpost.config import JobConfig
from rlpost.envs import Transform, make_env
from rlpost.envs.rewards import answer_reward
from rlpost.policies import LocalVLLMClient, vLLMWrapper
from rlpost.transport.buffer import BufferLost, BufferTimeout, LocalBuffer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GROUP_SIZE = 4


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """The engine's client (a LocalVLLMClient). The engine runs in this process on a thread of its
    own, as an inference worker's does (the worker without its Ray actor): no engine processes to
    start, each of which would import vLLM again (~5 s instead of ~25 s on 2 cores). It is shut
    down with the module, so a later in-process engine may run here (one at a time)."""
    from rlpost.actors.vllm_workers import make_vllm_worker

    engine = JobConfig().rollout.engine.model_copy(update={"max_model_len": 256, "kv_cache_space_gb": 0.25, "seed": 0})
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, engine_config=engine, dtype="float32")
    assert isinstance(worker.client, LocalVLLMClient)
    yield worker.client
    worker.shutdown()


class RecordingClient:
    """An engine client over the real engine that records each call's prompts and completions.

    ``versions[k]`` becomes ``last_policy_version`` after call k (the last one repeats);
    ``overrides[k]`` updates call k's sampling; ``same_completion_rows`` gives those rows of
    every call the completion of the first of them (identical completions: equal rewards).
    """

    def __init__(self, inner, *, versions=None, overrides=None, same_completion_rows=()):
        self.inner, self.versions, self.overrides = inner, versions, overrides or []
        self.same_completion_rows = list(same_completion_rows)
        self.calls = []
        self.last_policy_version = None

    def get_tokenizer(self):
        return self.inner.get_tokenizer()

    def generate(self, prompt_token_ids, sampling):
        k = len(self.calls)
        sampling = {**sampling, **(self.overrides[k] if k < len(self.overrides) else {})}
        out = self.inner.generate(prompt_token_ids, sampling)
        if self.same_completion_rows:
            first = out[self.same_completion_rows[0]][0]
            for row in self.same_completion_rows:
                out[row] = [copy.deepcopy(first)]
        self.calls.append(([list(p) for p in prompt_token_ids], out))
        if self.versions:
            self.last_policy_version = self.versions[min(k, len(self.versions) - 1)]
        return out

    def score(self, token_ids, *, temperature):
        return self.inner.score(token_ids, temperature=temperature)


class CountingBuffer(LocalBuffer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.put_sizes = []

    def put(self, groups, timeout_s, producer=None, producer_state=None, epoch=0, force=False):
        self.put_sizes.append(len(groups))
        return super().put(groups, timeout_s, producer, producer_state, epoch, force)


class Nudge(Transform):
    """A user turn "Try again." after every response that did not end the episode."""

    def on_step(self, td, next_td):
        done = next_td.get("done").view(-1).tolist()
        return self._env().append_messages(next_td, "user", [None if d else "Try again." for d in done])


def make_cfg(**sections) -> EnvPoolSettings:
    """An env pool's sections of a job config with these ``sections`` (a YAML's)."""
    raw = {
        "data": {"group_size": GROUP_SIZE},
        "rollout": {"max_tokens": 24, "engine": {"max_model_len": 256}},
        "trainer": {"prompts_per_step": 4},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return EnvPoolSettings.from_job(JobConfig.model_validate(raw))


def make_collector(cfg, client, tokenizer, *, input_mode="tokens", num_groups=4, **kwargs):
    env = make_env(cfg, tokenizer, num_groups * GROUP_SIZE, input_mode=input_mode)
    policy = vLLMWrapper(
        client, tokenizer=tokenizer, input_mode=input_mode, pad_output=False,
        generate_kwargs={"max_tokens": cfg.rollout.max_tokens, "temperature": cfg.rollout.temperature},
    )  # fmt: skip
    kwargs.setdefault("advantage_scale", cfg.loss.advantage_scale)
    kwargs.setdefault("filter_equal_rewards", cfg.loss.filter_equal_rewards)
    groups_per_batch, total_groups = kwargs.pop("groups_per_batch", 1), kwargs.pop("total_groups", None)
    return LLMCollector(
        env, policy=policy, whole_episodes=WholeEpisodes(group_size=GROUP_SIZE, **kwargs),
        dialog_turns_per_batch=groups_per_batch * GROUP_SIZE,
        total_dialog_turns=-1 if total_groups is None else total_groups * GROUP_SIZE,
    )  # fmt: skip


def row_of(env, prompt_id):
    primer = env.primer
    epoch, position = divmod(prompt_id, primer.num_rows)
    return primer.rows[int(primer.order(epoch)[position])]


def flat(groups):
    return [s for g in groups for s in g.samples]


# ---------------------------------------------------------------------------- the collector


@pytest.mark.parametrize("input_mode", ["tokens", "history"])
def test_collect_whole_groups_from_the_engine_ids(engine, tiny_tokenizer, input_mode):
    client = RecordingClient(engine)
    collector = make_collector(make_cfg(), client, tiny_tokenizer, input_mode=input_mode)
    groups = collector.collect_groups(4)

    assert len(groups) == 4
    assert all(len(g.samples) == GROUP_SIZE and {s.prompt_id for s in g.samples} == {g.prompt_id} for g in groups)
    assert len({g.prompt_id for g in groups}) == 4
    # all rows of all groups went to the engine in one call, in row order
    assert len(client.calls) == 1
    prompts, completions = client.calls[0]
    assert len(prompts) == 16
    for sample, prompt, (completion,) in zip(flat(groups), prompts, completions):
        n = sample.prompt_len
        assert sample.token_ids[:n] == prompt
        assert sample.token_ids[n:] == completion.token_ids  # the engine's ids, not re-tokenised text
        assert sample.loss_mask == [False] * n + [True] * len(completion.token_ids)
        assert sample.logprobs[n:] == pytest.approx(completion.logprobs, abs=0)
        assert all(lp == 0.0 for lp in sample.logprobs[:n])
        assert all(lp < 0.0 for lp in sample.logprobs[n:])
        assert sample.finished == completion.finished
        assert sample.policy_version == 0
        row = row_of(collector.env, sample.prompt_id)
        assert row["question"] in tiny_tokenizer.decode(prompt)
        assert sample.reward == pytest.approx(answer_reward(sample.completion_text, row["answer"]))
    for g in groups:
        expected = group_advantages(torch.tensor([g.rewards], dtype=torch.float64))[0].tolist()
        assert g.advantages == pytest.approx(expected, abs=1e-9)
        assert g.policy_version == 0
        assert g.info["num_filtered_groups"] == 0
    assert collector.episode_stats.num_samples == 16
    assert collector.episode_stats.num_generated_tokens == sum(s.num_generated for s in flat(groups))


def test_iterator_and_batch_scaled_advantages(engine, tiny_tokenizer):
    client = RecordingClient(engine)
    cfg = make_cfg(loss={"advantage_scale": "batch"})
    collector = make_collector(cfg, client, tiny_tokenizer, groups_per_batch=2, total_groups=5)
    batches = list(collector)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert len(client.calls) == 3  # one engine call per batch, whole groups each
    ids = [g.prompt_id for b in batches for g in b]
    assert len(set(ids)) == 5
    for batch in batches:
        rewards = torch.tensor([g.rewards for g in batch], dtype=torch.float64)
        expected = group_advantages(rewards, scale="batch")
        assert [a for g in batch for a in g.advantages] == pytest.approx(expected.flatten().tolist(), abs=1e-9)


def test_whole_episodes_compose_the_torchrl_way_into_the_service_buffer(engine, tiny_tokenizer):
    """``LLMCollector(env, policy=..., whole_episodes=True, replay_buffer=...)`` as a TorchRL
    user writes it: the group size comes from the env's primer, a batch is the env's rows, each
    batch goes into the buffer as whole groups with one extend, and the buffer's sample gives
    them back oldest first; the mode's bad combinations are refused with what to change."""
    cfg = make_cfg()
    env = make_env(cfg, tiny_tokenizer, 2 * GROUP_SIZE, input_mode="tokens")
    policy = vLLMWrapper(RecordingClient(engine), tokenizer=tiny_tokenizer, input_mode="tokens", pad_output=False,
                         generate_kwargs={"max_tokens": 8})  # fmt: skip
    buffer = CountingBuffer(capacity=100, batch_size=2, wait_s=5)
    collector = LLMCollector(env, policy=policy, whole_episodes=True, replay_buffer=buffer, total_dialog_turns=16)
    assert collector.whole_episodes.group_size == GROUP_SIZE and collector.dialog_turns_per_batch == 2 * GROUP_SIZE
    assert list(collector) == [None, None]
    assert buffer.put_sizes == [2, 2]
    first = buffer.sample()
    assert [g.prompt_id for g in first] == [0, 1] and all(len(g.samples) == GROUP_SIZE for g in first)
    assert collector.episode_stats.num_groups_emitted == 4 and collector.state_dict()["env"]

    with pytest.raises(TypeError, match="whole_episodes runs batches of its own"):
        LLMCollector(env, policy=policy, whole_episodes=True, yield_completed_trajectories=True)
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        LLMCollector(env, policy=policy, whole_episodes=True, dialog_turns_per_batch=6)
    with pytest.raises(ValueError, match="repeats each prompt 4 times but group_size is 2"):
        LLMCollector(env, policy=policy, whole_episodes=WholeEpisodes(group_size=2))
    no_logprobs = vLLMWrapper(engine, tokenizer=tiny_tokenizer, input_mode="tokens", return_log_probs=False)
    with pytest.raises(ValueError, match="'return_log_probs': False"):
        LLMCollector(env, policy=no_logprobs, whole_episodes=True)


def test_policy_version_follows_the_engine(engine, tiny_tokenizer):
    client = RecordingClient(engine, versions=[7])
    collector = make_collector(make_cfg(), client, tiny_tokenizer)
    groups = collector.collect_groups(4)
    assert {s.policy_version for s in flat(groups)} == {7}
    assert {g.policy_version for g in groups} == {7}
    assert collector.get_policy_version() == 7
    client.versions = [9]
    assert {g.policy_version for g in collector.collect_groups(2)} == {9}


def test_multi_turn_sequences_and_oldest_version(engine, tiny_tokenizer):
    # Turn 1 is cut at 2 tokens (no answer yet: the episode goes on), the env adds a user turn,
    # turn 2 is served by newer weights. The sample keeps both generated turns, the env's ids
    # between them unmasked, and the older version.
    client = RecordingClient(engine, versions=[7, 8], overrides=[{"max_tokens": 2}])
    collector = make_collector(make_cfg(rollout={"max_turns": 2}), client, tiny_tokenizer, num_groups=2)
    collector.env.append_transform(Nudge())
    groups = collector.collect_groups(2)
    assert len(client.calls) == 2
    (prompts1, out1), (prompts2, out2) = client.calls
    assert len(prompts2) == 8  # no row answered in 2 tokens: every row took a second turn
    for sample, p1, (c1,), p2, (c2,) in zip(flat(groups), prompts1, out1, prompts2, out2):
        first = p1 + c1.token_ids
        assert p2[: len(first)] == first and len(p2) > len(first)  # the env added the user turn
        assert sample.token_ids == p2 + c2.token_ids
        assert sample.prompt_len == len(p1)
        added = len(p2) - len(first)
        mask = [False] * len(p1) + [True] * len(c1.token_ids) + [False] * added + [True] * len(c2.token_ids)
        assert sample.loss_mask == mask
        assert sample.logprobs == pytest.approx([0.0] * len(p1) + c1.logprobs + [0.0] * added + c2.logprobs, abs=0)
        assert "Try again." in sample.completion_text
        assert sample.policy_version == 7
        # each generated token's version (this engine labels none: the call's version), -1 elsewhere
        versions = [-1] * len(p1) + [7] * len(c1.token_ids) + [-1] * added + [8] * len(c2.token_ids)
        assert sample.token_versions == versions
    assert collector.get_policy_version() == 8


class SwitchingMidCompletion(RecordingClient):
    """Completions whose second half an in-flight update served (version 8; the call says 7)."""

    def generate(self, prompt_token_ids, sampling):
        out = super().generate(prompt_token_ids, sampling)
        for group in out:
            for c in group:
                half = len(c.token_ids) // 2
                c.token_versions = [7] * half + [8] * (len(c.token_ids) - half)
        return out


def test_token_versions_of_an_update_mid_completion_reach_the_samples(engine, tiny_tokenizer):
    client = SwitchingMidCompletion(engine, versions=[7])
    groups = make_collector(make_cfg(), client, tiny_tokenizer, num_groups=1).collect_groups(1)
    ((prompts, out),) = client.calls
    for sample, prompt, (c,) in zip(flat(groups), prompts, out):
        assert sample.policy_version == 7  # the oldest
        assert sample.token_versions == [-1] * len(prompt) + c.token_versions
        assert 8 in sample.token_versions and len(sample.token_versions) == len(sample.token_ids)


def test_dapo_filter_drops_and_counts_equal_groups(engine, tiny_tokenizer):
    # Rows 0-7 (groups 0 and 1) all get one identical completion: equal rewards in each group.
    client = RecordingClient(engine, same_completion_rows=range(8))
    collector = make_collector(make_cfg(loss={"filter_equal_rewards": True}), client, tiny_tokenizer)
    groups = collector.collect_groups(4)
    num_filtered = collector.episode_stats.num_filtered_groups
    assert num_filtered >= 2 and len(groups) == 4 - num_filtered
    assert collector.last_batch_info["num_filtered_groups"] == num_filtered
    assert all(len(set(g.rewards)) > 1 for g in groups)
    assert {g.prompt_id for g in groups} <= {2, 3}  # a fresh stream's groups 0, 1 are prompts 0, 1
    assert len(client.calls) == 1
    if groups:
        assert groups[0].info["num_filtered_groups"] == num_filtered
        assert sum(g.info["num_filtered_groups"] for g in groups) == num_filtered


# ---------------------------------------------------------------------------- the env pool


def test_env_pool_collect_run_and_resume(engine, tiny_tokenizer):
    cfg = make_cfg(rollout={"num_env_pools": 2})
    client = RecordingClient(engine)
    buffer = CountingBuffer(capacity=100)
    pool = GroupCollector(cfg, 1, client, buffer, tokenizer=tiny_tokenizer)
    assert pool.groups_per_batch == 2

    groups = pool.collect_groups()
    assert len(groups) == 2 and all(g.info["env_pool"] == 1 for g in groups)
    assert all(g.prompt_id % 2 == 1 for g in groups)  # shard 1 of 2: odd positions only
    assert buffer.put_sizes == []

    pool.start(num_groups_total=4)
    assert pool.wait(timeout_s=60)
    assert buffer.put_sizes == [2, 2]  # one batched put per collect
    in_buffer = buffer.get(4, timeout_s=1)
    assert all(len(g.samples) == GROUP_SIZE for g in in_buffer)
    stats = pool.stats()
    assert stats["num_samples"] == 6 * GROUP_SIZE and stats["num_batches_put"] == 2
    assert stats["num_generated_tokens"] > 0 and stats["generate_s"] > 0 and stats["reward_errors"] == {}

    # each put recorded the pool's position after it: a pool restarted from it goes on exactly
    state = buffer.producer_state("env-pool-1")
    assert state["num_prompts_collected"] == 6 and state["pool_index"] == 1
    expected = [g.prompt_id for g in pool.collect_groups()]
    resumed = GroupCollector(cfg, 1, client, None, tokenizer=tiny_tokenizer)
    resumed.load_state_dict(state)
    assert [g.prompt_id for g in resumed.collect_groups()] == expected
    assert resumed.num_prompts_collected == pool.num_prompts_collected == 8
    with pytest.raises(ValueError, match="cannot resume shard 0 of 2"):
        GroupCollector(cfg, 0, client, None, tokenizer=tiny_tokenizer).load_state_dict(state)


class RecordingReference:
    """The in-process reference (a Reference on the tiny model); records each batch's rewards as
    they were before its penalty."""

    def __init__(self, inner):
        self.inner, self.rewards_before = inner, []

    def penalize(self, samples):
        self.rewards_before.append([s.reward for s in samples])
        return self.inner.penalize(samples)


def test_env_pool_has_a_batch_penalised_by_the_reference_before_its_advantages(engine, tiny_tokenizer, tiny_model_path):
    """reference.kl_in=reward: the pool's batch goes through the reference before MCAdvantage, so
    each group's advantages (batch-scaled here) are computed once, from the penalised rewards."""
    from rlpost.actors.reference import Reference, ReferenceSettings

    kl = {"enabled": True, "kl_coef": 0.5, "kl_in": "reward"}
    cfg = make_cfg(reference=kl, loss={"advantage_scale": "batch"}, rollout={"num_env_pools": 2})
    # the reference scores at another temperature than the engine sampled at: a KL well above 0
    scorer_cfg = JobConfig.model_validate({"model": {"name_or_path": str(tiny_model_path)}, "reference": kl,
                                           "rollout": {"temperature": 0.5}})  # fmt: skip
    reference = RecordingReference(Reference(ReferenceSettings.from_job(scorer_cfg)))
    pool = GroupCollector(cfg, 0, RecordingClient(engine), None, tokenizer=tiny_tokenizer, reference=reference)
    groups = pool.collect_groups()

    assert len(reference.rewards_before) == 1 and len(groups) == 2  # one call, the whole batch
    for sample, before in zip(flat(groups), reference.rewards_before[0]):
        n = sample.prompt_len
        kl_sum = sum(g - r for g, r in zip(sample.logprobs[n:], sample.ref_logprobs[n:]))
        assert sample.reward == pytest.approx(before - 0.5 * kl_sum, abs=1e-6)
        assert sample.ref_logprobs[:n] == [0.0] * n
    assert any(abs(s.reward - b) > 1e-2 for s, b in zip(flat(groups), reference.rewards_before[0]))
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    expected = group_advantages(rewards, scale="batch")
    assert [a for g in groups for a in g.advantages] == pytest.approx(expected.flatten().tolist(), abs=1e-9)


def test_env_pools_of_a_range_split_the_prompts_into_its_top_shards(engine, tiny_tokenizer):
    """rollout.num_env_pools: 1..2: the prompt stream has two shards from the start, so the pool
    the run starts beyond num_env_pools (env-pool-1) takes the positions env-pool-0 never does;
    a batch is a step's share with the one pool the run starts with."""
    cfg = make_cfg(rollout={"num_env_pools": "1..2"})
    assert (cfg.rollout.num_env_pools, cfg.rollout.max_env_pools, cfg.rollout.env_pool_shards()) == (1, 2, 2)
    client = RecordingClient(engine)
    first, second = (GroupCollector(cfg, j, client, None, tokenizer=tiny_tokenizer) for j in (0, 1))
    assert first.groups_per_batch == second.groups_per_batch == cfg.trainer.prompts_per_step
    ids = [[g.prompt_id for g in pool.collect_groups(2)] for pool in (first, second)]
    assert all(p % 2 == 0 for p in ids[0]) and all(p % 2 == 1 for p in ids[1])
    assert second.state_dict()["num_shards"] == 2
    with pytest.raises(ValueError, match=r"must be in \[0, 2\)"):
        GroupCollector(cfg, 2, client, None, tokenizer=tiny_tokenizer)


def test_env_pool_background_run_stops(engine, tiny_tokenizer):
    cfg = make_cfg()
    buffer = CountingBuffer(capacity=1000)
    pool = GroupCollector(cfg, 0, RecordingClient(engine, versions=[3]), buffer, tokenizer=tiny_tokenizer)
    pool.start(num_groups_total=8)
    assert pool.wait(timeout_s=60)
    assert buffer.put_sizes == [4, 4]

    pool.start()  # until stopped
    deadline = time.monotonic() + 30
    while buffer.stats().num_put < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = pool.stop(timeout_s=30)
    assert not stats["running"] and stats["error"] is None and stats["policy_version"] == 3
    assert sum(buffer.put_sizes) == buffer.stats().num_put >= 12
    assert {g.policy_version for g in buffer.drain()} == {3}


def test_env_pool_background_error_propagates(engine, tiny_tokenizer):
    class Broken:
        def put(self, groups, timeout_s, producer=None, producer_state=None, epoch=0):
            raise OSError("buffer gone")

    pool = GroupCollector(make_cfg(), 0, RecordingClient(engine), Broken(), tokenizer=tiny_tokenizer)
    pool.start(num_groups_total=4)
    with pytest.raises(RuntimeError, match="buffer gone"):
        pool.wait(timeout_s=60)
    assert "buffer gone" in pool.stats()["error"]


def test_env_pool_wait_tells_of_a_dead_worker_at_once_and_the_run_goes_on(engine, tiny_tokenizer):
    """The engine client finds a worker dead in the middle of the run (a RemoteVLLMClient calls
    ``on_worker_lost`` and its request waits for a replacement): ``wait`` raises
    InferenceWorkerLost at once, once, and the run then finishes when the request goes on."""

    class LosingClient(RecordingClient):
        def __init__(self, inner):
            super().__init__(inner)
            self.on_worker_lost = None
            self.replaced = threading.Event()

        def generate(self, prompt_token_ids, sampling):
            if len(self.calls) == 1:  # the second batch's worker dies; the request waits
                self.on_worker_lost(0, RuntimeError("inference-0 died"))
                assert self.replaced.wait(60)
            return super().generate(prompt_token_ids, sampling)

    buffer = CountingBuffer(capacity=1000)
    client = LosingClient(engine)
    pool = GroupCollector(make_cfg(), 0, client, buffer, tokenizer=tiny_tokenizer)
    assert client.on_worker_lost is not None  # the pool listens
    pool.start(num_groups_total=8)
    start = time.monotonic()
    with pytest.raises(InferenceWorkerLost, match="inference worker 0 died under env pool 0's request"):
        pool.wait(timeout_s=60)
    assert time.monotonic() - start < 30 and pool.is_running()  # told before the run ended
    assert not pool.wait(timeout_s=0.2)  # told once
    client.replaced.set()
    assert pool.wait(timeout_s=60)
    assert buffer.put_sizes == [4, 4]


def test_env_pool_keeps_what_it_put_until_acknowledged_and_survives_its_buffer(engine, tiny_tokenizer):
    """The buffer dies at the pool's second put. The pool waits for a new buffer, puts again
    every group it kept (nothing was acknowledged), and goes on: the new buffer ends with groups
    1..12 exactly once each, whenever set_buffer came. An acknowledgement then empties the outbox."""

    class Dying(LocalBuffer):
        def put(self, groups, timeout_s, producer=None, producer_state=None, epoch=0, force=False):
            if self.stats().num_put >= 4:
                raise BufferLost("the buffer actor died")
            return super().put(groups, timeout_s, producer, producer_state, epoch, force)

    old, new = Dying(capacity=100), LocalBuffer(capacity=100)
    pool = GroupCollector(make_cfg(), 0, RecordingClient(engine), old, tokenizer=tiny_tokenizer)
    pool.writer.buffer_wait_s = 60
    pool.start(num_groups_total=12)
    deadline = time.monotonic() + 60
    while old.stats().num_put < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    pool.set_buffer(new)
    assert pool.wait(timeout_s=60)
    got = new.get(new.stats().size, timeout_s=1)
    assert [g.seq for g in got] == list(range(1, 13)) and {g.producer for g in got} == {"env-pool-0"}
    assert new.producer_state("env-pool-0")["num_groups_put"] == 12 and len(pool.writer.outbox) == 12
    with pytest.raises(BufferTimeout):  # an empty buffer: the take waits in vain but records the acknowledgement
        new.take(1, timeout_s=0.05, acknowledged={"env-pool-0": 12})
    new.put([], timeout_s=1, producer="p")  # another producer's put does not acknowledge this one's
    assert len(pool.writer.outbox) == 12
    pool.writer.extend([])  # its own next put learns the acknowledgement
    assert pool.writer.outbox == []


# ---------------------------------------------------------------------------- the Ray actor


def fixed_client_class():
    """An engine client whose every row answers the same ids (defined in a function: Ray ships
    it to the actors by value)."""

    class FixedClient:
        def __init__(self, ids, version):
            self.ids, self.last_policy_version = ids, version

        def generate(self, prompt_token_ids, sampling):
            from rlpost.policies import Completion

            return [[Completion(list(self.ids), [-0.5] * len(self.ids), True)] for _ in prompt_token_ids]

        def score(self, token_ids, *, temperature):
            return [[0.0] * len(ids) for ids in token_ids]

    return FixedClient


def test_env_pool_actor_is_the_plain_class_and_threaded(ray_cluster, tiny_tokenizer, tiny_model_path):
    """The actor ``env-pool-0`` is GroupCollector itself (an LLMCollector: no shell of forwards); its
    stats answer while its background collection runs."""
    from rlpost.actors.buffer import BufferSettings, start_buffer
    from rlpost.actors.env_pool import start_env_pool

    FixedClient = fixed_client_class()
    ids = tiny_tokenizer.encode("<answer>1</answer><|im_end|>", add_special_tokens=False)
    cfg = make_cfg(model={"name_or_path": str(tiny_model_path)})  # the actor loads the tokenizer
    buffer = start_buffer(BufferSettings(capacity=10**6, max_staleness=None), name="buffer-env-pool-test")
    actor = start_env_pool(cfg, 0, FixedClient(ids, 5), buffer)
    assert ray_cluster.get_actor("env-pool-0") is not None and issubclass(GroupCollector, LLMCollector)
    groups = ray_cluster.get(actor.collect_groups.remote(2), timeout=120)
    assert len(groups) == 2 and all(s.token_ids[s.prompt_len :] == ids for s in flat(groups))
    assert {g.policy_version for g in groups} == {5}
    ray_cluster.get(actor.start.remote(None), timeout=30)
    time.sleep(0.5)
    running = ray_cluster.get(actor.stats.remote(), timeout=10)  # answers while the run goes on
    assert running["running"]
    stats = ray_cluster.get(actor.stop.remote(30), timeout=60)
    assert not stats["running"] and stats["error"] is None and stats["num_batches_put"] >= 1
    assert buffer.stats().num_put == stats["num_batches_put"] * 4
    ray_cluster.kill(actor)


class ScriptedFirstTurn(RecordingClient):
    """The real engine, except that every row's first turn is ``text`` (+ EOS), with the real
    engine's log-probs of those ids (``score``): a model that always calls the tool."""

    def __init__(self, inner, tokenizer, text):
        super().__init__(inner)
        self.script = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompt_token_ids, sampling):
        if self.calls:
            return super().generate(prompt_token_ids, sampling)
        from rlpost.policies.base import Completion

        scores = self.inner.score(
            [list(p) + self.script for p in prompt_token_ids], temperature=sampling["temperature"]
        )
        out = [[Completion(list(self.script), s[-len(self.script) :], True)] for s in scores]
        self.calls.append(([list(p) for p in prompt_token_ids], out))
        return out


def test_tool_turns_train_only_generated_ids_and_keep_each_turns_logprobs(engine, tiny_tokenizer):
    # Turn 1 computes with the sandboxed Python tool; the env appends the tool's output; turn 2 is
    # sampled. The sample holds both turns' ids with their engine log-probs, the tool message
    # masked out, and the tool counts.
    cfg = make_cfg(data={"task": "tool_arithmetic"}, tools={"python": {"enabled": True}}, rollout={"max_turns": 3})
    client = ScriptedFirstTurn(engine, tiny_tokenizer, "```python\nprint(6 * 7)\n```")
    collector = make_collector(cfg, client, tiny_tokenizer, num_groups=2)
    groups = collector.collect_groups(2)
    (prompts1, out1), (prompts2, out2), *rest = client.calls
    assert len(prompts2) == 8  # every row called the tool, so every row took a second turn
    tool_text = "<tool_response>\nCode block 1 executed successfully:\n42\n\n</tool_response>"
    for sample, p1, (c1,), p2, (c2,) in zip(flat(groups), prompts1, out1, prompts2, out2):
        first = p1 + c1.token_ids
        added = p2[len(first) :]
        assert p2[: len(first)] == first and tool_text in tiny_tokenizer.decode(added)
        assert sample.token_ids[: len(p2) + len(c2.token_ids)] == p2 + c2.token_ids
        assert sample.loss_mask[: len(p2) + len(c2.token_ids)] == (
            [False] * len(p1) + [True] * len(c1.token_ids) + [False] * len(added) + [True] * len(c2.token_ids)
        )
        assert sample.logprobs[len(p1) : len(first)] == c1.logprobs  # turn 1's engine log-probs, kept
        assert sample.logprobs[len(p2) : len(p2) + len(c2.token_ids)] == pytest.approx(c2.logprobs, abs=0)
        assert sample.num_tool_calls == 1 and sample.num_tool_errors == 0 and sample.tool_time_s > 0
        assert sample.num_turns >= 2
    from rlpost.record.metrics import episode_metrics

    metrics = episode_metrics(groups)
    assert metrics["tool_calls_mean"] == 1.0 and metrics["tool_error_fraction"] == 0.0
    assert 2.0 <= metrics["turns_mean"] <= 3.0


def test_an_episode_whose_next_prompt_would_not_fit_the_engine_ends_and_is_counted(engine, tiny_tokenizer):
    # A long tool output can push the next prompt past the engine's context (vLLM refuses such a
    # prompt, which would stop the whole batch): those episodes end at the turn before, counted.
    cfg = make_cfg(data={"task": "tool_arithmetic"}, tools={"python": {"enabled": True}}, rollout={"max_turns": 2})
    script = "```python\nprint('x' * 500)\n```"
    client = ScriptedFirstTurn(engine, tiny_tokenizer, script)
    collector = make_collector(cfg, client, tiny_tokenizer, num_groups=2, max_prompt_tokens=200)
    groups = collector.collect_groups(2)
    assert len(client.calls) == 1  # nobody took a second turn
    assert collector.episode_stats.num_length_truncated == 8 and groups[0].info["num_length_truncated"] == 8
    for sample in flat(groups):
        assert sample.num_turns == 1 and sample.num_tool_calls == 1 and sample.reward == 0.0
        assert sample.token_ids[-len(client.script) :] == client.script  # the sample ends with turn 1


def test_a_ray_collector_of_whole_episodes_writes_each_group_once_through_a_group_writer(
    ray_cluster, tiny_tokenizer, tiny_model_path
):
    """The service's pipeline composed from the public pieces: a RayLLMCollector in the
    whole-episodes mode writes through a GroupWriter into a RayReplayBuffer holding a
    LocalBuffer; the groups arrive whole, numbered 1..4 once each, with the version that made them."""
    import time

    from rlpost.collect import RayLLMCollector
    from rlpost.data import RayReplayBuffer
    from rlpost.transport.buffer import LocalBuffer
    from rlpost.transport.group_writer import GroupWriter

    FixedClient = fixed_client_class()
    ids = tiny_tokenizer.encode("<answer>1</answer><|im_end|>", add_special_tokens=False)
    cfg, path = make_cfg(), str(tiny_model_path)

    def build_env():
        from transformers import AutoTokenizer

        return make_env(cfg, AutoTokenizer.from_pretrained(path), 2 * GROUP_SIZE, input_mode="tokens")

    def build_policy():
        from transformers import AutoTokenizer

        return vLLMWrapper(FixedClient(ids, 3), tokenizer=AutoTokenizer.from_pretrained(path), input_mode="tokens",
                           pad_output=False)  # fmt: skip

    rb = RayReplayBuffer(replay_buffer_cls=LocalBuffer, capacity=100, remote_config={"num_cpus": 0})
    collector = RayLLMCollector(build_env, policy_factory=build_policy, whole_episodes=True,
                                replay_buffer=GroupWriter(rb, "collector-0"),
                                total_dialog_turns=4 * GROUP_SIZE, timeout_s=120)  # fmt: skip
    collector.start()
    deadline = time.monotonic() + 120
    while collector.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert collector.collection_failure() is None
    groups = rb.sample(4)
    assert [g.seq for g in groups] == [1, 2, 3, 4] and {g.producer for g in groups} == {"collector-0"}
    assert [g.prompt_id for g in groups] == [0, 1, 2, 3] and {g.policy_version for g in groups} == {3}
    assert all(len(g.samples) == GROUP_SIZE and g.samples[0].token_ids[g.samples[0].prompt_len :] == ids
               for g in groups)  # fmt: skip
    collector.shutdown()
    rb.close()
