"""TorchRL LLM tests that failed against rlpost, rewritten with rlpost's imports and the offline
tiny model (TorchRL uses GPT-2, OPT or Qwen2.5 from the hub).

Covered: ``History.from_text`` on text past the last ``<|im_end|>`` (vLLM's ``ignore_eos=True``);
unpadded KL outputs read back with ``as_list=True``; ``torch.cat`` of collector batches whose
Histories differ in length; ``LLMCollector``'s default ``dialog_turns_per_batch``;
``AsyncEnvPool(stack=...)``; ``RetrieveKL("from_collector", ref)`` with the default log-prob key;
TorchRL's error wording of ``assistant_only``; ``PolicyVersion._step``; ``History.default_spec``
of a History built without a batch size. ``ChatEnv(with_tokenizer=True)`` is in
test_torchrl_tools.py with the other IncrementalTokenizer tests.
"""

from __future__ import annotations

import random
import string

import pytest
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from rlpost.collect import LLMCollector
from rlpost.data import ChatHistory, History, Text
from rlpost.envs import AsyncEnvPool
from rlpost.envs.chat import ChatEnv
from rlpost.envs.kl import KLComputation, RetrieveKL, RetrieveLogProb
from rlpost.envs.policy_version import PolicyVersion
from rlpost.policies import TransformersWrapper

pytestmark = pytest.mark.compat

CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello, how are you?"},
     {"role": "assistant", "content": "I'm doing well, thank you!"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What's the weather like?"},
     {"role": "assistant", "content": "I can't check the weather for you, sorry about that."}],
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def list_to_stack():
    with set_list_to_stack(True):
        yield


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def scorer(model, tokenizer, pad_output, key="log_probs", input_mode="history"):
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode=input_mode, generate=False,
                               pad_output=pad_output, log_probs_key=key)  # fmt: skip


def chat_batch():
    return TensorDict(history=ChatHistory(full=History.from_chats(CHATS), batch_size=[2]), batch_size=[2])


class DummyStrDataLoader:
    """TorchRL's test dataloader: ``batch_size`` random 10-letter strings under "text"."""

    def __init__(self, batch_size):
        self.batch_size = batch_size

    def __iter__(self):
        return self

    def __next__(self):
        return {"text": ["".join(random.choices(string.ascii_lowercase, k=10)) for _ in range(self.batch_size)]}


