"""Tools in a ChatEnv: user functions (SimpleToolTransform, Hermes tool calls), the persistent
Python interpreter, StopWithoutToolCall, the tool counts, the function pool and the ``tools``
config section. Functions called in worker processes are in pool_functions (light to import)."""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest
from pool_functions import divide, hanging_reward, multiply, sleepy
from tensordict import TensorDict

from rlpost.config import ConfigError, validate_config
from rlpost.data import ChatHistory, History
from rlpost.data.samples import Group, Sample
from rlpost.envs import (
    ChatEnv,
    DatasetChatEnv,
    HermesToolCallParser,
    PythonInterpreter,
    SimpleToolTransform,
    StopWithoutToolCall,
    ToolArithmeticEnv,
    ToolCall,
    UserReward,
    make_env,
)
from rlpost.envs.function_pool import FunctionPool
from rlpost.ops.doctor import sandbox_check
from rlpost.record.metrics import episode_metrics

pytestmark = pytest.mark.unit


def respond(env, td, replies: list[str]):
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=replies, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)


def last_message(stepped, row=0):
    return stepped["next", "history"].prompt.to_chats()[row][-1]


def call(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ------------------------------------------------------------------------------ parsing


def test_hermes_parser_reads_calls_and_reports_bad_ones():
    parser = HermesToolCallParser()
    text = "Let me compute." + call("multiply", a=3, b=4)
    text += '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
    text += '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
    result = parser(text)
    assert result["text"] == "Let me compute."
    good, as_string, bad_json, no_name = result["calls"]
    assert good == ToolCall("multiply", {"a": 3, "b": 4})
    assert as_string == ToolCall("shout", {"text": "hi"})
    assert bad_json.error.startswith("invalid tool call '{not json}': JSONDecodeError")
    assert no_name.error.startswith("invalid tool call") and "KeyError" in no_name.error


# ------------------------------------------------------------------------------ user functions


@pytest.fixture(scope="module")
def pool():
    pool = FunctionPool(num_workers=2)
    yield pool
    pool.close()


def function_env(pool, batch_size=4, timeout=10.0):
    tools = {"multiply": multiply, "shout": "pool_functions:shout", "divide": divide, "sleepy": sleepy}
    env = ChatEnv(batch_size=[batch_size], max_steps=3)
    env = env.append_transform(SimpleToolTransform(tools, parser=HermesToolCallParser(), timeout=timeout, pool=pool,
                                             max_workers=2))  # fmt: skip
    return env.append_transform(StopWithoutToolCall())


def test_function_tools_answer_errors_and_timeouts_as_tool_messages(pool):
    env = function_env(pool, timeout=1.0)
    td = env.reset(TensorDict({"query": ["q"] * 4}, batch_size=[4]))
    replies = [
        call("multiply", a=4821, b=937) + call("shout", text="ok"),
        call("divide", a=1, b=0),
        call("nope") + call("sleepy", seconds=30),
        "no tool here <answer>1</answer>",
    ]
    start = time.monotonic()
    stepped = respond(env, td, replies)
    assert time.monotonic() - start < 20  # the sleeper was killed at its 1 s limit
    assert last_message(stepped, 0) == {
        "role": "tool", "content": "Tool multiply executed successfully:\n4517277\nTool shout executed successfully:\nOK",
    }  # fmt: skip
    assert last_message(stepped, 1) == {
        "role": "tool", "content": "Tool divide failed:\nZeroDivisionError: division by zero",
    }  # fmt: skip
    content = last_message(stepped, 2)["content"]
    assert content.startswith(
        "Tool nope failed:\nTool nope not found (known: ['divide', 'multiply', 'shout', 'sleepy'])"
    )
    assert content.endswith("Tool sleepy failed:\ntimeout after 1.0s")
    assert last_message(stepped, 3)["role"] == "assistant"  # no call, no tool message
    assert stepped["next", "tool_calls"].view(-1).tolist() == [2, 1, 2, 0]
    assert stepped["next", "tool_errors"].view(-1).tolist() == [0, 1, 2, 0]
    assert stepped["next", "tool_time_s"].view(-1)[2] >= 1.0
    # an episode whose turn called no tool ends; the others go on
    assert stepped["next", "done"].view(-1).tolist() == [False, False, False, True]
    assert stepped["next", "terminated"].view(-1).tolist() == [False, False, False, True]
    # the pool replaced the killed worker: calls still work
    assert pool.call(multiply, (6, 7), timeout_s=5).value == 42


def test_torchrl_default_tool_pattern(pool):
    env = ChatEnv(batch_size=[1]).append_transform(SimpleToolTransform({"multiply": multiply}, pool=pool))
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    stepped = respond(env, td, ['<tool>multiply\n{"a": 2, "b": 5}</tool>'])
    assert last_message(stepped)["content"] == "Tool multiply executed successfully:\n10"


def test_function_tools_refuse_what_cannot_reach_a_worker(pool):
    with pytest.raises(ValueError, match="module-level function"):
        pool.call(lambda: 1, timeout_s=1)
    with pytest.raises(ValueError, match="at least one tool"):
        SimpleToolTransform({}, pool=pool)


def test_function_pool_survives_a_dying_worker(pool):
    died = pool.call("os:_exit", (3,), timeout_s=5)
    assert (died.ok, died.error) == (False, "WorkerDied")
    result = pool.call("pool_functions:shout", ("x",), timeout_s=5)
    assert result.ok and result.value == "X"
    failed = pool.call(divide, (1, 0), timeout_s=5)
    assert failed.error == "ZeroDivisionError" and "in divide" in failed.traceback


# ------------------------------------------------------------------------------ reward functions


def test_a_hanging_reward_function_scores_zero_is_counted_and_logged_once(caplog):
    rows = [{"question": "q", "answer": "1"}]
    env = DatasetChatEnv(dataset=rows, num_envs=2, max_steps=1)
    env.append_transform(UserReward(hanging_reward, timeout_s=0.5))
    with caplog.at_level(logging.WARNING, logger="rlpost.envs.tasks"):
        for _ in range(2):
            td = env.reset()
            stepped = respond(env, td, ["fine", "hang"])
            assert stepped["next", "reward"].view(-1).tolist() == [1.0, 0.0]
    assert env.reward_errors == Counter({"Timeout": 2})
    warnings = [r for r in caplog.records if "hanging_reward" in r.getMessage()]
    assert len(warnings) == 1 and "Timeout" in warnings[0].getMessage()


# ------------------------------------------------------------------------------ persistent Python


def test_persistent_interpreter_keeps_an_episodes_names_and_ends_with_it():
    tool = PythonInterpreter(persistent=True, timeout_s=5.0)
    env = ChatEnv(batch_size=[2], max_steps=2).append_transform(tool)
    td = env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2]))
    stepped = respond(env, td, ["```python\nx = 6\nprint('set')\n```", "```python\nx = 7\n```"])
    assert len(tool.sessions) == 2
    td = stepped["next"]
    stepped = respond(env, td, ["```python\nprint(x * 7)\n```", "```python\nprint(x * 7)\n```"])
    # the last step ends both episodes (max_steps): their code is not run, their interpreters die
    assert tool.sessions == {} and stepped["next", "tool_calls"].view(-1).tolist() == [0, 0]
    # rows run on the transform's threads; the interpreters outlive the step that started them
    tool = PythonInterpreter(persistent=True, timeout_s=5.0, max_workers=2)
    env = ChatEnv(batch_size=[2], max_steps=3).append_transform(tool)
    td = env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2]))
    td = respond(env, td, ["```python\nx = 6\n```", "```python\nx = 5\n```"])["next"]
    time.sleep(0.5)
    stepped = respond(env, td, ["```python\nprint(x * 7)\n```"] * 2)
    assert [last_message(stepped, i)["content"] for i in range(2)] == [
        "Code block 1 executed successfully:\n42\n",
        "Code block 1 executed successfully:\n35\n",
    ]
    tool.close()
    assert tool.sessions == {}


