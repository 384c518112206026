"""MCPToolTransform against a real MCP server: tests/mcp_server.py, started over stdio by the
transform (the mcp package's client and server; no network)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs.chat import ChatEnv
from rlpost.envs.mcp_tools import MCPToolTransform

pytestmark = pytest.mark.integration

SERVER = str(Path(__file__).resolve().parents[2] / "mcp_server.py")


def server(**extra):
    return {"command": sys.executable, "args": [SERVER], **extra}


@pytest.fixture(scope="module")
def tools():
    transform = MCPToolTransform({"calc": server(), "other": server()}, timeout=2.0, max_workers=2)
    yield transform
    transform.close()


def step(env, td, replies):
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    full = prompt.append(History(role=["assistant"] * k, content=replies, batch_size=[k]), inplace=False)
    td.set("history", ChatHistory(prompt=prompt, full=full, batch_size=[k]))
    return env.step(td)


def tool_results(stepped):
    return [chat[-1]["content"] for chat in stepped["next", "history"].prompt.to_chats()]


def test_the_servers_tools_are_listed(tools):
    schemas = tools.tool_schemas
    assert sorted(schemas) == sorted(f"{s}.{t}" for s in ("calc", "other")
                                     for t in ("add", "count", "echo", "fail", "pid", "run_python_code", "sleep"))  # fmt: skip
    assert schemas["calc.add"]["description"] == "Add two integers."
    assert schemas["calc.add"]["parameters"]["required"] == ["a", "b"]


def test_calls_answer_as_tool_messages(tools):
    env = ChatEnv(batch_size=[3], max_steps=4).append_transform(tools)
    td = env.reset(TensorDict({"query": ["q"] * 3}, batch_size=[3]))
    stepped = step(env, td, [
        'Adding.\n<tool>calc.add\n{"a": 2, "b": 3}</tool>\n<tool>echo\n{"text": "hi"}</tool>',
        '<tool>calc.fail\n{"message": "boom"}</tool><tool>calc.nope\n{}</tool><tool>lost.add\n{}</tool>'
        "<tool>calc.add\nnot json</tool>",
        "No tool.",
    ])  # fmt: skip
    ok, failures, plain = tool_results(stepped)
    assert ok == "Tool calc.add executed successfully:\n5\nTool calc.echo executed successfully:\nhi"
    assert failures.split("\n") == [
        "Tool calc.fail failed:",
        "Error executing tool fail: boom",
        "Tool calc.nope failed:",
        "MCP server 'calc' has no tool 'nope' (tools: ['add', 'count', 'echo', 'fail', 'pid', 'run_python_code', 'sleep'])",
        "Tool lost.add failed:",
        "MCP server 'lost' not connected (servers: ['calc', 'other'])",
        "Tool calc.add failed:",
        "Failed to parse tool arguments: Expecting value: line 1 column 1 (char 0)",
    ]
    assert plain == "No tool."
    assert stepped["next", "tool_calls"].view(-1).tolist() == [2, 4, 0]
    assert stepped["next", "tool_errors"].view(-1).tolist() == [0, 4, 0]


def test_one_process_per_server_for_the_transforms_life(tools):
    env = ChatEnv(batch_size=[1], max_steps=10).append_transform(tools)
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    before = int(tool_results(step(env, td, ["<tool>calc.count\n{}</tool>"]))[0].split("\n")[1])
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    step(env, td, ['<tool>calc.echo\n{"text": "x"}</tool>'])
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    counts = tool_results(step(env, td, ["<tool>calc.count\n{}</tool><tool>other.count\n{}</tool><tool>calc.pid\n{}</tool>"
                                         "<tool>other.pid\n{}</tool>"]))[0].split("\n")  # fmt: skip
    assert int(counts[1]) == before + 1 and int(counts[3]) == 0  # the other server is another process
    assert counts[5] != counts[7] and int(counts[5]) != os.getpid()


def test_a_slow_tool_times_out_and_the_session_goes_on(tools):
    env = ChatEnv(batch_size=[1]).append_transform(tools)
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    start = time.monotonic()
    result = tool_results(
        step(env, td, ['<tool>calc.sleep\n{"seconds": 30}</tool><tool>calc.add\n{"a": 1, "b": 1}</tool>'])
    )
    assert time.monotonic() - start < 15
    assert result == [
        "Tool calc.sleep failed:\nTool execution timed out after 2.0s\nTool calc.add executed successfully:\n2"
    ]


@pytest.mark.long  # ~5 s; make test runs the same path in the compat port (test_mcp_python_execution)
def test_model_code_sent_to_the_server_runs_in_rlposts_sandbox():
    # its own transform: the server's first run imports rlpost, which takes longer than 2 s
    transform = MCPToolTransform({"python": server()}, timeout=60.0)
    env = ChatEnv(batch_size=[1]).append_transform(transform)
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    code = "import socket\nsocket.socket().connect(('127.0.0.1', 9))"
    (result,) = tool_results(step(env, td, [f"<tool>run_python_code\n{json.dumps({'python_code': code})}</tool>"]))
    env.close()
    assert result.startswith("Tool python.run_python_code executed successfully:\n<status>error</status>")
    assert result.endswith("<error>network disabled</error>")


def test_close_stops_the_server_process():
    transform = MCPToolTransform({"calc": server()}, timeout=5.0)
    env = ChatEnv(batch_size=[1]).append_transform(transform)
    td = env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    pid = int(tool_results(step(env, td, ["<tool>pid\n{}</tool>"]))[0].split("\n")[1])
    os.kill(pid, 0)  # alive
    env.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    transform.close()  # idempotent


def test_a_server_that_cannot_start_raises_at_construction():
    with pytest.raises(
        RuntimeError, match=r"could not connect to MCP server 'bad' \(/no/such/server\): FileNotFoundError"
    ):
        MCPToolTransform({"bad": {"command": "/no/such/server"}})
    with pytest.raises(RuntimeError, match=r"could not connect to MCP server 'dies' .*Connection closed"):
        MCPToolTransform({"dies": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]}})
    with pytest.raises(ValueError, match=r"servers\['x'\] has unknown keys \['cmd'\]"):
        MCPToolTransform({"x": {"command": "python", "cmd": "y"}})
    with pytest.raises(ValueError, match="must not contain '.'"):
        MCPToolTransform({"a.b": server()})
