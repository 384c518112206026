"""TorchRL's tests and documented examples of LLMEnv, LLMHashingEnv, AddThinkingPrompt,
PolicyVersion, Tokenizer and TemplateTransform, run against rlpost.

Sources: ``TestLLMEnv`` of TorchRL's LLM env tests (with its dummy string and tensor
dataloaders, written again here), ``test_llm_hashing_env``, ``TestThinkingPrompt``, and the API
reference of these classes. Substitutions: rlpost's imports; the offline tiny model's tokenizer
(ChatML) instead of hub tokenizers; a local GSM8K-format file instead of the hub dataset. rlpost's
envs have no ``check_env_specs`` or random actions: the tests check the specs' keys and roll out
with the tests' own policies. Where rlpost deliberately deviates, the test says so.
"""

from __future__ import annotations

import contextlib
import random
import string
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_leaf_nontensor

from rlpost.data import History
from rlpost.envs import (
    AddThinkingPrompt,
    ChatEnv,
    DataLoadingPrimer,
    GSM8KEnv,
    LLMEnv,
    LLMHashingEnv,
    PolicyVersion,
    StepCounter,
    TemplateTransform,
    Tokenizer,
    TransformedEnv,
    as_padded_tensor,
)

pytestmark = [
    pytest.mark.compat,
    pytest.mark.filterwarnings("ignore:LLMEnv is deprecated:DeprecationWarning"),
]

DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k_sample.jsonl"


@pytest.fixture(autouse=True)
def seeded():
    random.seed(2)
    torch.manual_seed(2)


class DummyStrDataLoader:
    """Random 10-letter strings under "text", ``batch_size`` per batch (TorchRL's test dataloader)."""

    def __init__(self, batch_size=0):
        if isinstance(batch_size, tuple):
            batch_size = torch.Size(batch_size).numel()
        self.batch_size = batch_size

    def generate_random_string(self, length=10):
        return "".join(random.choice(string.ascii_lowercase) for _ in range(length))

    def __iter__(self):
        return self

    def __next__(self):
        if self.batch_size == 0:
            return {"text": self.generate_random_string()}
        return {"text": [self.generate_random_string() for _ in range(self.batch_size)]}


class DummyTensorDataLoader:
    """Random token rows under "tokens" (left-padded with 0 to ``max_length`` with ``padding``)
    and their "attention_mask" (TorchRL's test dataloader)."""

    def __init__(self, batch_size=0, max_length=10, padding=False):
        if isinstance(batch_size, tuple):
            batch_size = torch.Size(batch_size).numel()
        self.batch_size, self.max_length, self.padding = batch_size, max_length, padding

    def generate_random_tensor(self):
        return torch.randint(1, 10000, (random.randint(1, self.max_length),))

    def pad_tensor(self, tensor):
        return torch.cat((torch.zeros(self.max_length - len(tensor), dtype=torch.int64), tensor))

    def __iter__(self):
        return self

    def __next__(self):
        if self.batch_size == 0:
            tensor = self.generate_random_tensor()
            tokens = self.pad_tensor(tensor) if self.padding else tensor
        else:
            tensors = [self.generate_random_tensor() for _ in range(self.batch_size)]
            if self.padding:
                tokens = torch.stack([self.pad_tensor(tensor) for tensor in tensors])
            else:
                tokens = tensors
        return {"tokens": tokens, "attention_mask": tokens != 0}


def expected_batch(env_batch_size, dl_batch_size):
    if env_batch_size is None:
        return torch.Size((dl_batch_size,))
    if not isinstance(env_batch_size, tuple):
        return torch.Size(()) if env_batch_size == 0 else torch.Size((env_batch_size,))
    return torch.Size(env_batch_size)


def check_specs(env):
    """What stands in for ``check_env_specs``: a reset output of the env's batch holding the
    observation spec's keys."""
    td = env.reset()
    assert set(env.observation_spec.keys(True, True)) <= set(td.keys(True, True, is_leaf=is_leaf_nontensor))
    assert td.batch_size == env.batch_size


