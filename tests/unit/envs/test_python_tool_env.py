"""The PythonInterpreter transform in a ChatEnv: TorchRL's documented rendering, hostile code, multi-turn."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import ChatHistory, History, Text, Tokens
from rlpost.envs import ArithmeticEnv, ChatEnv, PythonInterpreter

pytestmark = pytest.mark.unit

SYSTEM = "You are an assistant that can execute Python code. Decorate your code with ```python``` tags."
QUERY = "Let's write a Python function that returns the square of a number."
ACTION = (
    "Here is a block of code to be executed in python:\n"
    "```python\n"
    "def square(x):\n"
    "    return x * x\n"
    "print('testing the square function with input 2:', square(2))\n"
    "```"
)
# TorchRL's LLM API page example, printed by the tiny model's template (the same ChatML as Qwen2.5's).
TORCHRL_PAGE_RENDERING = (
    "<|im_start|>system\n"
    "You are an assistant that can execute Python code. Decorate your code with "
    "```python``` tags.<|im_end|>\n"
    "<|im_start|>user\n"
    "Let's write a Python function that returns the square of a "
    "number.<|im_end|>\n"
    "<|im_start|>assistant\n"
    "Here is a block of code to be executed in python:\n"
    "```python\n"
    "def square(x):\n"
    "    return x * x\n"
    "print('testing the square function with input 2:', square(2))\n"
    "```<|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n"
    "Code block 1 executed successfully:\n"
    "testing the square function with input 2: 4\n"
    "\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def tool_env(tokenizer, mode: str = "history", batch_size: int = 1, **kwargs) -> ChatEnv:
    base = ChatEnv(tokenizer=tokenizer, system_prompt=SYSTEM, input_mode=mode, batch_size=[batch_size], **kwargs)
    return base.append_transform(PythonInterpreter(timeout_s=5.0))


def act_history(td: TensorDict, replies: list[str]) -> TensorDict:
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=replies, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return td


# ---------------------------------------------------------------------------- TorchRL's shape


def test_history_after_a_tool_turn_renders_as_seed_000(tiny_tokenizer):
    env = tool_env(tiny_tokenizer)
    reset_data = env.reset(TensorDict({"query": [QUERY]}, batch_size=[1]))
    s, s_ = env.step_and_maybe_reset(act_history(reset_data, [ACTION]))
    assert s_["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer) == [TORCHRL_PAGE_RENDERING]
    assert s_["history"].prompt.to_chats()[0][-1]["role"] == "tool"
    assert s["next", "history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer) == [TORCHRL_PAGE_RENDERING]


@pytest.mark.parametrize("response_end", ["", "<|im_end|>", "<|im_end|>\n"])
def test_text_mode_tool_turn_renders_as_seed_000(tiny_tokenizer, response_end):
    """The response may stop before, at or after its end-of-turn marker (engines strip stop
    strings); the next prompt closes the turn exactly once."""
    env = tool_env(tiny_tokenizer, mode="text")
    td = env.reset(TensorDict({"query": [QUERY]}, batch_size=[1]))
    prompt = td["text"].prompt[0]
    response = ACTION + response_end
    td.set("text", Text(prompt=[prompt], response=[response], full=[prompt + response], batch_size=[1]))
    _, s_ = env.step_and_maybe_reset(td)
    assert s_["text"].prompt == [TORCHRL_PAGE_RENDERING]


def test_tokens_mode_tool_turn_matches_tokenizing_the_seed_rendering(tiny_tokenizer):
    env = tool_env(tiny_tokenizer, mode="tokens")
    td = env.reset(TensorDict({"query": [QUERY]}, batch_size=[1]))
    prompt = td.get(("tokens", "prompt"), as_list=True)[0]
    response = torch.tensor(tiny_tokenizer.encode(ACTION + "<|im_end|>", add_special_tokens=False))
    full = torch.cat([prompt, response])
    td.set("tokens", lazy_stack([Tokens(prompt=prompt, response=response, full=full, padded=False)]))
    _, s_ = env.step_and_maybe_reset(td)
    got = s_.get(("tokens", "prompt"), as_list=True)[0].tolist()
    assert got == tiny_tokenizer.encode(TORCHRL_PAGE_RENDERING, add_special_tokens=False)
    assert got[: len(prompt) + len(response)] == torch.cat([prompt, response]).tolist()  # generated ids kept


def test_no_code_no_tool_message(tiny_tokenizer):
    env = tool_env(tiny_tokenizer, batch_size=2)
    td = env.reset(TensorDict({"query": [QUERY, QUERY]}, batch_size=[2]))
    _, s_ = env.step_and_maybe_reset(act_history(td, ["Just text.", ACTION]))
    chats = s_["history"].prompt.to_chats()
    assert [m["role"] for m in chats[0]] == ["system", "user", "assistant"]
    assert [m["role"] for m in chats[1]] == ["system", "user", "assistant", "tool"]


# ---------------------------------------------------------------------------- hostile code


def test_hostile_blocks_come_back_as_tool_output(tiny_tokenizer):
    hostile = (
        "Let me try a few things.\n"
        "```python\nwhile True:\n    pass\n```\n"
        "```python\nimport socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\n```\n"
        "```python\nopen('/tmp/rlpost-should-not-exist.txt', 'w').write('x')\n```\n"
        "```python\nprint(1 / 0)\n```"
    )
    env = ChatEnv(batch_size=[1]).append_transform(PythonInterpreter(timeout_s=1.0))
    td = env.reset(TensorDict({"query": ["go"]}, batch_size=[1]))
    _, s_ = env.step_and_maybe_reset(act_history(td, [hostile]))
    tool = s_["history"].prompt.to_chats()[0][-1]
    assert tool["role"] == "tool"
    content = tool["content"]
    assert "Code block 1 failed:\ntimeout after 1.0s\n" in content
    assert "Code block 2 failed:\nnetwork disabled\n" in content
    assert "Code block 3 failed:\nwrite outside working directory: /tmp/rlpost-should-not-exist.txt\n" in content
    assert "Code block 4 failed:\nZeroDivisionError: division by zero\n" in content
    assert env.transforms[0].num_blocks_run == 4


def test_tool_role_user_wraps_the_response_itself(tiny_tokenizer):
    env = ChatEnv(batch_size=[1], system_prompt=SYSTEM).append_transform(PythonInterpreter(tool_role="user"))
    td = env.reset(TensorDict({"query": [QUERY]}, batch_size=[1]))
    _, s_ = env.step_and_maybe_reset(act_history(td, [ACTION]))
    assert s_["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer) == [TORCHRL_PAGE_RENDERING]


# ---------------------------------------------------------------------------- multi-turn


def test_multi_turn_tool_conversation_stops_at_max_steps(tiny_tokenizer):
    env = tool_env(tiny_tokenizer, max_steps=3)
    td = env.reset(TensorDict({"query": [QUERY]}, batch_size=[1]))
    lengths = []
    for turn in range(3):
        s, td = env.step_and_maybe_reset(act_history(td, [f"```python\nprint({turn} + 1)\n```"]))
        lengths.append(len(s["next", "history"].prompt.to_chats()[0]))
        assert s["next", "done"].item() == (turn == 2)
    # each turn adds the assistant message and the tool result, but the last: the episode ends
    # there, so its code is not run (nobody would read the result)
    assert lengths == [4, 6, 7]
    assert s["next", "truncated"].item() and not s["next", "terminated"].item()
    chat = s["next", "history"].prompt.to_chats()[0]
    assert chat[-2] == {"role": "tool", "content": "Code block 1 executed successfully:\n2\n"}
    assert chat[-1]["role"] == "assistant"
    assert env.transforms[-1].num_calls == 2 and s["next", "tool_calls"].item() == 0
    # after the limit the env starts over
    assert len(td["history"].prompt.to_chats()[0]) == 2 and td["step_count"].item() == 0


def test_batched_multi_turn_resets_only_finished_conversations():
    env = ArithmeticEnv(num_rows=20, num_envs=2, seed=0, max_steps=4).append_transform(PythonInterpreter())
    td = env.reset()
    ids = td["prompt_id"].tolist()
    answer = td["answer"][0]
    s, td = env.step_and_maybe_reset(act_history(td, [f"<answer>{answer}</answer>", "```python\nprint(2 + 3)\n```"]))
    assert s["next", "done"].view(-1).tolist() == [True, False]
    assert s["next", "reward"].view(-1).tolist() == pytest.approx([1.0, 0.0])
    assert td["prompt_id"].tolist() == [max(ids) + 1, ids[1]]  # env 0 drew a new prompt
    assert td["step_count"].view(-1).tolist() == [0, 1]
    chats = td["history"].prompt.to_chats()
    assert [m["role"] for m in chats[0]] == ["system", "user"]
    assert [m["role"] for m in chats[1]] == ["system", "user", "assistant", "tool"]
    assert chats[1][-1]["content"] == "Code block 1 executed successfully:\n5\n"
    assert td["row"][1]["answer"] == td["answer"][1]  # the row travels with the conversation


def test_parallel_workers_give_the_same_messages_and_bad_options_fail_early(tiny_tokenizer):
    replies = ["```python\nprint('a')\n```", "```python\nprint('b')\n```\n```python\nprint('c')\n```"]
    messages = []
    for workers in (1, 3):
        env = ChatEnv(batch_size=[2]).append_transform(PythonInterpreter(max_workers=workers))
        td = env.reset(TensorDict({"query": ["x", "y"]}, batch_size=[2]))
        _, s_ = env.step_and_maybe_reset(act_history(td, replies))
        messages.append([chat[-1]["content"] for chat in s_["history"].prompt.to_chats()])
    assert (
        messages[0]
        == messages[1]
        == [
            "Code block 1 executed successfully:\na\n",
            "Code block 1 executed successfully:\nb\n\nCode block 2 executed successfully:\nc\n",
        ]
    )
    with pytest.raises(ValueError, match="timeout"):
        PythonInterpreter(timeout_sec=3)
