"""TorchRL's own tests of its tool layer, rewritten against rlpost.

From TorchRL's LLM transform tests: ToolRegistry, XMLBlockParser, JSONCallParser,
ExecuteToolsInOrder, ToolCall and IncrementalTokenizer; from its LLM env tests, the
PythonInterpreter tests (plain, persistent, persistent after an error, persistent across a reset),
the SimpleToolTransform calculator test, the AsyncEnvPool of tool envs and the MCP
Python-execution test. Substitutions: rlpost's imports; the offline tiny model's tokenizer for
GPT-2's and Qwen2.5-3B's; the calculator as module-level functions (calculator_tools.py: rlpost
runs tool functions in worker processes); the local MCP server of tests/mcp_server.py (which runs
code in rlpost's sandbox) for ``uvx mcp-run-python`` (Deno, network). Where rlpost differs on
purpose the assertion says so.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from calculator_tools import CALCULATOR_SCHEMA, calculator, delayed_calculator
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from rlpost.data import History
from rlpost.envs.async_pool import AsyncEnvPool
from rlpost.envs.chat import ChatEnv
from rlpost.envs.incremental_tokenizer import IncrementalTokenizer
from rlpost.envs.mcp_tools import MCPToolTransform
from rlpost.envs.tool_parsers import JSONCallParser, XMLBlockParser
from rlpost.envs.tool_services import ExecuteToolsInOrder, ToolRegistry
from rlpost.envs.tool_transforms import PythonInterpreter, SimpleToolTransform, ToolCall
from rlpost.envs.transforms import TransformedEnv

pytestmark = pytest.mark.compat

MCP_SERVER = str(Path(__file__).resolve().parents[1] / "mcp_server.py")


@pytest.fixture(scope="module", autouse=True)
def list_to_stack():
    with set_list_to_stack(True):
        yield


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


class Service:
    """A service named ``name`` whose call is ``fn(**kwargs)``."""

    schema_in: dict = {}
    schema_out: dict = {}

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, **kwargs):
        return self.fn(**kwargs)


def tool_env(*services, **kwargs):
    env = ChatEnv(batch_size=(1,), input_mode="history")
    return TransformedEnv(
        env, ExecuteToolsInOrder(registry=ToolRegistry(list(services)), parser=XMLBlockParser(), **kwargs)
    )


def respond(env, query, llm_response):
    obs = env.reset(TensorDict({"query": query}, batch_size=(1,)))
    obs["history"].full = obs["history"].prompt.extend(
        History(role="assistant", content=llm_response).view(1, 1), dim=-1
    )
    return obs, env.step(obs)


# ------------------------------------------------------------------------------ ToolRegistry


class TestToolRegistry:
    def test_register_and_get(self):
        registry = ToolRegistry([Service("dummy", lambda x, **kw: {"y": x * 2})])
        retrieved = registry.get("dummy")
        assert retrieved.name == "dummy" and retrieved(x=5)["y"] == 10

    def test_register_after_init(self):
        registry = ToolRegistry([Service("a", lambda **kw: {"result": "a"})])
        assert "a" in registry and "b" not in registry
        registry.register(Service("b", lambda **kw: {"result": "b"}))
        assert "b" in registry

    def test_unknown_tool_raises_error(self):
        with pytest.raises(KeyError, match="Unknown tool: nonexistent"):
            ToolRegistry().get("nonexistent")


# ------------------------------------------------------------------------------ parsers


class TestXMLBlockParser:
    def test_parse_single_tool(self):
        result = XMLBlockParser()('<tool name="search">{"query": "test"}</tool>')
        assert result["text"] == "" and len(result["calls"]) == 1
        call = result["calls"][0]
        assert (call.tool, call.args, call.tag) == ("search", {"query": "test"}, None)

    def test_parse_multiple_tools(self):
        response = (
            'Some text\n<tool name="search" tag="A">{"query": "first"}</tool>\nMore text\n'
            '<tool name="calculate">{"expr": "1+1"}</tool>\nFinal text'
        )
        result = XMLBlockParser()(response)
        assert result["text"] == "Some text\n\nMore text\n\nFinal text"
        assert [(c.tool, c.tag) for c in result["calls"]] == [("search", "A"), ("calculate", None)]

    def test_parse_with_tag(self):
        assert XMLBlockParser()('<tool name="test" tag="my_tag">{"a": 1}</tool>')["calls"][0].tag == "my_tag"

    def test_parse_invalid_json(self):
        calls = XMLBlockParser()('<tool name="test">{invalid json}</tool>')["calls"]
        assert len(calls) == 1 and calls[0].args == {"raw": "{invalid json}"}

    def test_parse_empty_body(self):
        calls = XMLBlockParser()('<tool name="test"></tool>')["calls"]
        assert len(calls) == 1 and calls[0].args == {}


class TestJSONCallParser:
    def test_parse_dict_response(self):
        result = JSONCallParser()(
            {"message": "Here's the result", "tools": [{"tool": "search", "args": {"query": "test"}}]}
        )
        assert result["text"] == "Here's the result"
        assert result["calls"] == [ToolCall("search", {"query": "test"})]

    def test_parse_json_string(self):
        response = json.dumps({"message": "Processing", "tools": [
            {"tool": "calc", "args": {"expr": "1+1"}}, {"tool": "search", "args": {"q": "test"}, "tag": "T1"},
        ]})  # fmt: skip
        result = JSONCallParser()(response)
        assert len(result["calls"]) == 2 and result["calls"][1].tag == "T1"

    def test_parse_invalid_json_string(self):
        result = JSONCallParser()("Not valid JSON")
        assert result["text"] == "Not valid JSON" and result["calls"] == []

    def test_parse_no_tools(self):
        result = JSONCallParser()({"message": "Just a message"})
        assert result["text"] == "Just a message" and result["calls"] == []


# ------------------------------------------------------------------------------ ExecuteToolsInOrder


class TestExecuteToolsInOrder:
    def test_basic_tool_execution(self):
        env = tool_env(Service("add", lambda a, b, **kw: {"result": a + b}))
        obs, next_obs = respond(env, "Calculate something", '<tool name="add">{"a": 3, "b": 5}</tool>')
        final_history = next_obs[("next", "history")].prompt
        assert len(final_history[0]) == len(obs["history"].prompt[0]) + 1
        tool_messages = [msg for msg in final_history.to_chats()[0] if msg["role"] == "tool"]
        assert tool_messages == [{
            "role": "tool",
            "content": '<tool_results>\nTool add (call 1) succeeded:\n  Result: {\n  "result": 8\n}\n</tool_results>',
        }]  # fmt: skip

    def test_multiple_tools_in_order(self):
        order = []

        def record(name):
            return Service(name, lambda **kw: order.append(name) or {"executed": name})

        env = tool_env(record("first"), record("second"), record("third"))
        respond(
            env, "Test", '\n<tool name="second">{}</tool>\n<tool name="first">{}</tool>\n<tool name="third">{}</tool>\n'
        )
        assert order == ["second", "first", "third"]

    def test_error_handling_continue(self):
        def failing(**kwargs):
            raise ValueError("Intentional failure")

        env = tool_env(
            Service("working", lambda **kw: {"status": "ok"}), Service("failing", failing), stop_on_error=False
        )
        reply = '\n<tool name="working">{}</tool>\n<tool name="failing">{}</tool>\n<tool name="working">{}</tool>\n'
        _, next_obs = respond(env, "Test", reply)
        content = next_obs["next", "history"].prompt.to_chats()[0][-1]["content"]
        assert content.count("succeeded") == 2
        # rlpost names the exception's type (TorchRL: its message alone)
        assert "Tool failing (call 2) failed:\n  Error: ValueError: Intentional failure" in content
        assert "Tool working (call 3) succeeded" in content

    def test_state_passing_to_tools(self):
        received = {}

        def check(_state=None, **kwargs):
            received["state"] = _state
            return {"received_state": _state is not None}

        env = tool_env(Service("check", check), pass_state_to_tools=True)
        respond(env, "Check state", '<tool name="check">{}</tool>')
        assert isinstance(received["state"], dict)
        # rlpost passes the row's state (TorchRL: an empty dict)
        assert received["state"]["row"] == 0 and received["state"]["query"] == "Check state"

    def test_no_tools_in_response(self):
        env = tool_env(Service("dummy", lambda **kw: {}))
        _, next_obs = respond(env, "Just chat", "Just a normal response without tools.")
        assert [msg["role"] for msg in next_obs["next", "history"].prompt.to_chats()[0]] == ["user", "assistant"]


class TestToolCall:
    def test_creation(self):
        call = ToolCall(tool="test", args={"x": 1})
        assert (call.tool, call.args, call.tag) == ("test", {"x": 1}, None)

    def test_with_tag(self):
        assert ToolCall(tool="test", args={}, tag="my_tag").tag == "my_tag"


# ------------------------------------------------------------------------------ IncrementalTokenizer


def tokenized_env(tokenizer, **kwargs):
    return TransformedEnv(ChatEnv(tokenizer=tokenizer, **kwargs), IncrementalTokenizer(tokenizer))


def with_reply(td, *messages):
    """The step input: ``td`` whose history.full is its prompt followed by ``messages``."""
    history = td.get(("history", "prompt"))
    for role, content in messages:
        history = history.extend(History(role=role, content=content, batch_size=1).unsqueeze(0), inplace=False, dim=-1)
    action = td.clone()
    action.set(("history", "full"), history)
    return action


class TestIncrementalTokenizer:
    def test_reset_tokenizes_history(self, tokenizer):
        env = tokenized_env(tokenizer, batch_size=(1,), system_prompt="You are a helpful assistant.")
        result = env.reset(TensorDict({"query": "Hello, how are you?"}, batch_size=(1,)))
        tokens = result.get(("tokens", "prompt"), as_list=True)
        assert len(tokens) == 1 and tokens[0].ndim == 1 and tokens[0].numel() > 0
        decoded = tokenizer.decode(tokens[0], skip_special_tokens=False)
        assert "You are a helpful assistant." in decoded and "Hello, how are you?" in decoded

    def test_reset_tokenizes_batched_history(self, tokenizer):
        queries = ["Hello!", "What is the weather?"]
        env = tokenized_env(tokenizer, batch_size=(2,), system_prompt="You are a helpful assistant.")
        tokens = env.reset(TensorDict({"query": queries}, batch_size=(2,))).get(("tokens", "prompt"), as_list=True)
        assert len(tokens) == 2
        for ids, query in zip(tokens, queries):
            decoded = tokenizer.decode(ids, skip_special_tokens=False)
            assert "You are a helpful assistant." in decoded and query in decoded

    def test_step_incremental_tokenization(self, tokenizer):
        env = tokenized_env(tokenizer, batch_size=(1,))
        result = env.reset(TensorDict({"query": "Hello"}, batch_size=(1,)))
        initial = result.get(("tokens", "prompt"), as_list=True)
        assert "Hello" in tokenizer.decode(initial[0], skip_special_tokens=False)
        next_td = env.step(with_reply(result, ("assistant", "Hi there! How can I help you?")))["next"]
        new = next_td.get(("tokens", "prompt"), as_list=True)
        assert new[0].numel() > initial[0].numel()
        decoded = tokenizer.decode(new[0], skip_special_tokens=False)
        assert "Hello" in decoded and "Hi there! How can I help you?" in decoded

    def test_with_tokenizer_constructor_arg(self, tokenizer):
        env = ChatEnv(tokenizer=tokenizer, batch_size=(1,), system_prompt="You are a helpful assistant.",
                      with_tokenizer=True)  # fmt: skip
        assert isinstance(env, TransformedEnv)
        # rlpost's env.transform is always a Compose (TorchRL's is the one transform itself)
        assert len(env.transform) == 1 and isinstance(env.transform[0], IncrementalTokenizer)
        result = env.reset(TensorDict({"query": "Hello!"}, batch_size=(1,)))
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )  # fmt: skip
        assert result.get(("tokens", "prompt"), as_list=True)[0].tolist() == list(expected)

    def test_with_tokenizer_provides_tokens(self, tokenizer):
        env = ChatEnv.with_tokenizer(tokenizer=tokenizer, batch_size=(1,))
        result = env.reset(TensorDict({"query": "Test"}, batch_size=(1,)))
        ids = result.get(("tokens", "prompt"), as_list=True)[0]
        assert "Test" in tokenizer.decode(ids, skip_special_tokens=False)
        with pytest.raises(ValueError, match="tokenizer must be provided"):
            ChatEnv(batch_size=(1,), with_tokenizer=True)

    def test_tokens_consistency_across_multiple_steps(self, tokenizer):
        env = tokenized_env(tokenizer, batch_size=(1,))  # TorchRL: ChatEnv.with_tokenizer(...)
        result = env.reset(TensorDict({"query": "What is 2+2?"}, batch_size=(1,)))
        next1 = env.step(with_reply(result, ("assistant", "The answer is 4.")))["next"]
        tokens1 = next1.get(("tokens", "prompt"), as_list=True)[0]
        action2 = with_reply(next1, ("user", "And what is 3+3?"), ("assistant", "That would be 6."))
        action2.set(("history", "prompt"), action2.get(("history", "full"))[..., :-1])
        tokens2 = env.step(action2)["next"].get(("tokens", "prompt"), as_list=True)[0]
        assert tokens2.numel() > tokens1.numel()
        decoded = tokenizer.decode(tokens2, skip_special_tokens=True)
        assert "2+2" in decoded and "3+3" in decoded

    def test_incremental_tokenizer_spec_transform(self, tokenizer):
        env = ChatEnv(batch_size=(1,), tokenizer=tokenizer)
        transform = IncrementalTokenizer(tokenizer)
        env = TransformedEnv(env, transform)
        # The spec should include tokens.prompt
        obs_spec = env.observation_spec
        assert ("tokens", "prompt") in obs_spec.keys(True, True)
        # rlpost: int64 ids of any length per row (TorchRL: Bounded in [0, vocab_size)), which
        # the reset output satisfies; the base env's own spec is left as it was
        assert obs_spec["tokens", "prompt"].shape == (1, -1) and obs_spec["tokens", "prompt"].dtype == torch.int64
        assert obs_spec.is_in(env.reset(TensorDict({"query": "Hello"}, batch_size=(1,))).select("tokens"))
        assert ("tokens", "prompt") not in env.base_env.observation_spec.keys(True, True)

    def test_custom_keys(self, tokenizer):
        env = TransformedEnv(ChatEnv(batch_size=(1,), tokenizer=tokenizer), IncrementalTokenizer(
            tokenizer, history_key=("history", "prompt"), tokens_key=("my_tokens", "all")))  # fmt: skip
        result = env.reset(TensorDict({"query": "Hello"}, batch_size=(1,)))
        assert ("my_tokens", "all") in result.keys(True, True)

    def test_empty_history_handling(self, tokenizer):
        env = tokenized_env(tokenizer, batch_size=(1,))
        tokens = env.reset(TensorDict({"query": "Hi"}, batch_size=(1,))).get(("tokens", "prompt"), as_list=True)
        assert tokens[0].numel() > 0


# ------------------------------------------------------------------------------ PythonInterpreter and MCP


def python_env(tokenizer, **kwargs):
    env = ChatEnv(
        batch_size=(1,), system_prompt="I'm the system, do as I say", tokenizer=tokenizer, input_mode="history"
    )
    return env.append_transform(PythonInterpreter(**kwargs))


def code_reply(td, code):
    td["history"].full = td["history"].prompt.extend(
        History(role="assistant", content=f"Here is a python code to execute:\n```python\n{code}\n```").view(1, 1),
        dim=-1, inplace=False,
    )  # fmt: skip
    return td


HEAD = (
    "<|im_start|>system\nI'm the system, do as I say<|im_end|>\n"
    "<|im_start|>user\nThis is the user prompt<|im_end|>\n<|im_start|>assistant\n"
)


def turn(code, result):
    """One assistant turn and its tool result, as the tiny model's (Qwen ChatML) template renders
    them: the tool message as a user turn in <tool_response> (TorchRL's Qwen2.5-3B shows the same)."""
    return (
        f"Here is a python code to execute:\n```python\n{code}\n```<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


class TestTools:
    def test_python_interpreter_single_batch(self, tokenizer):
        env = python_env(tokenizer)
        r = env.reset(TensorDict({"query": ["This is the user prompt"]}, batch_size=(1,)))
        rc = r.clone()
        assert r["history"].prompt.apply_chat_template(tokenizer=tokenizer) == [HEAD]
        s = env.step(code_reply(r, "print(1 + 1)"))
        rendered = s["next", "history"].prompt.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True)
        assert rendered == [HEAD + turn("print(1 + 1)", "Code block 1 executed successfully:\n2\n")]
        assert s["next", "history"].prompt.to_chats()[0][-1] == {
            "role": "tool", "content": "Code block 1 executed successfully:\n2\n",
        }  # fmt: skip
        # without code there is no tool response
        r = rc.clone()
        r["history"].full = r["history"].prompt.extend(
            History(role="assistant", content="Here is a response without a python code to execute.").view(1, 1),
            dim=-1, inplace=False,
        )  # fmt: skip
        s = env.step(r)
        assert s["next", "history"].prompt.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True) == [
            HEAD + "Here is a response without a python code to execute.<|im_end|>\n<|im_start|>assistant\n"
        ]

    def test_python_interpreter_persistent(self, tokenizer):
        env = python_env(tokenizer, persistent=True)
        r = env.reset(TensorDict({"query": ["This is the user prompt"]}, batch_size=(1,)))
        _, s_ = env.step_and_maybe_reset(code_reply(r, "a=1"))
        _, s_ = env.step_and_maybe_reset(code_reply(s_, "a+=1\nassert a == 2"))
        assert s_["history"].prompt.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True) == [
            HEAD + turn("a=1", "Code block 1 executed successfully:\n")
            + turn("a+=1\nassert a == 2", "Code block 1 executed successfully:\n")
        ]  # fmt: skip
        env.close()

    def test_python_interpreter_persistent_error(self, tokenizer):
        env = python_env(tokenizer, persistent=True)
        r = env.reset(TensorDict({"query": ["This is the user prompt"]}, batch_size=(1,)))
        _, s_ = env.step_and_maybe_reset(code_reply(r, "raise ValueError('This is an error')"))
        _, s_ = env.step_and_maybe_reset(code_reply(s_, "a=1\nassert a == 1"))
        tool_messages = [m["content"] for m in s_["history"].prompt.to_chats()[0] if m["role"] == "tool"]
        # rlpost: the one-line reason, then the output with the traceback (TorchRL: its stderr)
        assert tool_messages[0].startswith("Code block 1 failed:\nValueError: This is an error\n")
        assert "Traceback (most recent call last):" in tool_messages[0]
        assert tool_messages[1] == "Code block 1 executed successfully:\n"  # the interpreter survived the error
        env.close()

    def test_python_interpreter_persistent_reset(self, tokenizer):
        env = python_env(tokenizer, persistent=True)
        r = env.reset(TensorDict({"query": ["This is the user prompt"]}, batch_size=(1,)))
        env.step_and_maybe_reset(code_reply(r, "a = [0]"))
        r = env.reset(TensorDict({"query": ["This is the user prompt"]}, batch_size=(1,)))
        code = (
            "# check if a is still defined\nif 'a' in globals():\n    raise RuntimeError('a is still defined')\n"
            "else:\n    print('a is not defined')"
        )
        _, s_ = env.step_and_maybe_reset(code_reply(r, code))
        assert s_["history"].prompt.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True) == [
            HEAD + turn(code, "Code block 1 executed successfully:\na is not defined\n")
        ]
        env.close()

    def test_mcp_python_execution(self, tokenizer):
        servers = {"python": {"command": sys.executable, "args": [MCP_SERVER]}}  # TorchRL: uvx mcp-run-python stdio
        env = ChatEnv(batch_size=(1,), system_prompt="You are a helpful assistant", tokenizer=tokenizer)
        env = env.append_transform(MCPToolTransform(servers=servers, timeout=60.0))
        td = env.reset(TensorDict(query=["You are a useful assistant"], batch_size=(1,)))
        history = td.get("history")
        code = '\nimport math\nresult = math.sqrt(144) + math.pi\nprint(f"Result: {result}")\nresult\n'
        response = (
            History(
                role="assistant",
                content=f"Let me calculate that.\n<tool>python.run_python_code\n{json.dumps({'python_code': code})}</tool>",
            )
            .unsqueeze(0)
            .unsqueeze(0)
        )
        history.full = history.prompt.extend(response, inplace=True, dim=-1)
        history.response = response
        result = env.step(td.set("history", history))
        env.close()
        final_history = result["next", "history"].prompt
        assert len(final_history[0]) == 4  # system, user, assistant, tool response
        tool_message = final_history.to_chats()[0][-1]
        assert tool_message["role"] == "tool"
        assert "python.run_python_code executed successfully" in tool_message["content"]
        assert "Result: 15.141592653589793" in tool_message["content"]

    def test_mcp_tool_transform(self, tokenizer):
        """TorchRL's SimpleToolTransform calculator: dict results, two calls in one reply, a tool
        that raises and arguments that are not JSON, each reported in the tool message.

        Deviation: the two calls of one reply make one tool message holding both results in
        order (TorchRL: one message per call), as every rlpost tool transform does. A tool's
        exception is reported as ``ValueError: ...`` (TorchRL: ``Tool execution failed: ...``)."""
        base_env = ChatEnv(
            batch_size=(1,), system_prompt="You are a helpful assistant that uses a calculator.", tokenizer=tokenizer
        )
        env = base_env.append_transform(
            SimpleToolTransform({"calculator": calculator}, {"calculator": CALCULATOR_SCHEMA})
        )

        def step(query, content):
            td = env.reset(TensorDict({base_env.data_key: [query]}, batch_size=(1,)))
            td["history"].full = td["history"].prompt.extend(
                History(role="assistant", content=content).view(1, 1), dim=-1
            )
            result = env.step(td)
            return result["next", "history"].prompt, result

        add = '<tool>calculator\n{"operation": "add", "a": 2, "b": 3}</tool>'
        history, _ = step("Let me calculate 2 + 3", f"I will help you calculate 2 + 3:\n{add}<|im_end|>")
        assert len(history[0]) == 4  # system, user, assistant, tool response
        assert history[0, -1].role == "tool"
        assert "result': 5" in history[0, -1].content
        assert history[0, -1].content == "Tool calculator executed successfully:\n{'result': 5}"

        multiply = '<tool>calculator\n{"operation": "multiply", "a": 4, "b": 5}</tool>'
        history, result = step(
            "Calculate 2 + 3 and 4 * 5", f"I will help you calculate both:\n{add}\n{multiply}<|im_end|>"
        )
        assert len(history[0]) == 4  # deviation: TorchRL has 5, one tool message per call
        assert history[0, -1].role == "tool" and history[0, -2].role == "assistant"
        assert history[0, -1].content == (
            "Tool calculator executed successfully:\n{'result': 5}\n"
            "Tool calculator executed successfully:\n{'result': 20}"
        )
        assert result["next", "tool_calls"].tolist() == [[2]] and result["next", "tool_errors"].tolist() == [[0]]

        invalid = '<tool>calculator\n{"operation": "invalid", "a": 2, "b": 3}</tool>'
        history, _ = step("Calculate 2 ? 3", f"I will try to calculate:\n{invalid}<|im_end|>")
        assert len(history[0]) == 4
        assert history[0, -1].role == "tool"
        assert "failed" in history[0, -1].content
        assert "Unknown operation: invalid" in history[0, -1].content
        assert history[0, -1].content == "Tool calculator failed:\nValueError: Unknown operation: invalid"

        history, result = step(
            "Calculate something", "Let me calculate:\n<tool>calculator\ninvalid json</tool><|im_end|>"
        )
        assert len(history[0]) == 4
        assert history[0, -1].role == "tool"
        assert "failed" in history[0, -1].content
        assert "Failed to parse tool arguments" in history[0, -1].content
        assert history[0, -1].content.startswith("Tool calculator failed:\nFailed to parse tool arguments: Expecting")
        assert result["next", "tool_errors"].tolist() == [[1]]
        env.close()

    @staticmethod
    def calculator_env(tokenizer):
        env = ChatEnv(batch_size=(1,), system_prompt="I'm a calculator assistant", tokenizer=tokenizer)
        tools, schemas = {"calculator": delayed_calculator}, {"calculator": CALCULATOR_SCHEMA}
        return env.append_transform(SimpleToolTransform(tools, schemas))

    @staticmethod
    def calculator_replies(td):
        """The pool's reset ``td`` with each row's assistant turn calling the calculator."""
        replies = [
            'Let me calculate 2 + 3:\n<tool>calculator\n{"operation": "add", "a": 2, "b": 3}</tool><|im_end|>',
            'Let me calculate 4 * 5:\n<tool>calculator\n{"operation": "multiply", "a": 4, "b": 5}</tool><|im_end|>',
        ]
        td["history"].full = torch.stack(
            [
                td[i]["history"].prompt.extend(History(role="assistant", content=reply).view(1), dim=-1)
                for i, reply in enumerate(replies)
            ]
        )
        return td

    def test_async_mcp_tools(self, tokenizer):
        """TorchRL's AsyncEnvPool of two calculator envs whose tool waits 0.1 to 0.3 s: send a
        step to both with ``async_step_send``, take the first result as soon as it is there with
        ``async_step_recv(min_get=1)``, then the other; each row's tool message holds its own result.

        Deviations (see rlpost.envs.async_pool): the sub-envs run on threads (TorchRL's test asks
        for ``backend="multiprocessing"``, which rlpost refuses on purpose); the pool's rows are
        ``[2]`` (TorchRL: ``[2, 1]``, the sub-envs' batch kept), so the reset query is one string
        per row and ``history[i]`` is row ``i`` (TorchRL: ``history[i, 0]``)."""
        make_env = partial(self.calculator_env, tokenizer)
        with pytest.raises(ValueError, match="backend='threading' only"):
            AsyncEnvPool([make_env, make_env], backend="multiprocessing")
        env_pool = AsyncEnvPool([make_env, make_env])  # TorchRL: backend="multiprocessing"
        try:
            # Reset both environments
            tdreset = TensorDict(query=["Let me calculate 2 + 3", "Let me calculate 4 * 5"], batch_size=(2,))
            td = env_pool.reset(tdreset)

            # Send async steps to both environments
            env_pool.async_step_send(self.calculator_replies(td))

            # Get results as they complete
            results = env_pool.async_step_recv(min_get=1)  # Get at least one result
            assert len(results) >= 1  # We should get at least one result

            # Get remaining results
            if len(results) < 2:
                remaining = env_pool.async_step_recv()
            else:
                remaining = []

            # Combine results
            all_results = torch.stack(list(results) + list(remaining))

            # Verify results
            history = all_results["next", "history"].prompt
            assert len(history[0]) == 4  # system, user, assistant, tool response
            assert history[0, -1].role == "tool"
            assert any("result': 5" in c for c in history[:, -1].content)  # 2 + 3 = 5
            assert any("result': 20" in c for c in history[:, -1].content)  # 4 * 5 = 20
            # rlpost: each row says its sub-env, whose own result it holds
            by_env = dict(zip(all_results["env_index"].tolist(), history[:, -1].content))
            assert by_env[0].startswith("Tool calculator executed successfully:\n{'result': 5, 'delay': ")
            assert by_env[1].startswith("Tool calculator executed successfully:\n{'result': 20, 'delay': ")
        finally:
            env_pool.close()

    def test_async_mcp_tools_step_and_maybe_reset(self, tokenizer):
        """The same pool through ``async_step_and_maybe_reset_send`` / ``_recv`` (what the LLM
        collector uses): the steps, and the next roots whose prompts end with the tool message."""
        make_env = partial(self.calculator_env, tokenizer)
        env_pool = AsyncEnvPool([make_env, make_env])
        try:
            tdreset = TensorDict(query=["Let me calculate 2 + 3", "Let me calculate 4 * 5"], batch_size=(2,))
            env_pool.async_step_and_maybe_reset_send(self.calculator_replies(env_pool.reset(tdreset)))
            results, roots = env_pool.async_step_and_maybe_reset_recv(min_get=1)  # at least one result
            assert len(results) >= 1
            rows, root_rows = list(results.unbind(0)), list(roots.unbind(0))
            if len(rows) < 2:  # the remaining result
                more, more_roots = env_pool.async_step_and_maybe_reset_recv()
                rows, root_rows = rows + list(more.unbind(0)), root_rows + list(more_roots.unbind(0))
            all_results, all_roots = lazy_stack(rows), lazy_stack(root_rows)
            history = all_results["next", "history"].prompt
            assert history[0, -1].role == "tool" and history[1, -1].role == "tool"
            by_env = dict(zip(all_results["env_index"].tolist(), history[:, -1].content))
            assert "'result': 5," in by_env[0] and "'result': 20," in by_env[1]
            assert all_roots["env_index"].tolist() == all_results["env_index"].tolist()
            assert all_roots["history"].prompt[:, -1].content == history[:, -1].content
        finally:
            env_pool.close()