# ---------------------------------------------------------------------------- TestLLMEnv


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("env_batch_size", [None, 0, (), 4])
@pytest.mark.parametrize("dl_batch_size", [1, 4])
def test_llm_env(device, dl_batch_size, env_batch_size):
    """TestLLMEnv.test_llm_env (from_text=True): a DataLoadingPrimer appended to an LLMEnv of the
    primer's batch. rlpost's DataLoadingPrimer renames a "text" column to "query", which a text
    LLMEnv reads."""
    primer = DataLoadingPrimer(dataloader=DummyStrDataLoader(batch_size=dl_batch_size), batch_size=env_batch_size)
    with pytest.warns(UserWarning, match="eos_token_id"):
        env = LLMEnv(from_text=True, device=device, batch_size=primer.batch_size)
    env = env.append_transform(primer)
    assert env.batch_size == expected_batch(env_batch_size, dl_batch_size)
    check_specs(env)


def test_llm_env_with_a_primer_of_token_batches():
    """TestLLMEnv.test_llm_env (from_text=False, stack_method="as_padded_tensor"): a
    DataLoadingPrimer of token batches appended to a token LLMEnv. Deviation: batches that are
    bare tensors need ``data_keys`` to name their column (here the env's observation key)."""
    primer = DataLoadingPrimer(
        dataloader=DummyTensorDataLoader(batch_size=4, padding=True),
        stack_method="as_padded_tensor",
        batch_size=4,
        data_keys=["tokens"],
    )
    env = LLMEnv(from_text=False, batch_size=primer.batch_size, eos_token_id=0).append_transform(primer)
    check_specs(env)


def nothing_policy(from_text, device=None, use_tokens=False):
    def policy(td):
        if from_text and not use_tokens:
            if not td.shape:
                td[LLMEnv._DEFAULT_ACTION_STR_KEY] = NonTensorData("<nothing>", device=device)
            else:
                td[LLMEnv._DEFAULT_ACTION_STR_KEY] = NonTensorStack(
                    *[NonTensorData("<nothing>", device=device) for _ in range(td.shape[0])]
                )
        else:
            td[LLMEnv._DEFAULT_ACTION_TOKENS_KEY] = torch.ones(td.shape + (1,), dtype=torch.int64)
        return td

    return policy


@pytest.mark.parametrize("env_batch_size", [None, 0, (), 4])
@pytest.mark.parametrize("dl_batch_size", [1, 4])
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("from_text,stack_method", [[True, None], [False, "as_padded_tensor"], [False, None]])
@pytest.mark.parametrize("tokenizer", [True, False])
def test_llm_from_dataloader(from_text, stack_method, device, dl_batch_size, env_batch_size, tokenizer, tiny_tokenizer):
    """TestLLMEnv.test_llm_from_dataloader (the tiny model's tokenizer instead of bert's): each
    observation is the previous one followed by the action."""
    tokenizer = tiny_tokenizer if tokenizer and from_text else None
    if from_text:
        kwargs = {"dataloader": DummyStrDataLoader(batch_size=dl_batch_size)}
    else:
        if stack_method is None:
            stack_method = as_padded_tensor
        kwargs = {
            "dataloader": DummyTensorDataLoader(padding=True, batch_size=dl_batch_size),
            "stack_method": stack_method,
        }
    kwargs.update({"batch_size": env_batch_size, "from_text": from_text, "device": device, "has_attention": False,
                   "tokenizer": tokenizer})  # fmt: skip
    with pytest.warns(UserWarning, match="eos_token_id"):
        env = LLMEnv.from_dataloader(**kwargs)
    assert env.batch_size == expected_batch(env_batch_size, dl_batch_size)
    check_specs(env)

    r = env.rollout(10, nothing_policy(from_text, device, use_tokens=tokenizer is not None))
    if env.batch_size == ():
        assert r.ndim == 1
        r = r.unsqueeze(0)
    else:
        assert r.ndim == 2
    key, action = LLMEnv._DEFAULT_STR_KEY, LLMEnv._DEFAULT_ACTION_STR_KEY
    if from_text and tokenizer is None:
        assert isinstance(r[0, 0][key], str) and isinstance(r[0, 1][key], str)
        assert r[0, 0][key] == r[0, 1][key][: -len(r[0, 0][action])]
        assert r[0, 1][key] == r[0, 2][key][: -len(r[0, 1][action])]
        assert r[-1, 0][key] == r[-1, 1][key][: -len(r[-1, 0][action])]
        assert r[-1, 1][key] == r[-1, 2][key][: -len(r[-1, 1][action])]
    elif tokenizer is None:
        key = LLMEnv._DEFAULT_TOKEN_KEY
        assert (r[0, 0][key] == r[0, 1][key][:-1]).all()
        assert (r[0, 1][key] == r[0, 2][key][:-1]).all()
        assert (r[-1, 0][key] == r[-1, 1][key][:-1]).all()
        assert (r[-1, 1][key] == r[-1, 2][key][:-1]).all()
    else:
        # rlpost: the rollout holds the observation's tokens and the decoded token action
        assert r[0, 1][key] == r[0, 0][key] + r[0, 0][action]
        ids = tiny_tokenizer.encode(r[0, 0][key])
        assert r[0, 0]["tokens"].tolist()[-len(ids) :] == ids


