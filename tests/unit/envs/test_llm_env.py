"""LLMEnv, LLMHashingEnv and the transforms of rlpost.envs.llm_transforms (Tokenizer,
TemplateTransform, AddThinkingPrompt, StepCounter, PolicyVersion): values, shapes and errors."""

from __future__ import annotations

import hashlib
import uuid
import warnings

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs import (
    AddThinkingPrompt,
    ChatEnv,
    DataLoadingPrimer,
    EnvInputError,
    LLMEnv,
    LLMHashingEnv,
    PolicyVersion,
    StepCounter,
    TemplateTransform,
    Tokenizer,
    Transform,
    TransformedEnv,
)
from rlpost.envs.hashing_env import hash_rows

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore:LLMEnv is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:eos_token_id is missing:UserWarning"),
]


def text_env(**kwargs) -> LLMEnv:
    return LLMEnv(**kwargs)


def strings(*values: str) -> NonTensorStack:
    return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[len(values)])


class Batches:
    """An endless dataloader of ``{column: [values]}`` batches cycling through ``values``."""

    def __init__(self, column, values, batch_size):
        self.column, self.values, self.batch_size, self.i = column, values, batch_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = []
        for _ in range(self.batch_size):
            batch.append(self.values[self.i % len(self.values)])
            self.i += 1
        if isinstance(batch[0], torch.Tensor):
            return {self.column: torch.stack(batch)}
        return {self.column: batch}


class EndRow(Transform):
    """Marks row ``row`` done after every step (to exercise partial resets)."""

    def __init__(self, row):
        super().__init__()
        self.row = row

    def on_step(self, td, next_td):
        done = next_td.get("done").clone()
        done[self.row] = True
        next_td.set("done", done)
        return next_td


# ---------------------------------------------------------------------------- LLMEnv: construction


@pytest.mark.parametrize(
    "batch_size,expected", [(None, ()), (0, ()), ((), ()), (3, (3,)), ((3,), (3,)), (torch.Size([2]), (2,))]
)
def test_llm_env_batch_sizes(batch_size, expected):
    assert text_env(batch_size=batch_size).batch_size == torch.Size(expected)


def test_llm_env_rejects_a_2d_batch_and_text_rewards():
    with pytest.raises(TypeError, match="0 or 1d"):
        text_env(batch_size=(2, 3))
    with pytest.raises(ValueError, match="from_text"):
        text_env(assign_reward=True)
    with pytest.raises(ValueError, match="from_text"):
        text_env(assign_done=True)
    with pytest.raises(NotImplementedError, match="as_llm_data"):
        text_env(as_llm_data=True)


