"""More of TorchRL's LLM tests, run on rlpost with the offline tiny model: ``prefer_tokens`` over
several turns of a ChatEnv that keeps its ids (IncrementalTokenizer), GSM8K's tag extraction on a
think block with markup in it, conversions of a ``[2, 2]`` ChatHistory, a local
``LLMCollector.start()`` filling a replay buffer, AsyncEnvPool's specs and unbatched sub-envs,
and the KL transforms in whole rollouts (``KLRewardTransform`` in ``env.rollout``, ``RetrieveKL``
under a real LLMCollector) with a vLLM policy on the suite's shared engine.

TorchRL's tests mostly check shapes and that a call ran; these also check values: the ids a
policy generates from are the env's, the next prompt's ids extend them exactly, converted rows
equal their single-row conversions, the pool's rows are its sub-envs' own results, and the KL
in the reward is the policy's log-probs minus the reference's.
"""

from __future__ import annotations

import random
import string
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.collect import LLMCollector
from rlpost.data import History, LazyStackStorage, ReplayBuffer
from rlpost.data.specs import Composite, Unbounded
from rlpost.envs import AsyncEnvPool, ChatEnv, GSM8KEnv, IFEvalEnv, KLRewardTransform, RetrieveKL, StepCounter
from rlpost.envs.gsm8k import GSM8KRewardParser
from rlpost.policies import ChatHistory, Text, Tokens, TransformersWrapper, vLLMWrapper

pytestmark = pytest.mark.compat

DATA = Path(__file__).resolve().parents[1] / "data"
ENV_DATA = {"gsm8k": (GSM8KEnv, DATA / "gsm8k_sample.jsonl"), "ifeval": (IFEvalEnv, DATA / "ifeval_sample.jsonl")}
HELLO_CHAT = [{"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "I'm fine."}]
MULTI_TURN_CHAT = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3?"},
]


@pytest.fixture(autouse=True)
def no_grad_and_seeded():
    random.seed(0)
    torch.manual_seed(0)
    with torch.no_grad():
        yield


class DummyStrDataLoader:
    """Random 10-letter strings under "text", ``batch_size`` per batch (TorchRL's test dataloader)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def __iter__(self):
        return self

    def __next__(self):
        return {"text": ["".join(random.choices(string.ascii_lowercase, k=10)) for _ in range(self.batch_size)]}


def ids_of(td, key=("tokens", "prompt")) -> list[list[int]]:
    return [row.tolist() for row in td.get(key, as_list=True)]


# ----------------------------------------------------------------------------- prefer_tokens


def test_multi_turn_conversation_with_tokens(hf_model, tiny_tokenizer):
    """TestPreferTokens.test_multi_turn_conversation_with_tokens: a prefer_tokens policy on
    ``ChatEnv.with_tokenizer``: each turn generates from the env's ids, and each step's
    ``tokens.prompt`` is that turn's ``tokens.full`` (longer than the reset's), over two turns."""
    policy = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="history", generate=True,
                                 generate_kwargs={"max_new_tokens": 5}, prefer_tokens=True)  # fmt: skip
    env = ChatEnv.with_tokenizer(tokenizer=tiny_tokenizer, batch_size=(1,))
    td = env.reset(TensorDict({"query": "Hi"}, batch_size=(1,)))
    (reset_ids,) = ids_of(td)
    assert reset_ids == tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )  # fmt: skip
    prompt_ids = reset_ids
    for _ in range(2):
        out = policy(td)
        (full_ids,) = ids_of(out, ("tokens", "full"))
        assert full_ids[: len(prompt_ids)] == prompt_ids and len(full_ids) > len(prompt_ids)
        stepped, td = env.step_and_maybe_reset(out.clone())
        (next_ids,) = ids_of(stepped["next"])
        assert next_ids == full_ids and len(next_ids) > len(reset_ids)
        assert ids_of(td) == [next_ids]  # the next root carries them to the next turn
        prompt_ids = next_ids


def test_token_prefix_stays_consistent(tiny_tokenizer):
    """TestPreferTokens.test_token_prefix_stays_consistent: after a step with an assistant reply
    (and no ``tokens.full`` given, so the next history is tokenized whole), the next prompt's ids
    start with the reset's ids exactly (TorchRL checks the decoded text), and are the rendered
    next conversation's."""
    env = ChatEnv.with_tokenizer(tokenizer=tiny_tokenizer, batch_size=(1,))
    td = env.reset(TensorDict({"query": "Hello"}, batch_size=(1,)))
    (initial,) = ids_of(td)
    reply = History(role="assistant", content="Hi!", batch_size=1).unsqueeze(0)
    action = td.clone()
    action.set(("history", "full"), td.get(("history", "prompt")).extend(reply, inplace=False, dim=-1))
    (new,) = ids_of(env.step(action)["next"])
    assert new[: len(initial)] == initial and len(new) > len(initial)
    chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    assert new == tiny_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)  # fmt: skip
    assert tiny_tokenizer.decode(new).startswith(tiny_tokenizer.decode(initial))