def test_fresh_interpreters_do_not_share_names():
    env = ChatEnv(batch_size=[1], max_steps=3).append_transform(PythonInterpreter(timeout_s=5.0))
    td = env.reset(TensorDict({"query": ["a"]}, batch_size=[1]))
    td = respond(env, td, ["```python\nx = 6\n```"])["next"]
    stepped = respond(env, td, ["```python\nprint(x)\n```"])
    assert "NameError: name 'x' is not defined" in last_message(stepped)["content"]


# ------------------------------------------------------------------------------ config and make_env


def tools_config(**overrides):
    raw = {"data": {"task": "tool_arithmetic", "group_size": 2, "num_synthetic_rows": 10},
           "tools": {"python": {"enabled": True}}, "rollout": {"max_turns": 2}}  # fmt: skip
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return validate_config(raw)


def test_tools_config_checks():
    with pytest.raises(ConfigError, match="rollout.max_turns is 1"):
        tools_config(rollout={"max_turns": 1})
    with pytest.raises(ConfigError, match="tool_arithmetic needs the Python tool"):
        tools_config(tools={"python": {"enabled": False}})
    with pytest.raises(ConfigError, match="tools.sandbox"):
        tools_config(tools={"sandbox": "docker"})
    with pytest.raises(ConfigError, match="tools.python.timeout_s"):
        tools_config(tools={"python": {"enabled": True, "timeout_s": 0}})


