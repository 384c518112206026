"""Tool services: ToolRegistry, the XML and JSON call parsers, ToolCall's tag, and
ExecuteToolsInOrder in a ChatEnv (order, message format, errors, stop_on_error, _state)."""

from __future__ import annotations

import json

import pytest
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs.chat import ChatEnv
from rlpost.envs.tool_parsers import JSONCallParser, XMLBlockParser
from rlpost.envs.tool_services import ExecuteToolsInOrder, ToolRegistry
from rlpost.envs.tool_transforms import HermesToolCallParser, PythonInterpreter, SimpleToolTransform, ToolCall

pytestmark = pytest.mark.unit


class Add:
    name, schema_in, schema_out = "add", {"a": int, "b": int}, {"result": int}

    def __init__(self):
        self.states = []

    def __call__(self, a, b, _state=None):
        self.states.append(_state)
        return {"result": a + b}


class Fails:
    name, schema_in, schema_out = "fails", {}, {}

    def __call__(self, **kwargs):
        raise ValueError("no index")


class Odd:
    """Returns what a service should not: a list, a dict with an error, a set."""

    name, schema_in, schema_out = "odd", {}, {}

    def __call__(self, kind, **kwargs):
        return {"list": [1], "error": {"error": "quota exceeded"}, "set": {"value": {3}}}[kind]


def step(env, replies):
    td = env.reset(TensorDict({"query": ["q"] * len(replies)}, batch_size=[len(replies)]))
    prompt = td["history"].prompt
    full = prompt.append(History(role=["assistant"] * len(replies), content=replies, batch_size=[len(replies)]),
                         inplace=False)  # fmt: skip
    td.set("history", ChatHistory(prompt=prompt, full=full, batch_size=[len(replies)]))
    return env.step(td)["next"]


def tool_env(*services, batch_size=1, **kwargs):
    transform = ExecuteToolsInOrder(ToolRegistry(list(services)), XMLBlockParser(), **kwargs)
    return ChatEnv(batch_size=[batch_size], max_steps=4).append_transform(transform)


# ------------------------------------------------------------------------------ registry, parsers


def test_registry_looks_up_by_name_and_names_the_unknown():
    add = Add()
    registry = ToolRegistry([add])
    assert registry.get("add") is add and "add" in registry and "fails" not in registry
    registry.register(Fails())
    assert sorted(registry) == ["add", "fails"] and len(registry) == 2
    with pytest.raises(KeyError, match="Unknown tool: search"):
        registry.get("search")


def test_xml_parser_reads_names_tags_and_bodies_in_order():
    text = 'Before <tool name="a" tag="T1">{"x": 1}</tool> mid <tool name="b"></tool>'
    text += '<tool name="c">{oops}</tool><tool name="d">[1, 2]</tool> after'
    result = XMLBlockParser()(text)
    assert result["text"] == "Before  mid  after"
    assert result["calls"] == [
        ToolCall("a", {"x": 1}, tag="T1"),
        ToolCall("b", {}),
        ToolCall("c", {"raw": "{oops}"}),
        ToolCall("d", {"raw": "[1, 2]"}),  # valid JSON but no object: raw too (deviation)
    ]
    assert result["meta"] == {"count": 4}
    assert XMLBlockParser()({"text": '<tool name="z">{}</tool>'})["calls"] == [ToolCall("z", {})]


def test_json_parser_reads_calls_and_reports_malformed_entries():
    parser = JSONCallParser()
    text = json.dumps({"message": "Searching.", "tools": [{"tool": "s", "args": {"q": "x"}, "tag": "A"},
                                                           {"tool": "t", "arguments": {}}, "junk"]})  # fmt: skip
    result = parser(text)
    good, unknown_key, junk = result["calls"]
    assert result["text"] == "Searching." and result["meta"] == {"count": 3}
    assert good == ToolCall("s", {"q": "x"}, tag="A")
    assert unknown_key.tool == "t" and unknown_key.error.startswith('invalid tool entry {"tool": "t", "arguments": {}}')
    assert junk.tool == "?" and junk.error.startswith('invalid tool entry "junk"')
    assert parser("plain words") == {"text": "plain words", "calls": [], "meta": {"count": 0}}
    assert parser("42") == {"text": "42", "calls": [], "meta": {"count": 0}}  # JSON, but not an object
    assert parser({"message": "hi"})["calls"] == []


def test_tool_call_keeps_rlposts_error_keyword_and_torchrls_tag():
    assert ToolCall("t", {"x": 1}, "label") == ToolCall(tool="t", args={"x": 1}, tag="label")
    assert ToolCall("t", {}).tag is None and ToolCall("t", {}).error is None
    with pytest.raises(TypeError):
        ToolCall("t", {}, None, "positional error")  # error is keyword-only: TorchRL's third field is tag


def test_simple_tool_transform_takes_the_xml_parser():
    tool = SimpleToolTransform({"x": "pool_functions:multiply"}, parser=XMLBlockParser())
    assert tool.find_calls('<tool name="x">{"a": 2}</tool>') == [ToolCall("x", {"a": 2})]
    assert HermesToolCallParser()('<tool_call>{"name": "x", "arguments": {}}</tool_call>')["calls"] == [
        ToolCall("x", {})
    ]