# ----------------------------------------------------------------------------- data


def test_extract_tags_malformed():
    """TestGSM8KRewardParser.test_extract_tags_malformed: markup-like text and '&' inside the
    think block do not break the extraction."""
    think, answer = GSM8KRewardParser.extract_tags(
        "<think>reasoning with <special> chars & stuff</think> <answer>5</answer>"
    )
    assert (think, answer) == ("reasoning with <special> chars & stuff", "5")


def test_nested_batch_dimensions(tiny_tokenizer):
    """TestBatchDimensions.test_nested_batch_dimensions: a ``[2, 2]`` lazy stack of ChatHistory
    rows keeps its batch through ``to_text`` and ``to_tokens`` (and back, through
    ``Tokens.to_text`` and ``to_history``); every row equals its own single-row conversion."""
    histories = History.from_chats([HELLO_CHAT, MULTI_TURN_CHAT])
    rows = [ChatHistory(full=histories[i : i + 1]) for i in range(2)]
    batch = lazy_stack([lazy_stack(rows) for _ in range(2)])
    assert batch.batch_size == torch.Size([2, 2])
    text = batch.to_text(tiny_tokenizer)
    assert isinstance(text, Text) and text.batch_size == torch.Size([2, 2])
    tokens = batch.to_tokens(tiny_tokenizer)
    assert isinstance(tokens, Tokens) and tokens.batch_size == torch.Size([2, 2])
    assert not any(flag for row in tokens.padded for flag in row)
    rendered = tiny_tokenizer.apply_chat_template([HELLO_CHAT, MULTI_TURN_CHAT], tokenize=False)
    ids = tiny_tokenizer.apply_chat_template([HELLO_CHAT, MULTI_TURN_CHAT], return_dict=False)
    for i in range(2):
        for j in range(2):
            assert list(text[i, j].full) == [rendered[j]] == list(rows[j].to_text(tiny_tokenizer).full)
            assert tokens[i, j].full.tolist() == [ids[j]]
    assert tokens.to_text(tiny_tokenizer).full == text.full
    back = tokens.to_history(tiny_tokenizer)
    assert back.batch_size == torch.Size([2, 2])
    assert back.full.to_chats() == [[[HELLO_CHAT], [MULTI_TURN_CHAT]]] * 2


# ----------------------------------------------------------------------------- LLMCollector.start


def test_llm_collector_start(plain_llm, tiny_tokenizer):
    """TestLLMCollector.test_llm_collector_start: ``start()`` fills the replay buffer on a thread
    of its own until ``total_dialog_turns``, then stops; each sampled step's next prompt is its
    prompt plus the reply."""
    total_steps, bsz = 8, 4
    policy = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="history",
                         generate_kwargs={"max_new_tokens": 4, "ignore_eos": True})  # fmt: skip
    env = ChatEnv.from_dataloader(dataloader=DummyStrDataLoader(bsz), batch_size=bsz, group_repeats=True,
                                  input_mode="history")  # fmt: skip
    rb = ReplayBuffer(storage=LazyStackStorage(max_size=total_steps * 2))
    collector = LLMCollector(env=env, policy_factory=lambda: policy, dialog_turns_per_batch=bsz, replay_buffer=rb,
                             total_dialog_turns=total_steps)  # fmt: skip
    try:
        collector.start()
        assert collector.is_running() or rb.write_count > 0
        deadline = time.monotonic() + 120
        while collector.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not collector.is_running() and collector.collection_error is None
        assert rb.write_count == len(rb) == total_steps and collector._frames == total_steps
        sample = rb.sample(10)
        assert sample.ndim == 1 and sample.batch_size == (10,) and not sample._has_exclusive_keys
        for prompt, full, next_prompt in zip(sample["history"].prompt.to_chats(), sample["history"].full.to_chats(),
                                             sample["next", "history"].prompt.to_chats()):  # fmt: skip
            assert len(prompt) < len(next_prompt) and next_prompt == full
    finally:
        collector.async_shutdown(timeout=10)
    assert not collector.is_running()