def test_make_env_builds_the_tools_of_the_config(tiny_tokenizer):
    cfg = tools_config(
        tools={"functions": ["test_tool_transforms:multiply"], "python": {"enabled": True, "persistent": True}}
    )
    env = make_env(cfg, tiny_tokenizer, batch_size=2)
    assert isinstance(env, ToolArithmeticEnv) and env.max_steps == 2
    python, functions, stop = env.transforms[-3:]
    assert isinstance(python, PythonInterpreter) and python.persistent and python.run_kwargs["sandbox"] == "bwrap"
    assert isinstance(functions, SimpleToolTransform) and functions.tools == {
        "multiply": "test_tool_transforms:multiply"
    }
    assert isinstance(stop, StopWithoutToolCall)
    assert [t["function"]["name"] for t in env.template_kwargs["tools"]] == ["multiply"]  # shown to the model
    question = env.reset()["history"].prompt.to_chats()[0]
    assert question[0]["content"].startswith("Compute with a ```python block") and " * " in question[1]["content"]


def test_make_env_names_bad_tool_keys(tiny_tokenizer, monkeypatch):
    cfg = tools_config(tools={"functions": ["no_such_module_xyz:fn"]})
    with pytest.raises(ConfigError, match="tools.functions: tool function 'no_such_module_xyz:fn'"):
        make_env(cfg, tiny_tokenizer, batch_size=2)
    cfg = tools_config(tools={"functions": ["test_tool_transforms:divide"]})  # no docstring
    with pytest.raises(ConfigError, match="'test_tool_transforms:divide' cannot be described to the model"):
        make_env(cfg, tiny_tokenizer, batch_size=2)
    monkeypatch.setenv("RLPOST_BWRAP", "/bin/false")  # a host where namespaces do not work
    with pytest.raises(ConfigError, match="tools.sandbox=bwrap: the namespace sandbox"):
        make_env(tools_config(), tiny_tokenizer, batch_size=2)
    env = make_env(tools_config(tools={"sandbox": "guard"}), tiny_tokenizer, batch_size=2)  # asked for: runs
    assert env.transforms[-2].run_kwargs["sandbox"] == "guard"


def test_doctor_reports_the_sandbox():
    tools = tools_config()
    assert sandbox_check(tools, lambda: None).status == "ok"
    assert sandbox_check(tools, lambda: "user namespaces refused").status == "fail"
    assert sandbox_check(None, lambda: "user namespaces refused").status == "warn"
    guard = sandbox_check(tools_config(tools={"sandbox": "guard"}), lambda: None)
    assert guard.status == "warn" and "not a security boundary" in guard.detail


# ------------------------------------------------------------------------------ metrics


def sample(turns, calls, errors, seconds):
    return Sample(0, [1, 2], [0.0, -1.0], [False, True], 1, 1.0, 0, True, num_turns=turns, num_tool_calls=calls,
                  num_tool_errors=errors, tool_time_s=seconds)  # fmt: skip


def test_episode_metrics():
    groups = [
        Group(
            0,
            [sample(2, 1, 0, 0.5), sample(1, 0, 0, 0.0)],
            [1.0, -1.0],
            0,
            info={"reward_errors": {"Timeout": 2}, "num_length_truncated": 1},
        ),
        Group(1, [sample(3, 2, 1, 1.0), sample(2, 1, 1, 0.25)], [1.0, -1.0], 0, info={"reward_errors": {}}),
    ]
    assert episode_metrics(groups) == {
        "turns_mean": 2.0, "tool_calls_mean": 1.0, "tool_error_fraction": 0.5, "tool_time_s": 1.75,
        "reward_errors": 2, "length_truncated": 1,
    }  # fmt: skip
    assert episode_metrics([Group(0, [sample(1, 0, 0, 0.0)], [0.0], 0)])["tool_error_fraction"] == 0.0


def test_train_refuses_before_starting_actors_when_the_sandbox_cannot_run(monkeypatch, caplog):
    from rlpost.service.preflight import check_tools

    monkeypatch.setenv("RLPOST_BWRAP", "/bin/false")
    with pytest.raises(ConfigError, match="tools.sandbox=bwrap: the namespace sandbox .* tools.sandbox: guard"):
        check_tools(tools_config())
    with caplog.at_level(logging.INFO, logger="rlpost.service.preflight"):
        check_tools(tools_config(tools={"sandbox": "guard"}))  # asked for: runs, and the log says so
    assert "NOT a security boundary" in caplog.text
    check_tools(tools_config(tools={"python": {"enabled": False}}, data={"task": "arithmetic"}))  # no code: no check