class Echo:
    """A policy answering every row with one assistant message whose length grows each call, so
    that steps hold Histories of different lengths (what TorchRL's vLLM policy produces)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, td):
        self.calls += 1
        n = td.batch_size[0]
        reply = History(role=["assistant"] * n, content=["ok " * self.calls] * n, batch_size=(n,)).unsqueeze(-1)
        td["history"].full = td["history"].prompt.extend(reply, dim=-1, inplace=False)
        return td


# ---------------------------------------------------------------------- 1. from_text past EOS


def test_from_text_drops_text_after_the_last_im_end():
    # what vLLM returns with ignore_eos=True: the turn, its end marker, then more tokens
    text = (
        "<|im_start|>user\nWrite a word.<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n"
        "more tokens the model sampled past its EOS<|endoftext|>"
    )
    history = History.from_text(text, chat_template_name="chatml_format")
    assert history.role == ["user", "assistant"]
    assert history.content == ["Write a word.", "Paris"]
    assert history.is_complete.tolist() == [True, True]


def test_from_text_keeps_a_new_turn_opened_past_eos():
    text = "<|im_start|>assistant\nParis<|im_end|>junk<|im_start|>user\nand Berlin?"
    history = History.from_text(text, chat_template_name="qwen")
    assert history.role == ["assistant", "user"]
    assert history.content == ["Paris", "and Berlin?"]
    assert history.is_complete.tolist() == [True, False]


# ---------------------------------------------------------------------- 2. unpadded outputs as lists


@pytest.mark.parametrize("input_mode", ["history", "text"])
@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_retrieve_log_prob_input_modes(hf_model, tokenizer, pad_output, input_mode):
    if input_mode == "history":
        data, assistant_only = chat_batch(), True
    else:
        texts = History.from_chats(CHATS).apply_chat_template(tokenizer, add_generation_prompt=False)
        data, assistant_only = TensorDict(text=Text(full=texts, batch_size=[2]), batch_size=[2]), False
    ref_model = scorer(hf_model, tokenizer, pad_output, input_mode=input_mode)
    result = RetrieveLogProb(ref_model, assistant_only=assistant_only, tokenizer=tokenizer)(data)
    lengths = [len(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)) for chat in CHATS]
    if pad_output:
        log_probs = result.get(("log_probs", "full"))
        assert isinstance(log_probs, torch.Tensor) and log_probs.shape == (2, max(lengths))
    else:
        log_probs = result.get(("log_probs", "full"), as_list=True)
        assert isinstance(log_probs, list) and [lp.shape[0] for lp in log_probs] == lengths
    rows = log_probs if isinstance(log_probs, list) else list(log_probs)
    if assistant_only:  # only the assistant's tokens keep a log-prob
        masks = [
            tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)[
                "assistant_masks"
            ]
            for chat in CHATS
        ]
        assert [int((row != 0).sum()) for row in rows] == [sum(mask) for mask in masks]


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_retrieve_kl_of_one_model_is_zero_per_row(hf_model, tokenizer, pad_output):
    transform = RetrieveKL(
        gen_model=scorer(hf_model, tokenizer, pad_output, "gen_log_probs"),
        ref_model=scorer(hf_model, tokenizer, pad_output, "ref_log_probs"),
        assistant_only=True,
        tokenizer=tokenizer,
        gen_log_probs_full_key=("gen_log_probs", "full"),
        ref_log_probs_full_key=("ref_log_probs", "full"),
    )
    result = transform(chat_batch().to_lazystack(0))
    assert ("gen_log_probs", "full") in result and ("ref_log_probs", "full") in result
    kl = result.get("kl_penalty", as_list=not pad_output)
    if pad_output:
        assert isinstance(kl, torch.Tensor) and kl.shape[0] == 2
    else:
        assert isinstance(kl, list) and len(kl) == 2
    assert all(float(row.abs().max()) == 0.0 for row in kl)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_kl_computation_transform(hf_model, tokenizer, pad_output):
    gen_model = scorer(hf_model, tokenizer, pad_output, "gen_log_probs")
    data = chat_batch().to_lazystack(0)
    gen_result = gen_model(data)
    next_td = TensorDict(batch_size=(2,)).to_lazystack(0)
    next_td.update(gen_result, keys_to_update=[("gen_log_probs", "full")])
    # a reference that is the generator shifted by 0.25 nats on every token
    ref_rows = [row - 0.25 for row in gen_result.get(("gen_log_probs", "full"), as_list=True)]
    next_td.update(
        lazy_stack([TensorDict({("ref_log_probs", "full"): row}) for row in ref_rows]),
        keys_to_update=[("ref_log_probs", "full")],
    )
    next_td.update({"reward": torch.tensor([[[1.0]], [[2.0]]])})
    kl_transform = KLComputation(gen_log_probs_full_key=("gen_log_probs", "full"),
                                 ref_log_probs_full_key=("ref_log_probs", "full"), kl_key="kl", add_to_reward=True,
                                 coeff=1.0)  # fmt: skip
    result = kl_transform(data.set("next", next_td))["next"]
    kl = result.get("kl", as_list=not pad_output)
    if pad_output:
        assert isinstance(kl, torch.Tensor) and kl.shape[0] == 2
    else:
        assert isinstance(kl, list) and len(kl) == 2
    for row, reward, base in zip(kl, result.get("reward", as_list=True), (1.0, 2.0)):
        torch.testing.assert_close(row, torch.full_like(row, 0.25))
        torch.testing.assert_close(reward, torch.full((row.shape[0], 1), base - 0.25))


# ---------------------------------------------------------------------- 3. and 4. the collector


def chat_env(bsz=4, max_steps=None):
    return ChatEnv.from_dataloader(dataloader=DummyStrDataLoader(bsz), batch_size=bsz, group_repeats=True,
                                   input_mode="history", max_steps=max_steps)  # fmt: skip


@pytest.mark.parametrize("total_steps", [1, 10, 20])
def test_llm_collector_batches_concatenate(total_steps):
    env = chat_env()
    collector = LLMCollector(env=env, policy_factory=Echo, dialog_turns_per_batch=env.batch_size[0],
                             total_dialog_turns=total_steps)  # fmt: skip
    stack = torch.cat(list(collector))
    assert not stack._has_exclusive_keys
    assert stack.numel() == max(-(total_steps // -4) * 4, 4)
    stack = stack.view(-1)
    for i in range(stack.numel()):  # each step's next prompt holds one more turn
        assert len(stack["history", "prompt"][i]) < len(stack["next", "history", "prompt"][i])
    assert collector._frames >= total_steps


@pytest.mark.parametrize("yield_only_last_steps", [False, True])
def test_llm_collector_default_dialog_turns_per_batch(yield_only_last_steps):
    env = chat_env(max_steps=3)
    collector = LLMCollector(env=env, policy_factory=Echo, total_dialog_turns=8, yield_completed_trajectories=True,
                             yield_only_last_steps=yield_only_last_steps)  # fmt: skip
    assert collector.dialog_turns_per_batch == 4  # the env's rows, as TorchRL rounds its default of 1
    assert collector.yield_completed_trajectories
    assert collector.yield_only_last_steps is yield_only_last_steps
    for data in collector:
        # rlpost yields one finished trajectory at a time (TorchRL concatenates trajectories up to
        # dialog_turns_per_batch): its 3 steps, or its last one
        assert data.ndim == 1 and data.numel() == (1 if yield_only_last_steps else 3)
        assert bool(data[-1]["next", "done"].all())
        for i in range(data.numel() - 1):
            assert len(data["history", "prompt"][i]) < len(data["next", "history", "prompt"][i])


# ---------------------------------------------------------------------- 5. AsyncEnvPool(stack=)


@pytest.mark.parametrize("stack", ["lazy", "maybe_dense"])
def test_async_env_pool_stack(stack):
    bsz = 4

    def env_maker():
        return ChatEnv.from_dataloader(dataloader=DummyStrDataLoader(1), input_mode="history", batch_size=(1,),
                                       group_repeats=True, max_steps=3)  # fmt: skip

    env = AsyncEnvPool([env_maker] * bsz, backend="threading", stack=stack)
    try:
        assert env.stack == stack and env.batch_size == (bsz,)
        collector = LLMCollector(env=env, policy_factory=Echo, dialog_turns_per_batch=env.batch_size[0],
                                 total_dialog_turns=8, yield_completed_trajectories=True)  # fmt: skip
        trajectories = list(collector)
        assert trajectories and all(t.batch_size == (3,) for t in trajectories)
        assert all(len(set(t["env_index"].tolist())) == 1 for t in trajectories)
    finally:
        env.close()
    with pytest.raises(ValueError, match="stack must be one of"):
        AsyncEnvPool([env_maker], stack="eager")


# ---------------------------------------------------------------------- 6. RetrieveKL from_collector


def test_retrieve_kl_from_collector_with_default_log_prob_key(hf_model, tokenizer):
    ref_model = scorer(hf_model, tokenizer, False)  # log_probs_key="log_probs", the default
    assert ref_model.log_probs_key == "log_probs"
    transform = RetrieveKL("from_collector", ref_model, assistant_only=True, tokenizer=tokenizer)
    policy = TransformersWrapper(hf_model, tokenizer=tokenizer, input_mode="history", generate=True,
                                 generate_kwargs={"max_new_tokens": 4, "do_sample": False})  # fmt: skip

    class Collector:  # what an LLMCollector gives the env: its policy
        pass

    transform.collector = Collector()
    transform.collector.policy = policy
    result = transform(chat_batch().to_lazystack(0))  # TorchRL's tests feed lazy stacks
    kl = result.get("kl_penalty", as_list=True)
    # the generator's scoring twin and the reference are one model: zero KL on every token
    assert isinstance(kl, list) and len(kl) == 2 and all(float(row.abs().max()) == 0 for row in kl)
    with pytest.raises(ValueError, match="different log_probs_key"):  # given models still need two keys
        RetrieveKL(ref_model, ref_model)


# ---------------------------------------------------------------------- 7. assistant_only wording


def test_retrieve_log_prob_assistant_only_validation(hf_model, tokenizer):
    ref_model = scorer(hf_model, tokenizer, True, input_mode="text")
    with pytest.raises(ValueError, match="The model must have `input_mode='history'` when"):
        RetrieveLogProb(ref_model, assistant_only=True, tokenizer=tokenizer)


def test_retrieve_kl_assistant_only_validation(hf_model, tokenizer):
    gen_model = scorer(hf_model, tokenizer, True, "gen_log_probs", input_mode="text")
    ref_model = scorer(hf_model, tokenizer, True, "ref_log_probs", input_mode="text")
    with pytest.raises(ValueError, match="The model must have `input_mode='history'` when"):
        RetrieveKL(gen_model=gen_model, ref_model=ref_model, assistant_only=True, tokenizer=tokenizer)
    generator = TransformersWrapper(hf_model, tokenizer=tokenizer, input_mode="history", generate=True)
    with pytest.raises(ValueError, match="The model must have `generate=False` to use the `RetrieveLogProb`"):
        RetrieveLogProb(generator)


# ---------------------------------------------------------------------- 8. PolicyVersion._step


def test_policy_version_int_version_dtype_and_device():
    transform = PolicyVersion(version_type="int")
    transform.version = 7
    td = TensorDict(batch_size=(4,))
    version = transform._step(td, td.copy()).get("policy_version")
    assert version.dtype == torch.int64 and version.shape == (4,)
    assert torch.equal(version, torch.full((4,), 7, dtype=torch.int64))
    reset = transform._reset(None, TensorDict(batch_size=(2,)))
    assert reset.get("policy_version").tolist() == [7, 7]


# ---------------------------------------------------------------------- 9. default_spec of a bare History


def test_history_spec_of_a_history_without_batch_size():
    history = History(
        role=["system", "user", "assistant", "user"],
        content=["i'm the system", "i'm the user", "I'm the assistant", "I'm the user again"],
    )
    spec = history.default_spec()
    r = spec.zero()
    assert isinstance(r, History)
    assert spec.is_in(r)
    assert spec.is_in(history)
    assert not History.default_spec(shape=(-1, -1)).is_in(history)  # one conversation, not a batch