# ----------------------------------------------------------------------------- AsyncEnvPool specs


def test_async_env_pool_spec_propagation(tiny_tokenizer):
    """TestAsyncEnvPoolSpecs.test_async_env_pool_spec_propagation: the pool exposes its sub-envs'
    action keys and full action, observation and done specs, none empty.

    Deviation: the pool of four batch-``[1]`` sub-envs has batch ``[4]`` (TorchRL: ``[4, 1]``):
    row ``i`` is sub-env ``i``, the layout the collectors' ``env_index`` bookkeeping relies on;
    the specs carry that batch in place of the sub-env's ``[1]``."""
    bsz = 4

    def env_maker():
        env = ChatEnv.from_dataloader(dataloader=DummyStrDataLoader(1), input_mode="history", batch_size=(1,),
                                      group_repeats=True)  # fmt: skip
        return env.append_transform(StepCounter(max_steps=5))

    env = AsyncEnvPool([env_maker] * bsz, backend="threading", stack="lazy")
    try:
        assert env.batch_size == torch.Size([bsz])
        sub_env = env.envs[0]
        assert env.action_keys == sub_env.action_keys == [("history", "full")]
        action_spec = env.full_action_spec
        assert isinstance(action_spec, Composite) and action_spec.shape == (bsz,)
        assert action_spec.keys(True, True) == sub_env.full_action_spec.keys(True, True)
        assert action_spec["history", "full", "role"].shape == (bsz, -1)
        assert sub_env.full_action_spec["history", "full", "role"].shape == (1, -1)  # the sub-env's own
        for name in ("full_observation_spec", "full_done_spec"):
            spec = getattr(env, name)
            assert len(spec.keys()) > 0 and spec.shape == (bsz,)
            assert spec.keys(True, True) == getattr(sub_env, name).keys(True, True)
        assert env.full_done_spec["done"].shape == (bsz, 1)
        td = env.reset()
        assert td.shape == env.batch_size and td["env_index"].tolist() == list(range(bsz))
        assert env.full_observation_spec.is_in(td.select("history"))
    finally:
        env.close()


class CountingEnv:
    """An unbatched env (batch ``()``), TorchRL's test mock: the observation counts the actions
    given so far; done once it reaches ``max_steps``."""

    batch_size = torch.Size([])
    action_keys = ["action"]

    def __init__(self, max_steps: int = 5) -> None:
        self.max_steps, self.count = max_steps, 0

    @property
    def full_action_spec(self) -> Composite:
        return Composite({"action": Unbounded(shape=(1,), dtype=torch.int8)}, shape=())

    def _observe(self) -> TensorDict:
        done = torch.tensor([self.count >= self.max_steps])
        return TensorDict(observation=torch.tensor([self.count]), done=done, terminated=done.clone())

    def reset(self, tensordict=None) -> TensorDict:
        self.count = 0
        return self._observe()

    def step(self, tensordict) -> TensorDict:
        self.count += int(tensordict["action"].sum())
        return tensordict.set("next", self._observe().set("reward", torch.ones(1)))

    def step_and_maybe_reset(self, tensordict):
        tensordict = self.step(tensordict)
        return tensordict, tensordict["next"].exclude("reward").clone()


def test_async_env_pool_with_unbatched_child_envs():
    """TestAsyncEnvPoolSpecs.test_async_env_pool_with_unbatched_child_envs: four unbatched
    sub-envs make a pool of batch ``[4]`` whose action key is "action"; a reset and a step give
    ``[4]`` tensordicts, each row its sub-env's own result."""
    envs = []

    def env_maker():
        envs.append(CountingEnv())
        return envs[-1]

    env = AsyncEnvPool([env_maker] * 4, backend="threading", stack="lazy")
    try:
        assert env.batch_size == torch.Size([4]) and "action" in env.action_keys
        assert env.full_action_spec["action"].shape == (4, 1)
        td = env.reset()
        assert td.shape == (4,) and td["observation"].view(-1).tolist() == [0] * 4
        td["action"] = torch.tensor([[1], [2], [3], [4]], dtype=torch.int8)
        td_next = env.step(td)
        assert td_next.shape == (4,) and td_next["env_index"].tolist() == [0, 1, 2, 3]
        assert td_next["next", "observation"].view(-1).tolist() == [1, 2, 3, 4] == [e.count for e in envs]
        stepped, root = env.step_and_maybe_reset(td_next.exclude("next"))
        assert stepped.shape == root.shape == (4,)
        assert sorted(root["observation"].view(-1).tolist()) == [2, 4, 6, 8]
    finally:
        env.close()
    with pytest.raises(ValueError, match="all must have batch"):
        AsyncEnvPool([CountingEnv, lambda: ChatEnv(batch_size=(1,))])