@pytest.mark.parametrize("repeats", [3])
@pytest.mark.parametrize("env_batch_size", [None, 0, (), 4])
@pytest.mark.parametrize("dl_batch_size", [1, 4])
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("from_text,stack_method", [[True, None], [False, "as_padded_tensor"], [False, None]])
def test_llm_from_dataloader_repeats(from_text, stack_method, device, env_batch_size, dl_batch_size, repeats):
    """TestLLMEnv.test_llm_from_dataloader_repeats: every prompt appears ``repeats`` times among
    the observations right after a reset (a StepCounter ends each episode after 3 steps)."""
    if from_text:
        kwargs = {"dataloader": DummyStrDataLoader(batch_size=dl_batch_size), "repeats": repeats}
    else:
        if stack_method is None:
            stack_method = as_padded_tensor
        kwargs = {
            "dataloader": DummyTensorDataLoader(padding=True, batch_size=dl_batch_size),
            "stack_method": stack_method,
            "repeats": repeats,
        }
    kwargs.update({"batch_size": env_batch_size, "from_text": from_text, "device": device, "has_attention": False})
    with pytest.warns(UserWarning, match="eos_token_id"):
        env = LLMEnv.from_dataloader(**kwargs)
    assert env.transform.repeats == repeats

    max_steps = 3
    env.append_transform(StepCounter(max_steps=max_steps))

    def policy(td):
        if from_text:
            if not td.shape:
                td[LLMEnv._DEFAULT_ACTION_STR_KEY] = "<nothing>"
            else:
                td[LLMEnv._DEFAULT_ACTION_STR_KEY] = NonTensorStack(*["<nothing>" for _ in range(td.shape[0])])
        else:
            td[LLMEnv._DEFAULT_ACTION_TOKENS_KEY] = torch.ones(td.shape + (1,), dtype=torch.int64)
        return td

    r = env.rollout(100, policy, break_when_any_done=False)
    r_reset = r[..., ::max_steps]
    if from_text:
        all_strings = r_reset.view(-1)[LLMEnv._DEFAULT_STR_KEY]
        assert sum(s == all_strings[0] for s in all_strings) == repeats
        assert sum(s == all_strings[repeats] for s in all_strings) == repeats
        assert sum(s == all_strings[repeats * 2] for s in all_strings) == repeats
    else:
        all_tokens = r_reset.view(-1)[LLMEnv._DEFAULT_TOKEN_KEY]
        assert sum((s == all_tokens[0]).all() for s in all_tokens) == repeats
        assert sum((s == all_tokens[repeats]).all() for s in all_tokens) == repeats
        assert sum((s == all_tokens[repeats * 2]).all() for s in all_tokens) == repeats


@pytest.mark.parametrize("assign_reward,assign_done", [[True, False], [True, True], [False, True]])
@pytest.mark.parametrize("repeats", [3])
@pytest.mark.parametrize("env_batch_size", [None, 0, (), 4])
@pytest.mark.parametrize("dl_batch_size", [1, 4])
@pytest.mark.parametrize("device", [None])
@pytest.mark.parametrize("from_text,stack_method", [[True, None], [False, "as_padded_tensor"]])
def test_done_and_reward(from_text, stack_method, device, env_batch_size, dl_batch_size, repeats, assign_reward,
                         assign_done):  # fmt: skip
    """TestLLMEnv.test_done_and_reward: text envs refuse assign_reward / assign_done; token envs
    write the flags through a rollout whose actions vary in length (StepCounter ends episodes)."""
    with pytest.raises(ValueError, match="from_text") if from_text else contextlib.nullcontext():
        if from_text:
            kwargs = {"dataloader": DummyStrDataLoader(batch_size=dl_batch_size), "repeats": repeats,
                      "assign_reward": assign_reward, "assign_done": assign_done}  # fmt: skip
        else:
            kwargs = {"dataloader": DummyTensorDataLoader(padding=True, batch_size=dl_batch_size),
                      "stack_method": stack_method, "repeats": repeats, "assign_reward": assign_reward,
                      "assign_done": assign_done}  # fmt: skip
        kwargs.update({"batch_size": env_batch_size, "from_text": from_text, "device": device, "has_attention": False})
        with pytest.warns(UserWarning, match="eos_token_id"):
            env = LLMEnv.from_dataloader(**kwargs)
        env.append_transform(StepCounter(max_steps=10))

        def policy(td):
            td[LLMEnv._DEFAULT_ACTION_TOKENS_KEY] = torch.ones(
                td.shape + (torch.randint(10, (1,)).item(),), dtype=torch.int64
            )
            return td

        r = env.rollout(100, policy, break_when_any_done=False)
        if assign_done:
            assert "terminated" in r
            assert "done" in r