# ------------------------------------------------------------------------------ ExecuteToolsInOrder


def test_results_of_one_row_make_one_message_in_call_order():
    order = []

    class Named:
        schema_in = schema_out = {}

        def __init__(self, name):
            self.name = name

        def __call__(self, **kwargs):
            order.append(self.name)
            return {"ran": self.name}

    env = tool_env(Named("first"), Named("second"), Fails())
    reply = '<tool name="second">{}</tool><tool name="first" tag="B">{}</tool><tool name="fails">{}</tool>'
    next_td = step(env, [reply])
    assert order == ["second", "first"]
    message = next_td["history"].prompt.to_chats()[0][-1]
    assert message == {
        "role": "tool",
        "content": "<tool_results>\n"
        'Tool second (call 1) succeeded:\n  Result: {\n  "ran": "second"\n}\n'
        'Tool first (call 2) [tag: B] succeeded:\n  Result: {\n  "ran": "first"\n}\n'
        "Tool fails (call 3) failed:\n  Error: ValueError: no index\n"
        "</tool_results>",
    }
    assert next_td["tool_calls"].tolist() == [[3]] and next_td["tool_errors"].tolist() == [[1]]


def test_every_kind_of_failure_is_reported_and_counted():
    replies = [
        '<tool name="odd">{"kind": "list"}</tool>',
        '<tool name="odd">{"kind": "error"}</tool>',
        '<tool name="odd">{"kind": "set"}</tool>',  # JSON cannot encode a set: rendered with str
        '<tool name="missing">{}</tool><tool name="add">{"a": 1}</tool>',
        "No tools here.",
    ]
    next_td = step(tool_env(Odd(), Add(), batch_size=len(replies)), replies)
    contents = [chat[-1]["content"] for chat in next_td["history"].prompt.to_chats()]
    assert (
        contents[0]
        == "<tool_results>\nTool odd (call 1) failed:\n  Error: tool odd returned list, expected a dict\n</tool_results>"
    )
    assert contents[1] == "<tool_results>\nTool odd (call 1) failed:\n  Error: quota exceeded\n</tool_results>"
    assert (
        contents[2] == '<tool_results>\nTool odd (call 1) succeeded:\n  Result: {\n  "value": "{3}"\n}\n</tool_results>'
    )
    assert contents[3].startswith(
        "<tool_results>\nTool missing (call 1) failed:\n  Error: Unknown tool: missing (known: ['add', 'odd'])"
    )
    assert "Tool add (call 2) failed:\n  Error: TypeError: " in contents[3] and "'b'" in contents[3]
    assert contents[4] == "No tools here."  # the assistant's message: no tool message added
    assert next_td["tool_calls"].view(-1).tolist() == [1, 1, 1, 2, 0]
    assert next_td["tool_errors"].view(-1).tolist() == [1, 1, 0, 2, 0]


def test_stop_on_error_skips_the_calls_after_a_failure():
    reply = (
        '<tool name="add">{"a": 1, "b": 2}</tool><tool name="fails">{}</tool><tool name="add">{"a": 3, "b": 4}</tool>'
    )
    add = Add()
    next_td = step(tool_env(add, Fails(), stop_on_error=True), [reply])
    content = next_td["history"].prompt.to_chats()[0][-1]["content"]
    assert "(call 1) succeeded" in content and "(call 2) failed" in content and "(call 3)" not in content
    assert len(add.states) == 1 and next_td["tool_calls"].item() == 2
    next_td = step(tool_env(Add(), Fails()), [reply])
    assert "Tool add (call 3) succeeded" in next_td["history"].prompt.to_chats()[0][-1]["content"]


def test_services_get_the_rows_state_or_nothing():
    add = Add()
    env = tool_env(add, batch_size=2).append_transform(PythonInterpreter())
    step(env, ['<tool name="add">{"a": 1, "b": 2}</tool>', '<tool name="add">{"a": 5, "b": 5}</tool>'])
    first, second = add.states
    assert first["row"] == 0 and first["query"] == "q" and first["step_count"] == 0
    assert second["row"] == 1 and second["tool_episode"] == first["tool_episode"] + 1
    add = Add()
    step(tool_env(add, pass_state_to_tools=False), ['<tool name="add">{"a": 1, "b": 2}</tool>'])
    assert add.states == [None]


def test_rows_run_concurrently_with_the_same_messages():
    replies = [f'<tool name="add">{{"a": {i}, "b": 1}}</tool>' for i in range(4)]
    messages = []
    for workers in (1, 4):
        next_td = step(tool_env(Add(), batch_size=4, max_workers=workers), replies)
        messages.append([chat[-1]["content"] for chat in next_td["history"].prompt.to_chats()])
    assert messages[0] == messages[1]
    assert [json.loads(m.split("Result: ")[1].rsplit("\n</tool_results>")[0])["result"] for m in messages[0]] == [
        1,
        2,
        3,
        4,
    ]