def test_llm_env_warns_as_torchrl():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLMEnv()
    assert [(w.category, str(w.message)[:19]) for w in caught] == [
        (DeprecationWarning, "LLMEnv is deprecate"),
        (UserWarning, "eos_token_id is mis"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        LLMEnv(eos_token_id=0)


def test_llm_env_keys_and_specs():
    env = text_env(batch_size=2, from_text=False, assign_reward=True, assign_done=True)
    assert env.action_keys == ["tokens_response"] and env.action_key == "tokens_response"
    assert env.reward_keys == ["reward"] and env.reward_key == "reward"
    assert env.done_keys == ["done", "terminated", "truncated", ("tokens_data", "done"), ("tokens_data", "terminated")]
    assert set(env.observation_spec.keys()) == {"tokens", "attention_mask"}
    assert env.observation_spec["tokens"].shape == (2, -1) and env.observation_spec["tokens"].dtype == torch.int64
    assert env.action_spec.shape == (2, -1)
    assert env.reward_spec.shape == (2, -1) and env.reward_spec.dtype == torch.float32
    assert env.full_done_spec["tokens_data", "done"].shape == (2, -1)
    text = text_env(batch_size=2, action_key="answer", str_key=("obs", "text"))
    assert text.action_keys == ["answer"] and text.reward_keys == []
    assert text.done_keys == ["done", "terminated", "truncated"]
    assert text.observation_spec.keys(True, True) == [("obs", "text")]
    transformed = text.append_transform(StepCounter())
    assert transformed.action_keys == ["answer"] and transformed.reward_keys == [] and transformed is not text


# ---------------------------------------------------------------------------- LLMEnv: text


def test_text_env_reset_and_step_concatenate():
    env = text_env(batch_size=2)
    td = env.reset(TensorDict({"text": strings("ab", "cd"), "extra": torch.arange(2)}, batch_size=[2]))
    assert td["text"] == ["ab", "cd"] and td["extra"].tolist() == [0, 1]
    for flag in ("done", "terminated", "truncated"):
        assert td[flag].shape == (2, 1) and not td[flag].any()
    td["text_response"] = strings("X", "YZ")
    out = env.step(td)
    assert out is td
    assert td["next", "text"] == ["abX", "cdYZ"]
    assert not td["next", "done"].any() and td["next", "truncated"].shape == (2, 1)
    nxt = env.step_and_maybe_reset(td)[1]
    assert nxt["text"] == ["abX", "cdYZ"]


def test_text_env_reads_the_query_a_data_loading_primer_writes():
    """rlpost's DataLoadingPrimer puts a dataset's "text" column under "query": the env reads it,
    and it wins over the previous observation when both are in a reset input."""
    env = text_env(batch_size=1)
    td = env.reset(TensorDict({"query": ["new"], "text": ["old observation"]}, batch_size=[1]))
    assert td["text"] == ["new"] and td["query"] == ["new"]
    primer = DataLoadingPrimer(Batches("text", ["p0", "p1", "p2", "p3"], 2), batch_size=2)
    env = text_env(batch_size=2).append_transform(primer).append_transform(EndRow(0))

    def policy(td):
        td["text_response"] = strings(*["!"] * td.shape[0])
        return td

    r = env.rollout(3, policy, break_when_any_done=False)
    assert r[0]["text"] == ["p0", "p2", "p3"]  # row 0 ends every step: a new prompt each time
    assert r[1]["text"] == ["p1", "p1!", "p1!!"]  # row 1 goes on


def test_text_env_errors_name_the_keys():
    env = text_env(batch_size=1)
    with pytest.raises(EnvInputError, match="observation under 'text'.*DataLoadingPrimer"):
        env.reset()
    with pytest.raises(EnvInputError, match="expects strings under 'text'"):
        env.reset(TensorDict({"text": torch.ones(1, 3)}, batch_size=[1]))
    td = env.reset(TensorDict({"text": ["a"]}, batch_size=[1]))
    with pytest.raises(EnvInputError, match="action under 'text_response'"):
        env.step(td.clone())
    td["tokens_response"] = torch.ones(1, 2, dtype=torch.int64)
    with pytest.raises(EnvInputError, match="append a Tokenizer"):
        env.step(td.clone())
    td["text_response"] = torch.ones(1, 2)
    with pytest.raises(TypeError, match="concatenates strings"):
        env.step(td)
    with pytest.raises(EnvInputError, match="TensorDict"):
        env.reset({"text": "a"})


def test_text_env_eos_reads_the_action_tokens():
    env = LLMEnv(batch_size=2, eos_token_id=7)
    td = env.reset(TensorDict({"text": strings("a", "b")}, batch_size=[2]))
    td["text_response"] = strings("x", "y")
    with pytest.raises(EnvInputError, match="'tokens_response'"):
        env.step(td.clone())
    td["tokens_response"] = torch.tensor([[3, 7], [3, 4]])
    td = env.step(td)
    assert td["next", "done"].view(-1).tolist() == [True, False]
    assert td["next", "terminated"].view(-1).tolist() == [True, False]


def test_batchless_text_env():
    env = text_env()
    td = env.reset(TensorDict({"text": "hi"}, batch_size=[]))
    assert td.batch_size == () and td["text"] == "hi" and td["done"].shape == (1,)
    td["text_response"] = " there"
    td = env.step(td)
    assert td["next", "text"] == "hi there"
    with pytest.raises(EnvInputError, match="batch-less"):
        env.reset(TensorDict({"text": ["a", "b"]}, batch_size=[2]))


def test_batchless_env_resets_after_done():
    primer = DataLoadingPrimer(Batches("text", ["p0", "p1", "p2"], 1), batch_size=0)
    env = text_env(batch_size=primer.batch_size).append_transform(primer).append_transform(StepCounter(max_steps=2))

    def policy(td):
        td["text_response"] = "+"
        return td

    r = env.rollout(5, policy, break_when_any_done=False)
    assert r.shape == (5,)
    assert r["text"] == ["p0", "p0+", "p1", "p1+", "p2"]
    assert r["step_count"].view(-1).tolist() == [0, 1, 0, 1, 0]


# ---------------------------------------------------------------------------- LLMEnv: tokens


def test_tokens_env_step_extends_tokens_and_attention():
    env = text_env(batch_size=2, from_text=False)
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9]])
    td = env.reset(TensorDict({"tokens": tokens, "attention_mask": tokens != 0}, batch_size=[2]))
    td["tokens_response"] = torch.tensor([[1, 2], [3, 4]])
    td = env.step(td)
    assert td["next", "tokens"].tolist() == [[0, 5, 6, 1, 2], [7, 8, 9, 3, 4]]
    assert td["next", "attention_mask"].tolist() == [[False, True, True, True, True], [True] * 5]
    nxt = env.step_and_maybe_reset(td)[1]
    assert set(nxt.keys()) >= {"tokens", "attention_mask", "done"}
    td = env.reset(TensorDict({"tokens": tokens}, batch_size=[2]))
    td["tokens_response"] = torch.tensor([[1], [2]])
    with pytest.raises(EnvInputError, match="attention mask"):
        env.step(td)