# ---------------------------------------------------------------------------- LLMHashingEnv


def test_llm_hashing_env():
    """test_llm_hashing_env: make_tensordict on a string gives a reset TensorDict. Deviation:
    rlpost has no check_env_specs; a three-step rollout from it stands in."""
    vocab_size = 5

    class Tokenizer:
        def __call__(self, obj):
            return torch.randint(vocab_size, (len(obj.split(" ")),)).tolist()

        def decode(self, obj):
            words = ["apple", "banana", "cherry", "date", "elderberry"]
            return " ".join(random.choice(words) for _ in obj)

        def batch_decode(self, obj):
            return [self.decode(_obj) for _obj in obj]

        def encode(self, obj):
            return self(obj)

    tokenizer = Tokenizer()
    env = LLMHashingEnv(tokenizer=tokenizer, vocab_size=vocab_size)
    td = env.make_tensordict("some sentence")
    assert isinstance(td, TensorDict)
    assert set(env.observation_spec.keys()) <= set(td.keys())
    r = env.rollout(3, lambda td: td.set("action", torch.randint(vocab_size, (1,))), auto_reset=False, tensordict=td)
    assert r.shape == (3,) and r[-1]["next", "observation"].shape == (5,)


def test_llm_hashing_env_docstring_example(tiny_tokenizer):
    """LLMHashingEnv's docstring (the tiny tokenizer instead of GPT-2's). The listing names the
    hash "hash"; the env writes "hashing" (as TorchRL's code and spec do). Deviation: a
    "truncated" flag is there too."""
    tokenizer = tiny_tokenizer
    x = tokenizer(["Check out TorchRL!"])["input_ids"]
    env = LLMHashingEnv(tokenizer=tokenizer)
    td = TensorDict(observation=x, batch_size=[1])
    td = env.reset(td)
    assert set(td.keys()) == {"done", "hashing", "observation", "terminated", "text", "truncated"}
    assert td["done"].shape == (1, 1) and td["hashing"].shape == (1, 1) and td["hashing"].dtype == torch.int64
    assert td["observation"].shape == (1, len(x[0]))
    assert td["text"] == ["Check out TorchRL!"]