# ----------------------------------------------------------------------------- KL in rollouts


def task_env(name: str, **kwargs):
    env_class, data = ENV_DATA[name]
    return env_class(dataset=str(data), shuffle=False, **kwargs)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("env_name", ["gsm8k", "ifeval"])
def test_chat_env_kl(plain_llm, hf_model, tiny_tokenizer, pad_output, env_name):
    """TestChatEnvIntegration.test_chat_env_kl: a GSM8K / IFEval env of 3 with
    ``KLRewardTransform`` over a tokens-mode TransformersWrapper reference, rolled out one step
    with a vLLM history policy: the reward is per token, ``[3, 1, L, 1]`` padded or 3 rows of
    ``[1, L_i, 1]``. The policy and the reference are the same weights, so the KL is zero: exactly
    on the prompt tokens, to float precision on the response, and each token's reward is -KL but
    the last one's, which adds the task reward."""
    policy = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="history", generate=True,
                         pad_output=pad_output, generate_kwargs={"max_new_tokens": 6})  # fmt: skip
    ref_model = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False,
                                    return_log_probs=True, pad_output=pad_output)  # fmt: skip
    env = task_env(env_name, max_steps=10, num_envs=3, input_mode="history", tokenizer=tiny_tokenizer)
    env = env.append_transform(KLRewardTransform(ref_model))
    r = env.rollout(1, policy)
    reward = r.get(("next", "reward"), as_list=not pad_output)
    if pad_output:
        assert reward.shape[:2] == (3, 1) and reward.shape[2] > 1 and reward.shape[3] == 1
    else:
        # each row's T steps, as a list (tensordict 0.15's as_list on a lazy stack of lazy stacks)
        assert len(reward) == 3 and all(len(row) == 1 for row in reward)
        for i, row in enumerate(reward):
            assert r[i].get(("next", "reward")).shape == torch.stack(row).shape
            assert torch.stack(row).shape[0] == 1 and row[0].shape[0] > 1 and row[0].shape[1] == 1
    for i in range(3):
        step = r[i, 0]
        num_prompt = step["tokens", "prompt"].numel()  # prompt ids (with any left padding) lead tokens.full
        real = step["masks", "all_attention_mask"].reshape(-1).bool()
        kl, reward_row = step["next", "kl_penalty"].reshape(-1), step["next", "reward"].reshape(-1)
        assert kl.shape == reward_row.shape == step["tokens", "full"].shape and kl.numel() > num_prompt
        assert kl[:num_prompt].abs().sum() == 0 and kl.abs().max() < 1e-4
        assert torch.equal(reward_row[real][:-1], -kl[real][:-1])


@pytest.mark.parametrize("env_name", ["gsm8k", "ifeval"])
def test_retrievekl_transform(plain_llm, hf_model, tiny_tokenizer, env_name):
    """TestChatEnvIntegration.test_retrievekl_transform: ``RetrieveKL("from_collector", ref)`` in
    a GSM8K / IFEval env driven by a real LLMCollector with a vLLM policy_factory: a batch of 6
    steps with ``history.full`` and ``next.history.prompt``, and a per-token KL."""
    ref_model = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="history", generate=False,
                                    pad_output=True)  # fmt: skip
    env = task_env(env_name, max_steps=1, num_envs=3, tokenizer=tiny_tokenizer)
    env = env.append_transform(RetrieveKL("from_collector", ref_model))
    collector = LLMCollector(env, policy_factory=partial(vLLMWrapper, plain_llm, tokenizer=tiny_tokenizer,
                                                         input_mode="history", generate=True, pad_output=True,
                                                         generate_kwargs={"max_new_tokens": 6}),
                             dialog_turns_per_batch=6)  # fmt: skip
    try:
        d = next(iter(collector))
    finally:
        collector.shutdown()
    assert ("history", "full") in d and ("next", "history", "prompt") in d
    assert d.numel() == 6
    kl = d.get(("next", "kl_penalty"), as_padded_tensor=True).reshape(6, -1)
    assert kl.shape[1] > 1 and kl.abs().max() < 1e-4  # the policy and the reference are one model