def test_tokens_env_reward_done_and_eos():
    env = text_env(
        batch_size=2, from_text=False, has_attention=False, assign_reward=True, assign_done=True, eos_token_id=9
    )
    td = env.reset(TensorDict({"tokens": torch.ones(2, 3, dtype=torch.int64)}, batch_size=[2]))
    assert td["tokens_data", "done"].shape == (2, 1)
    td["tokens_response"] = torch.tensor([[4, 9, 5], [4, 4, 4]])
    nxt = env.step(td)["next"]
    assert nxt["reward"].shape == (2, 3) and nxt["reward"].dtype == torch.float32 and not nxt["reward"].any()
    assert nxt["tokens_data", "done"].tolist() == [[False, True, False], [False, False, False]]
    assert nxt["done"].view(-1).tolist() == [True, False] and nxt["terminated"].view(-1).tolist() == [True, False]


def test_tokens_rows_of_different_lengths_after_a_partial_reset():
    prompts = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    env = LLMEnv.from_dataloader(
        Batches("tokens", prompts, 2), from_text=False, has_attention=False, eos_token_id=0, batch_size=2
    ).append_transform(EndRow(0))

    def policy(td):
        td["tokens_response"] = torch.full((td.shape[0], 1), 8)
        return td

    r = env.rollout(3, policy, break_when_any_done=False)
    rows = [[step["tokens"].tolist() for step in r[i].unbind(0)] for i in range(2)]
    assert rows[0] == [[1, 2], [5, 6], [1, 2]]
    assert rows[1] == [[3, 4], [3, 4, 8], [3, 4, 8, 8]]


# ---------------------------------------------------------------------------- LLMEnv.from_dataloader


def test_from_dataloader_batch_repeats_and_transform_attributes():
    env = LLMEnv.from_dataloader(Batches("text", ["a", "b"], 2), repeats=3)
    assert env.batch_size == (6,)  # group_repeats: 2 rows x 3 copies in one reset
    assert env.transform.repeats == 3 and env.transform[0] is env.transform.__dict__["_transforms"][0]
    assert env.reset()["text"] == ["a", "a", "a", "b", "b", "b"]
    env = LLMEnv.from_dataloader(Batches("text", ["a", "b"], 2), repeats=3, group_repeats=False)
    assert env.batch_size == (2,)
    assert [env.reset()["text"] for _ in range(3)] == [["a", "a"], ["a", "b"], ["b", "b"]]
    env.append_transform(StepCounter())
    with pytest.raises(AttributeError):
        _ = env.transform.repeats  # two transforms: the Compose itself