def test_llm_hashing_env_beam_search_tutorial_start(tiny_tokenizer):
    """The beam search tutorial resets on a prompt repeated once per beam: every beam has the same
    hash, and beams that take the same token keep sharing it."""
    tokenizer = tiny_tokenizer
    env = LLMHashingEnv(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
    x = tokenizer(["Check out TorchRL!"])["input_ids"]
    reset_td = env.reset(TensorDict(observation=x, batch_size=[1]).repeat_interleave(3))
    assert reset_td["hashing"].view(-1).unique().numel() == 1
    reset_td["action"] = torch.tensor([[5], [5], [6]])
    hashes = env.step(reset_td)["next", "hashing"].view(-1).tolist()
    assert hashes[0] == hashes[1] != hashes[2]


# ---------------------------------------------------------------------------- TestThinkingPrompt


@pytest.fixture(scope="module")
def base_env(tiny_tokenizer):
    """TestThinkingPrompt's class-scoped GSM8K env (its reward workers start once)."""
    env = GSM8KEnv(shuffle=False, tokenizer=tiny_tokenizer, max_steps=10, dataset=str(DATA))
    yield env
    env.close()


def gsm8k_env(base_env, cond, **kwargs):
    """TorchRL's tests pop the previous AddThinkingPrompt off the shared env and append a new
    one; here a new TransformedEnv of the shared env's transforms takes it."""
    base_env.reset_dataloader()
    return TransformedEnv(base_env, AddThinkingPrompt(cond=cond, **kwargs))


WRONG = (
    "<think>Let me solve this step by step. Natalia sold clips to 48 friends in April. Then she sold half as many in "
    "May. Half of 48 is 24. So in May she sold 24 clips. To find the total, I need to add April and May: 48 + 24 = "
    "72. Therefore, Natalia sold 72 clips altogether in April and May.</think>\n<answer>322 clips</answer><|im_end|>"
)


@pytest.mark.parametrize("random_prompt", [True, False])
@pytest.mark.parametrize("undo_done", [True, False])
@pytest.mark.parametrize("zero_reward", [True, False])
@pytest.mark.parametrize("role,edit_last_turn", [("assistant", True), ("assistant", False), ("user", False)])
def test_thinking_prompt_wrong_answer(role, edit_last_turn, zero_reward, undo_done, random_prompt, base_env):
    """TestThinkingPrompt.test_thinking_prompt_wrong_answer, on the local sample's first question
    (its answer is 36, so the response is wrong). Substitution: rlpost's GSM8K reward is on a
    0-1 scale (TorchRL's on 0-100), so the condition is ``reward < 0.5`` (TorchRL: ``< 50``)."""
    env = gsm8k_env(base_env, lambda td: td["reward"] < 0.5, role=role, edit_last_turn=edit_last_turn,
                    zero_reward=zero_reward, undo_done=undo_done, random_prompt=random_prompt)  # fmt: skip
    reset = env.reset()
    assert reset[0]["history"].prompt[-1].content.startswith("Mary watched snakes at the zoo")
    reset["history"].full = reset["history"].prompt.extend(History(role="assistant", content=WRONG).view(1, 1), dim=-1)
    s = env.step(reset)
    if zero_reward:
        assert (s["next", "reward"] == 0).all()
    else:
        assert (s["next", "reward"] != 0).all()
    if undo_done:
        assert (s["next", "done"] == 0).all()
    else:
        assert (s["next", "done"] != 0).all()
    if edit_last_turn:
        assert s["next", "history"].prompt.shape == (1, 3)
    else:
        assert s["next", "history"].prompt.shape == (1, 4)
    if role == "assistant":
        assert s[0]["next", "history"].prompt[-1].role == "assistant"
    else:
        assert s[0]["next", "history"].prompt[-1].role == "user"


@pytest.mark.parametrize("random_prompt", [True, False])
@pytest.mark.parametrize("undo_done", [True, False])
@pytest.mark.parametrize("zero_reward", [True, False])
@pytest.mark.parametrize("role,edit_last_turn", [("assistant", True), ("assistant", False), ("user", False)])
def test_thinking_prompt_correct_answer(role, edit_last_turn, zero_reward, undo_done, random_prompt, base_env):
    """TestThinkingPrompt.test_thinking_prompt_correct_answer: when ``cond`` is False nothing
    changes (same 0-1 reward substitution)."""
    env = gsm8k_env(base_env, lambda td: td["reward"] < 0.5, role=role, edit_last_turn=edit_last_turn,
                    zero_reward=zero_reward, undo_done=undo_done, random_prompt=random_prompt)  # fmt: skip
    reset = env.reset()
    right = WRONG.replace("322 clips", "36")
    reset["history"].full = reset["history"].prompt.extend(History(role="assistant", content=right).view(1, 1), dim=-1)
    s = env.step(reset)
    assert (s["next", "reward"] != 0).all(), s["next", "reward"]
    assert s[0]["next", "history"].prompt[-1].role == "assistant"
    assert s["next", "done"].all()
    assert len(s[0]["next", "history"].prompt) == 3


def test_add_thinking_prompt_docstring_example(tiny_tokenizer, base_env):
    """AddThinkingPrompt's docstring, with the TorchRL 0.9 "text_response" action key it uses
    (same 0-1 reward substitution). The listing's ``s["next", "history"].shape == (1, 3)`` is
    about the prompt History (``s["next", "history"]`` is a ChatHistory of shape (1,)).
    Deviation: the edited answer is replaced by the prompt and the end-of-turn marker kept
    (TorchRL's code keeps the answer when the message ends with <|im_end|>)."""
    env = base_env.reset_dataloader()  # the docstring's GSM8KEnv(tokenizer=tokenizer, max_steps=10)
    env = TransformedEnv(env, AddThinkingPrompt(
        cond=lambda td: td["reward"] < 0.5, role="assistant", edit_last_turn=True, zero_reward=True, undo_done=True,
    ))  # fmt: skip
    reset = env.reset()
    reset["text_response"] = [WRONG]
    s = env.step(reset)
    assert (s["next", "reward"] == 0).all()
    assert (s["next", "done"] == 0).all()
    assert s["next", "history"].prompt.shape == (1, 3)
    last = s["next", "history"].prompt[0, -1].content
    assert last.endswith(AddThinkingPrompt.DEFAULT_PROMPTS_EG[0]) and "<answer>" not in last

    base_env.reset_dataloader()
    reset = env.reset()
    reset["text_response"] = [WRONG.replace("322 clips", "36")]
    s = env.step(reset)
    assert (s["next", "reward"] != 0).all()
    assert s["next", "done"].all()
    assert s["next", "history"].prompt.shape == (1, 3)


# ---------------------------------------------------------------------------- PolicyVersion


def test_policy_version_docstring_example():
    """PolicyVersion's docstring. Deviation: ``increment_version()`` returns the new version
    (TorchRL's returns None; rlpost's collector reads it)."""
    policy_version = PolicyVersion(version_type="int")
    assert policy_version.version == 0
    assert policy_version.increment_version() == 1
    assert policy_version.version == 1


@pytest.mark.parametrize("version_type", [int, "int", str, "uuid"])
def test_policy_version_stamps_the_data(version_type):
    """The transform writes "policy_version" at reset and at each step, shaped like the batch:
    int64 for integer versions, a string per row for UUIDs."""
    env = ChatEnv(batch_size=(3,)).append_transform(PolicyVersion(version_type))
    r = env.reset(TensorDict({"query": ["a", "b", "c"]}, batch_size=[3]))
    transform = env.transform[0]
    if version_type in (int, "int"):
        assert r["policy_version"].shape == (3,) and r["policy_version"].dtype == torch.int64
        assert (r["policy_version"] == 0).all()
    else:
        assert r["policy_version"] == [transform.version] * 3
    transform.increment_version()
    prompt = r["history"].prompt
    reply = History(role=["assistant"] * 3, content=["x"] * 3, batch_size=[3]).unsqueeze(-1)
    r["history"].full = prompt.extend(reply, dim=-1, inplace=False)
    s = env.step(r)
    if version_type in (int, "int"):
        assert s["next", "policy_version"].tolist() == [1, 1, 1]
    else:
        assert s["next", "policy_version"] == [transform.version] * 3


# ---------------------------------------------------------------------------- the module of the transforms


def test_llm_transforms_importable_from_the_transforms_module():
    """``torchrl.envs.llm.transforms`` exports these transforms; so does its rlpost counterpart,
    ``rlpost.torchrl.envs.llm.transforms`` (rlpost.envs.transforms holds the Transform base they
    build on, and cannot import them back)."""
    import rlpost.torchrl.envs.llm.transforms as torchrl_transforms

    for name in ("AddThinkingPrompt", "PolicyVersion", "TemplateTransform", "Tokenizer"):
        assert getattr(torchrl_transforms, name) is globals()[name]


def test_tokenizer_keywords():
    """Tokenizer's reference: TorchRL's arguments, in order."""
    import inspect

    names = list(inspect.signature(Tokenizer).parameters)
    assert names == [
        "in_keys", "out_keys", "in_keys_inv", "out_keys_inv", "tokenizer", "use_raw_nontensor", "additional_tokens",
        "skip_special_tokens", "add_special_tokens", "padding", "max_length", "return_attention_mask",
        "missing_tolerance", "call_before_reset",
    ]  # fmt: skip


def test_template_transform_signature_and_use(tiny_tokenizer):
    """TemplateTransform(tokenizer, chat_template=None): "message" rendered with a generation
    prompt at reset and step; "action" parsed back to the last assistant block before a step.
    Deviation: the assistant header is read from the template (TorchRL hard-codes Llama 3's)."""
    transform = TemplateTransform(tiny_tokenizer)
    message = [{"role": "user", "content": "Hi"}]
    td = TensorDict({"message": NonTensorStack(NonTensorData(message))}, batch_size=[1])
    transform.on_reset(td, td)
    assert td["message"] == ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    td["action"] = NonTensorStack(NonTensorData(td["message"][0] + "Hello!<|im_end|>"))
    assert transform.inv(td)["action"] == ["Hello!"]
