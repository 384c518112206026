"""IncrementalTokenizer: tokens.prompt in step with history.prompt, the policy's own ids kept,
tool results appended as a tokens-mode ChatEnv appends them."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import ChatHistory, History, Tokens
from rlpost.envs.chat import ChatEnv
from rlpost.envs.errors import EnvInputError
from rlpost.envs.incremental_tokenizer import IncrementalTokenizer
from rlpost.envs.tool_transforms import PythonInterpreter

pytestmark = pytest.mark.unit

CODE = "Let me compute.\n```python\nprint(6 * 7)\n```"


def history_env(tokenizer, batch_size=2, **kwargs):
    env = ChatEnv(batch_size=[batch_size], system_prompt="Be brief.", tokenizer=tokenizer, **kwargs)
    return env.append_transform(PythonInterpreter(timeout=5.0)).append_transform(IncrementalTokenizer(tokenizer))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def act(td, replies, response_ids=None):
    """The policy's output: history.full, and (when given) tokens.full = prompt ids + response ids."""
    k = len(replies)
    prompt = td["history"].prompt
    full = prompt.append(History(role=["assistant"] * k, content=replies, batch_size=[k]), inplace=False)
    td.set("history", ChatHistory(prompt=prompt, full=full, batch_size=[k]))
    if response_ids is not None:
        prompts = td.get(("tokens", "prompt"), as_list=True)
        rows = [Tokens(prompt=p, response=torch.tensor(r), full=torch.cat([p, torch.tensor(r)]), padded=False)
                for p, r in zip(prompts, response_ids)]  # fmt: skip
        td.set("tokens", lazy_stack(rows))
    return td


def test_reset_tokenizes_each_rendered_prompt(tiny_tokenizer):
    td = history_env(tiny_tokenizer).reset(TensorDict({"query": ["Hello!", "What is 2+2?"]}, batch_size=[2]))
    rendered = td["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=True)
    assert [ids.tolist() for ids in td.get(("tokens", "prompt"), as_list=True)] == [
        encode(tiny_tokenizer, text) for text in rendered
    ]
    assert rendered[1].endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_turn_extends_the_policys_ids_as_tokens_mode_does(tiny_tokenizer):
    replies = [CODE, "Just words."]
    response_ids = [encode(tiny_tokenizer, reply + "<|im_end|>") for reply in replies]
    env = history_env(tiny_tokenizer)
    td = act(env.reset(TensorDict({"query": ["q1", "q2"]}, batch_size=[2])), replies, response_ids)
    full_ids = [row.tolist() for row in td.get(("tokens", "full"), as_list=True)]
    got = [row.tolist() for row in env.step(td).get(("next", "tokens", "prompt"), as_list=True)]

    tokens_env = ChatEnv(batch_size=[2], system_prompt="Be brief.", tokenizer=tiny_tokenizer, input_mode="tokens")
    tokens_env = tokens_env.append_transform(PythonInterpreter(timeout=5.0))
    ttd = tokens_env.reset(TensorDict({"query": ["q1", "q2"]}, batch_size=[2]))
    rows = [Tokens(prompt=p, response=torch.tensor(r), full=torch.cat([p, torch.tensor(r)]), padded=False)
            for p, r in zip(ttd.get(("tokens", "prompt"), as_list=True), response_ids)]  # fmt: skip
    ttd.set("tokens", lazy_stack(rows))
    expected = [row.tolist() for row in tokens_env.step(ttd).get(("next", "tokens", "prompt"), as_list=True)]

    assert got == expected
    assert got[0][: len(full_ids[0])] == full_ids[0]
    assert tiny_tokenizer.decode(got[0][len(full_ids[0]) :]) == (
        "\n<|im_start|>user\n<tool_response>\nCode block 1 executed successfully:\n42\n\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert got[1] == full_ids[1]  # nothing added after the turn: TorchRL's copy of tokens.full


def test_the_generated_ids_are_kept_even_where_retokenizing_would_differ(tiny_tokenizer):
    spelled = [tiny_tokenizer.convert_tokens_to_ids(ch) for ch in "```python\nprint(1)\n```"]
    assert spelled != encode(tiny_tokenizer, "```python\nprint(1)\n```")  # one id per character
    env = history_env(tiny_tokenizer, batch_size=1)
    td = act(env.reset(TensorDict({"query": ["q"]}, batch_size=[1])), ["```python\nprint(1)\n```"], [spelled])
    prompt_ids = td.get(("tokens", "prompt"), as_list=True)[0].tolist()
    got = env.step(td).get(("next", "tokens", "prompt"), as_list=True)[0].tolist()
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert got[: len(prompt_ids) + len(spelled) + 1] == prompt_ids + spelled + [end]  # turn closed once
    assert tiny_tokenizer.decode(got).endswith(
        "Code block 1 executed successfully:\n1\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_tokens_full_the_next_prompt_is_tokenized(tiny_tokenizer):
    env = history_env(tiny_tokenizer, batch_size=1)
    stepped = env.step(act(env.reset(TensorDict({"query": ["q"]}, batch_size=[1])), [CODE]))
    rendered = stepped["next", "history"].prompt.apply_chat_template(
        tokenizer=tiny_tokenizer, add_generation_prompt=True
    )
    assert stepped.get(("next", "tokens", "prompt"), as_list=True)[0].tolist() == encode(tiny_tokenizer, rendered[0])


def test_the_next_root_carries_the_ids_and_a_reset_row_gets_fresh_ones(tiny_tokenizer):
    env = history_env(tiny_tokenizer, max_steps=1)
    td = act(env.reset(TensorDict({"query": ["q1", "q2"]}, batch_size=[2])), ["a", "b"], [[1], [2]])
    fresh = [row.tolist() for row in td.get(("tokens", "prompt"), as_list=True)]
    _, root = env.step_and_maybe_reset(td)  # max_steps=1: both rows done and reset
    assert [row.tolist() for row in root.get(("tokens", "prompt"), as_list=True)] == fresh


def test_custom_keys(tiny_tokenizer):
    for key in (("my_tokens", "all"), "prompt_ids"):
        env = ChatEnv(batch_size=[2], tokenizer=tiny_tokenizer).append_transform(
            IncrementalTokenizer(tiny_tokenizer, tokens_key=key)
        )
        td = env.reset(TensorDict({"query": ["Hi", "Hello there"]}, batch_size=[2]))
        rows = td.get(key, as_list=True) if isinstance(key, tuple) else td.get(key).unbind(0)
        rendered = td["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=True)
        assert [row.tolist() for row in rows] == [encode(tiny_tokenizer, text) for text in rendered]


def test_refuses_a_tokens_mode_env_and_a_place_before_the_tools(tiny_tokenizer):
    env = ChatEnv(batch_size=[1], tokenizer=tiny_tokenizer, input_mode="tokens")
    with pytest.raises(EnvInputError, match="input_mode is 'tokens'"):
        env.append_transform(IncrementalTokenizer(tiny_tokenizer)).reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    env = ChatEnv(batch_size=[1], tokenizer=tiny_tokenizer).append_transform(IncrementalTokenizer(tiny_tokenizer))
    env.append_transform(PythonInterpreter())
    with pytest.raises(ValueError, match=r"runs before \['PythonInterpreter'\].*append it after them"):
        env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