def test_from_dataloader_errors():
    with pytest.raises(ValueError, match="no 'text' column"):
        LLMEnv.from_dataloader(Batches("prompt", ["a"], 1))
    with pytest.raises(EnvInputError, match="from_text=True"):
        LLMEnv.from_dataloader(Batches("tokens", [torch.ones(2)], 1), from_text=False, tokenizer=object())
    with pytest.raises(ValueError, match="attention key must match"):
        LLMEnv.from_dataloader(Batches("text", ["a"], 1), tokenizer=object(), attention_key="mask")
    with pytest.raises(ValueError, match="Unknown stack_method"):
        LLMEnv.from_dataloader(Batches("text", ["a"], 1), stack_method="as_list")


@pytest.mark.parametrize("stack_method", [None, "as_padded_tensor", "as_nested_tensor"])
def test_from_dataloader_stack_methods(stack_method):
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]

    class Rows:
        batch_size = 2

        def __iter__(self):
            while True:
                yield {"tokens": list(prompts)}

    env = LLMEnv.from_dataloader(Rows(), from_text=False, has_attention=False, stack_method=stack_method)
    td = env.reset()
    rows = [row.get("tokens").tolist() for row in td.unbind(0)]
    assert rows == ([[1, 2, 3], [0, 0, 4]] if stack_method == "as_padded_tensor" else [[1, 2, 3], [4]])


def test_from_dataloader_with_a_tokenizer_decodes_token_actions(tiny_tokenizer):
    env = LLMEnv.from_dataloader(Batches("text", ["hello", "world"], 2), tokenizer=tiny_tokenizer, has_attention=False,
                                 eos_token_id=tiny_tokenizer.eos_token_id)  # fmt: skip
    td = env.reset()
    assert td["tokens"].shape[0] == 2 and td["attention_mask"].shape == td["tokens"].shape
    answer = tiny_tokenizer.encode(" ok", add_special_tokens=False)
    td["tokens_response"] = torch.tensor([answer, answer])
    td = env.step(td)
    assert td["text_response"] == [" ok", " ok"]
    assert td["next", "text"] == ["hello ok", "world ok"]
    assert tiny_tokenizer.decode(td["next", "tokens"][0][td["next", "attention_mask"][0].bool()]) == "hello ok"


# ---------------------------------------------------------------------------- LLMHashingEnv


class WordTokenizer:
    words = ["apple", "banana", "cherry", "date", "elder"]
    vocab_size = 5

    def __call__(self, text):
        if isinstance(text, list):
            return [self(t) for t in text]
        return [self.words.index(w) for w in text.split(" ")]

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)

    def batch_decode(self, rows):
        return [self.decode(row) for row in rows]


def blake(values):
    digest = hashlib.blake2b(torch.tensor(values, dtype=torch.int64).numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def test_hashing_env_reset_and_step_values():
    env = LLMHashingEnv(tokenizer=WordTokenizer())
    assert env.vocab_size == 5
    td = env.make_tensordict("apple banana")
    assert td.batch_size == () and td["observation"].tolist() == [0, 1]
    assert td["hashing"].tolist() == [blake([0, 1])] and td["text"] == "apple banana"
    assert td["done"].shape == (1,) and not td["done"].any()
    td["action"] = torch.tensor([2])
    nxt = env.step(td)["next"]
    assert nxt["observation"].tolist() == [0, 1, 2] and nxt["text"] == "apple banana cherry"
    assert nxt["hashing"].tolist() == [blake([blake([0, 1]), 2])]


def test_hashing_env_batch_and_equal_chains():
    env = LLMHashingEnv(tokenizer=WordTokenizer())
    td = env.make_tensordict(["apple banana", "apple banana", "cherry date"])
    assert env.batch_size == (3,) and td["hashing"].shape == (3, 1)
    hashes = td["hashing"].view(-1).tolist()
    assert hashes[0] == hashes[1] != hashes[2]

    def policy(td):
        td["action"] = torch.ones(td.shape[0], 1, dtype=torch.int64)
        return td

    r = env.rollout(2, policy, auto_reset=False, tensordict=td)
    assert r.shape == (3, 2) and r[:, 1]["next", "observation"].shape == (3, 4)
    assert r["next", "text"][2][1] == "cherry date banana banana"
    assert torch.equal(hash_rows(torch.tensor([[0, 1], [0, 1]])), torch.tensor([blake([0, 1])] * 2))


def test_hashing_env_options_and_errors():
    with pytest.raises(TypeError, match="vocab_size"):
        LLMHashingEnv()
    with pytest.raises(ValueError, match="text_output"):
        LLMHashingEnv(5)
    env = LLMHashingEnv(5, text_output=False, hashing_module=lambda x: x.sum(-1), observation_key="ids")
    td = env.reset(TensorDict({"ids": torch.tensor([[1, 2], [3, 4]])}, batch_size=[2]))
    assert td["hashing"].view(-1).tolist() == [3, 7] and "text" not in td.keys()
    assert env.action_keys == ["action"] and env.reward_keys == []
    with pytest.raises(EnvInputError, match="requires a prompt"):
        env.reset(TensorDict(batch_size=[2]))
    with pytest.raises(EnvInputError, match="'action'"):
        env.step(td)


# ---------------------------------------------------------------------------- Tokenizer


def test_tokenizer_encodes_batches_and_single_strings(tiny_tokenizer):
    t = Tokenizer(in_keys=["text"], out_keys=[("tok", "ids")], tokenizer=tiny_tokenizer)
    td = TensorDict({"text": strings("ab", "hello world")}, batch_size=[2])
    t.on_step(td, td)
    expected = tiny_tokenizer(["ab", "hello world"], padding=True, return_tensors="pt", add_special_tokens=False)
    assert torch.equal(td["tok", "ids"], expected["input_ids"])
    assert torch.equal(td["tok", "attention_mask"], expected["attention_mask"])
    assert t.state_keys == (("tok", "ids"), ("tok", "attention_mask"))
    one = TensorDict({"text": "hello world"}, batch_size=[])
    t.on_step(one, one)
    assert one["tok", "ids"].tolist() == tiny_tokenizer.encode("hello world", add_special_tokens=False)
    assert one["tok", "attention_mask"].tolist() == [1] * one["tok", "ids"].numel()


def test_tokenizer_options(tiny_tokenizer):
    ragged = Tokenizer(in_keys=["text"], out_keys=["ids"], tokenizer=tiny_tokenizer, padding=False)
    td = TensorDict({"text": strings("ab", "hello world")}, batch_size=[2])
    ragged.on_step(td, td)
    assert [row.tolist() for row in td["ids"].unbind(0)] == [tiny_tokenizer.encode(s) for s in ("ab", "hello world")]
    fixed = Tokenizer(in_keys=["text"], out_keys=["ids"], tokenizer=tiny_tokenizer, max_length=12)
    td = TensorDict({"text": strings("ab", "hello world")}, batch_size=[2])
    fixed.on_step(td, td)
    assert td["ids"].shape == (2, 12) and td["attention_mask"].sum(-1).tolist() == [2, 9]
    strict = Tokenizer(in_keys=["text"], out_keys=["ids"], tokenizer=tiny_tokenizer, missing_tolerance=False)
    with pytest.raises(EnvInputError, match="no 'text' to tokenize"):
        strict.on_step(TensorDict(batch_size=[1]), TensorDict(batch_size=[1]))
    tolerant = Tokenizer(in_keys=["text"], out_keys=["ids"], tokenizer=tiny_tokenizer)
    td = TensorDict({"ids": torch.ones(1, 3, dtype=torch.int64)}, batch_size=[1])
    tolerant.on_step(td, td)
    assert td["attention_mask"].tolist() == [[1, 1, 1]]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Tokenizer(in_keys=["text"])
    before = Tokenizer(in_keys=["text"], out_keys=["ids"], tokenizer=tiny_tokenizer, call_before_reset=True)
    td = TensorDict({"text": ["ab"]}, batch_size=[1])
    assert "ids" in before.reset_preprocess(td).keys()
    out = TensorDict(batch_size=[1])
    assert "ids" not in before.on_reset(td, out).keys()


def test_tokenizer_inverse_decodes_token_actions(tiny_tokenizer):
    t = Tokenizer(in_keys_inv=["text_response"], out_keys_inv=["tokens_response"], tokenizer=tiny_tokenizer)
    ids = tiny_tokenizer.encode("hello world")
    td = TensorDict({"tokens_response": torch.tensor([ids[:2], ids[:2]])}, batch_size=[2])
    t.inv(td)
    assert td["text_response"] == [tiny_tokenizer.decode(ids[:2])] * 2
    one = TensorDict({"tokens_response": torch.tensor(ids)}, batch_size=[])
    assert t.inv(one)["text_response"] == "hello world"


def test_tokenizer_on_a_chat_env_tokenizes_the_rendered_prompt(tiny_tokenizer):
    env = ChatEnv(input_mode="text", tokenizer=tiny_tokenizer, batch_size=1)
    env = env.append_transform(Tokenizer(in_keys=[("text", "prompt")], out_keys=["ids"], tokenizer=tiny_tokenizer))
    td = env.reset(TensorDict({"query": ["hi"]}, batch_size=[1]))
    prompt = td["text", "prompt"][0]
    assert prompt.endswith("<|im_start|>assistant\n")
    assert td["ids"][0].tolist() == tiny_tokenizer.encode(prompt, add_special_tokens=False)


# ---------------------------------------------------------------------------- TemplateTransform


def test_template_transform_renders_each_kind_of_conversation(tiny_tokenizer):
    t = TemplateTransform(tiny_tokenizer)
    assert t.chat_template == tiny_tokenizer.get_chat_template()
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    expected = tiny_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    td = TensorDict({"message": NonTensorStack(NonTensorData(chat), NonTensorData("q"))}, batch_size=[2])
    t.on_reset(td, td)
    assert td["message"] == [expected, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"]
    history = TensorDict({"message": History.from_chats([chat])}, batch_size=[1])
    assert t.on_step(history, history)["message"] == [expected]
    with pytest.raises(EnvInputError, match="conversation under 'message'"):
        t.on_step(TensorDict(batch_size=[1]), TensorDict(batch_size=[1]))


def test_template_transform_inverse_keeps_the_last_assistant_turn(tiny_tokenizer):
    t = TemplateTransform(tiny_tokenizer)
    completion = (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nfirst<|im_end|>\n"
        "<|im_start|>assistant\nthe answer<|im_end|>\n"
    )
    td = TensorDict({"action": strings(completion, "plain")}, batch_size=[2])
    assert t.inv(td)["action"] == ["the answer", "plain"]
    with pytest.raises(EnvInputError, match="completion under 'action'"):
        t.inv(TensorDict(batch_size=[1]))


def test_template_transform_renders_a_chat_env_history_for_a_text_policy(tiny_tokenizer):
    """The history of a ChatEnv rendered into the text a text-mode ChatEnv would give."""
    history_env = ChatEnv(input_mode="history", batch_size=2, system_prompt="sys").append_transform(
        TemplateTransform(tiny_tokenizer, in_keys=[("history", "prompt")], out_keys=["prompt_text"])
    )
    text_env_ = ChatEnv(input_mode="text", batch_size=2, system_prompt="sys", tokenizer=tiny_tokenizer)
    reset = TensorDict({"query": ["a", "b"]}, batch_size=[2])
    assert history_env.reset(reset.clone())["prompt_text"] == text_env_.reset(reset.clone())["text", "prompt"]
    with pytest.raises(EnvInputError, match="ChatHistory"):
        ChatEnv(batch_size=1).append_transform(TemplateTransform(tiny_tokenizer, in_keys=["history"])).reset(
            TensorDict({"query": ["a"]}, batch_size=[1])
        )


# ---------------------------------------------------------------------------- AddThinkingPrompt


class RewardIfAnswer(Transform):
    """reward 1 and done when the last response holds ``<answer>42</answer>``, else 0.1 and done."""

    def on_step(self, td, next_td):
        responses = self._env().last_responses(td)
        reward = torch.tensor([[1.0 if "<answer>42</answer>" in r else 0.1] for r in responses])
        next_td.set("reward", reward)
        next_td.set("done", torch.ones_like(next_td.get("done")))
        next_td.set("terminated", torch.ones_like(next_td.get("done")))
        return next_td


def respond(td, *contents):
    prompt = td["history"].prompt
    reply = History(role=["assistant"] * len(contents), content=list(contents), batch_size=[len(contents)])
    td["history"] = ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[len(contents)])
    return td


def thinking_env(**kwargs):
    env = ChatEnv(batch_size=2, system_prompt="sys").append_transform(RewardIfAnswer())
    return env.append_transform(AddThinkingPrompt(cond=lambda td: td["reward"] < 0.5, **kwargs))


def test_add_thinking_prompt_edits_the_last_turn_of_the_rows_that_need_it():
    env = thinking_env()
    td = env.reset(TensorDict({"query": ["q1", "q2"]}, batch_size=[2]))
    td = env.step(respond(td, "<think>t</think> <answer>41</answer>", "<answer>42</answer>"))
    chats = td["next", "history"].prompt.to_chats()
    edited = "<think>t</think> " + AddThinkingPrompt.DEFAULT_PROMPTS_EG[0]
    assert chats[0][-1] == {"role": "assistant", "content": edited}
    assert chats[1][-1] == {"role": "assistant", "content": "<answer>42</answer>"}
    assert td["next", "reward"].view(-1).tolist() == [0.0, 1.0]  # zero_reward follows edit_last_turn
    assert td["next", "done"].view(-1).tolist() == [False, True]
    assert td["next", "terminated"].view(-1).tolist() == [False, True]


def test_add_thinking_prompt_appends_a_message():
    env = thinking_env(role="user", edit_last_turn=False, undo_done=False, prompt="Think again.")
    td = env.reset(TensorDict({"query": ["q1", "q2"]}, batch_size=[2]))
    td = env.step(respond(td, "no", "<answer>42</answer>"))
    chats = td["next", "history"].prompt.to_chats()
    assert [len(c) for c in chats] == [4, 3] and chats[0][-1] == {"role": "user", "content": "Think again."}
    assert td["next", "reward"].view(-1).tolist() == pytest.approx([0.1, 1.0])
    assert td["next", "done"].all()


def test_add_thinking_prompt_replace_answer():
    t = AddThinkingPrompt(cond=bool, prompt="P")
    last_replaced = t.replace_answer("a <answer>1</answer> b <answer>2</answer><|im_end|>")
    assert last_replaced == "a <answer>1</answer> b P<|im_end|>"
    assert t.replace_answer("reasoning  ") == "reasoning\n\nP"
    user_prompt = AddThinkingPrompt(cond=bool, role="user", edit_last_turn=False).prompt
    assert user_prompt == AddThinkingPrompt.DEFAULT_PROMPTS_COG[0]
    random_prompt = AddThinkingPrompt(cond=bool, random_prompt=True).prompt
    assert random_prompt in AddThinkingPrompt.DEFAULT_PROMPTS_EG


def test_add_thinking_prompt_needs_a_history_env():
    with pytest.raises(ValueError, match="edit_last_turn"):
        AddThinkingPrompt(cond=bool, role="user")
    env = text_env(batch_size=1).append_transform(AddThinkingPrompt(cond=bool))
    with pytest.raises(EnvInputError, match="input_mode='history'.*LLMEnv"):
        env.reset(TensorDict({"text": ["a"]}, batch_size=[1]))
    with pytest.raises(EnvInputError, match="not attached"):
        AddThinkingPrompt(cond=bool).on_step(TensorDict(batch_size=[1]), TensorDict(batch_size=[1]))


# ---------------------------------------------------------------------------- StepCounter


def test_step_counter_truncates():
    env = text_env(batch_size=2).append_transform(StepCounter(max_steps=2))
    td = env.reset(TensorDict({"text": strings("a", "b")}, batch_size=[2]))
    assert td["step_count"].tolist() == [[0], [0]]
    for expected in (1, 2):
        td["text_response"] = strings("x", "y")
        td = env.step(td)
        assert td["next", "step_count"].view(-1).tolist() == [expected] * 2
        assert td["next", "truncated"].all() == (expected == 2) and td["next", "done"].all() == (expected == 2)
        td = env.maybe_reset(td["next"])
    assert td["step_count"].view(-1).tolist() == [0, 0]
    with pytest.raises(ValueError, match="max_steps"):
        StepCounter(max_steps=0)


def test_step_counter_on_a_chat_env_counts_as_the_env_does():
    env = ChatEnv(batch_size=1, max_steps=5).append_transform(StepCounter(max_steps=1))
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    td = env.step(respond(td, "r"))
    assert td["next", "step_count"].tolist() == [[1]] and td["next", "truncated"].all() and td["next", "done"].all()


# ---------------------------------------------------------------------------- PolicyVersion


def test_policy_version_int_tracker():
    version = PolicyVersion()
    assert version.version == 0 and version.version_type is int
    assert version.increment_version() == 1 and version.version == 1
    assert [(c.old_version, c.new_version) for c in version.version_history] == [(None, 0), (0, 1)]
    version.version = 5
    assert version.state_dict() == {"version": 5, "version_type": "int"}
    other = PolicyVersion("int")
    other.load_state_dict({"version": 5})
    assert other.version == 5
    assert PolicyVersion(3).version == 3  # rlpost's earlier signature: the starting version
    with pytest.raises(ValueError, match="Invalid version type"):
        PolicyVersion("float")
    with pytest.raises(ValueError, match="int versions"):
        version.version = "x"


def test_policy_version_uuid_tracker():
    version = PolicyVersion("uuid")
    first = version.version
    uuid.UUID(first)
    assert version.increment_version() != first and len(version.version_history) == 2
    with pytest.raises(ValueError, match="version_type=int"):
        version.observe(reported=3)
    with pytest.raises(ValueError, match="version_type"):
        PolicyVersion().load_state_dict(version.state_dict())


def test_policy_version_stamps_resets_and_steps():
    tracker = PolicyVersion()
    env = ChatEnv(batch_size=2).append_transform(tracker)
    td = env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2]))
    assert td["policy_version"].tolist() == [0, 0] and td["policy_version"].dtype == torch.int64
    tracker.increment_version()
    td = env.step(respond(td, "x", "y"))
    assert td["next", "policy_version"].tolist() == [1, 1]
    assert env.step_and_maybe_reset(respond(env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2])), "x", "y"))[1][
        "policy_version"
    ].tolist() == [1, 1]
    uuid_env = ChatEnv(batch_size=2).append_transform(PolicyVersion("uuid"))
    td = uuid_env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2]))
    assert td["policy_version"] == [uuid_env.transform[0].version] * 2


def test_policy_version_follows_the_engine_for_the_collector():
    from rlpost.collect import PolicyVersion as CollectorPolicyVersion

    assert CollectorPolicyVersion is PolicyVersion
    tracker = PolicyVersion()

    class Completion:
        policy_version = 4

    assert tracker.observe(completions=[Completion()]) == 4 and tracker.version == 4
    assert tracker.observe(reported=6) == 6 and PolicyVersion.merge(5, 6) == 5 and PolicyVersion.merge(None, 6) == 6
    tracker.set_version(2)
    assert tracker.version == 2 and tracker.observe() == 2


def test_transformed_env_of_an_llm_env_is_a_transformed_env():
    env = text_env(batch_size=1)
    transformed = env.append_transform(StepCounter())
    assert isinstance(transformed, TransformedEnv) and transformed.base_env is env
    assert transformed.append_transform(PolicyVersion()) is transformed and len(transformed.transform) == 2
    assert repr(transformed).startswith("TransformedEnv(env=LLMEnv(")
