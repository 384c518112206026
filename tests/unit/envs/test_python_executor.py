"""PythonExecutorService (sandboxed, bounded, TorchRL's result dict) and PythonInterpreter's
TorchRL constructor: tool_name, timeout, services (local object, a Ray actor by name), clone,
and the interpreters of a batch that starts over."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs.chat import ChatEnv
from rlpost.envs.python_executor import (
    PythonExecutorService,
    RayExecutorHandle,
    execution_dict,
    result_from_execution,
)
from rlpost.envs.tool_transforms import DEFAULT_PYTHON_TIMEOUT_S, PythonInterpreter
from rlpost.envs.tools import PythonResult

pytestmark = pytest.mark.unit


def step(env, replies, td=None):
    td = td if td is not None else env.reset(TensorDict({"query": ["q"] * len(replies)}, batch_size=[len(replies)]))
    prompt = td["history"].prompt
    full = prompt.append(History(role=["assistant"] * len(replies), content=replies, batch_size=[len(replies)]),
                         inplace=False)  # fmt: skip
    td.set("history", ChatHistory(prompt=prompt, full=full, batch_size=[len(replies)]))
    return env.step(td)


def tool_message(stepped, row=0):
    return stepped["next", "history"].prompt.to_chats()[row][-1]


# ------------------------------------------------------------------------------ the service


def test_service_runs_blocks_in_the_sandbox_and_returns_torchrls_dict():
    service = PythonExecutorService(pool_size=2, timeout=2.0)
    ok = service.execute("print(6 * 7)")
    assert {key: ok[key] for key in ("success", "stdout", "stderr", "returncode")} == {
        "success": True, "stdout": "42\n", "stderr": "", "returncode": 0,
    }  # fmt: skip
    assert service.execute("import socket; socket.socket().connect(('127.0.0.1', 9))")["stderr"] == "network disabled"
    assert service.execute("open('/etc/rlpost-probe', 'w')")["stderr"].startswith("write outside working directory")
    slow = service.execute("while True: pass")
    assert (slow["success"], slow["stderr"]) == (False, "timeout after 2.0s")
    # a fresh interpreter per block: nothing one caller defined reaches the next
    service.execute("secret = 1")
    assert "NameError" in service.execute("print(secret)")["stderr"]
    assert service.num_executed == 6


def test_service_runs_at_most_pool_size_blocks_at_once(monkeypatch):
    module = sys.modules[PythonExecutorService.__module__]
    service = PythonExecutorService(pool_size=2, timeout=5.0)
    running, peak, lock = [0], [0], threading.Lock()
    real_run = module.run_python

    def counting_run(code, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real_run(code, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(module, "run_python", counting_run)
    threads = [threading.Thread(target=service.execute, args=("import time; time.sleep(0.3)",)) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak[0] == 2 and service.num_executed == 5


def test_result_dict_round_trip_and_bad_options():
    result = PythonResult(False, "partial\n", "ZeroDivisionError: division by zero", 1, 0.25)
    assert result_from_execution(execution_dict(result)) == result
    torchrl_style = {"success": False, "stdout": "", "stderr": "", "returncode": -1}
    assert result_from_execution(torchrl_style) == PythonResult(False, "", "failed", -1, 0.0)
    with pytest.raises(ValueError, match="pool_size"):
        PythonExecutorService(pool_size=0)
    with pytest.raises(ValueError, match="timeout="):
        PythonExecutorService(timeout_s=3)
    with pytest.raises(ValueError, match="bad run_python options"):
        PythonExecutorService(memory=3)


# ------------------------------------------------------------------------------ PythonInterpreter's TorchRL arguments


def test_torchrl_positional_arguments_and_defaults():
    tool = PythonInterpreter("a-tokenizer", "user", True, 3.0)
    assert (tool.tokenizer, tool.tool_role, tool.persistent, tool.timeout) == ("a-tokenizer", "user", True, 3.0)
    assert tool.run_kwargs == {"timeout_s": 3.0}
    assert PythonInterpreter().timeout == DEFAULT_PYTHON_TIMEOUT_S == 10.0
    assert PythonInterpreter(timeout_s=2.0, memory_mb=256).run_kwargs == {"timeout_s": 2.0, "memory_mb": 256}
    assert PythonInterpreter(tool_role="user").tool_role == "user"
    with pytest.raises(ValueError, match="timeout .* or timeout_s, not both"):
        PythonInterpreter(timeout=3, timeout_s=3)
    with pytest.raises(ValueError, match="disagree"):
        PythonInterpreter(tool_name="user", tool_role="tool")
    with pytest.raises(ValueError, match="services must be None, 'ray' or an executor"):
        PythonInterpreter(services="docker")


def test_timeout_is_enforced_and_rendered():
    env = ChatEnv(batch_size=[1]).append_transform(PythonInterpreter(timeout=1.0))
    assert tool_message(step(env, ["```python\nwhile True: pass\n```"]))["content"] == (
        "Code block 1 failed:\ntimeout after 1.0s\n"
    )


def test_a_local_service_gives_the_same_messages_as_local_sandboxes():
    replies = ["```python\nprint('a')\n```", "```python\nprint(1 / 0)\n```\n```python\nprint('c')\n```"]
    service = PythonExecutorService(pool_size=2, timeout=5.0)
    messages = []
    for tool in (PythonInterpreter(timeout=5.0), PythonInterpreter(services=service, max_workers=2)):
        stepped = step(ChatEnv(batch_size=[2]).append_transform(tool), replies)
        messages.append([tool_message(stepped, i) for i in range(2)])
        assert stepped["next", "tool_errors"].view(-1).tolist() == [0, 1]
    assert messages[0] == messages[1]
    assert messages[1][1]["content"].startswith("Code block 1 failed:\nZeroDivisionError: division by zero\n")
    assert service.num_executed == 3


def test_services_refuse_options_that_would_not_apply():
    service = PythonExecutorService(pool_size=1)
    with pytest.raises(ValueError, match="persistent=True needs the transform's own sandboxes"):
        PythonInterpreter(persistent=True, services=service)
    with pytest.raises(ValueError, match=r"\['memory_mb', 'timeout'\] do not apply with services="):
        PythonInterpreter(timeout=3, services=service, memory_mb=128)


def test_services_ray_finds_the_named_actor(monkeypatch):
    """A stand-in for ray (no cluster here): the handle looks the actor up by name and
    namespace, and waits for its result."""
    service = PythonExecutorService(pool_size=1, timeout=5.0)
    calls = []

    class Method:
        def remote(self, code):
            calls.append(code)
            return ("ref", code)

    actor = types.SimpleNamespace(execute=Method())

    def get_actor(name, namespace=None):
        if (name, namespace) != ("python_executor", "tools"):
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return actor

    waits, cancelled = [], []

    def get(ref, timeout=None):
        waits.append(timeout)
        if ref[1] == "hang":
            raise TimeoutError("GetTimeoutError")
        return service.execute(ref[1])

    fake_ray = types.SimpleNamespace(get_actor=get_actor, get=get, cancel=cancelled.append)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    tool = PythonInterpreter(services="ray", namespace="tools")
    assert isinstance(tool.executor, RayExecutorHandle)
    stepped = step(ChatEnv(batch_size=[1]).append_transform(tool), ["```python\nprint(2 + 3)\n```"])
    assert tool_message(stepped)["content"] == "Code block 1 executed successfully:\n5\n"
    assert calls == ["print(2 + 3)\n"] and waits == [120.0]  # every wait for the actor is bounded
    with pytest.raises(TimeoutError, match="'python_executor' did not answer execute\\(\\) within 120.0 s"):
        tool.executor.execute("hang")
    assert cancelled == [("ref", "hang")]
    with pytest.raises(RuntimeError, match="no Ray actor named 'python_executor' in namespace None"):
        PythonInterpreter(services="ray")


def test_clone_has_the_options_and_none_of_the_interpreters():
    tool = PythonInterpreter("tok", persistent=True, timeout=4.0, memory_mb=128, max_workers=2)
    env = ChatEnv(batch_size=[1], max_steps=3).append_transform(tool)
    step(env, ["```python\nx = 1\n```"])
    copy = tool.clone()
    assert len(tool.sessions) == 1 and copy.sessions == {}
    assert (copy.tokenizer, copy.persistent, copy.max_workers, copy.run_kwargs) == (
        "tok", True, 2, {"timeout_s": 4.0, "memory_mb": 128},
    )  # fmt: skip
    tool.close()


def test_a_whole_batch_reset_ends_every_interpreter():
    """TorchRL's persistent test: after env.reset() a name defined before is gone, and the old
    episode's interpreter does not linger (TorchRL restarts its processes at reset)."""
    tool = PythonInterpreter(persistent=True, timeout=5.0)
    env = ChatEnv(batch_size=[2], max_steps=5).append_transform(tool)
    step(env, ["```python\na = [0]\n```", "```python\nb = 1\n```"])
    old = list(tool.sessions.values())
    assert len(old) == 2 and all(session._process.alive for session in old)
    stepped = step(env, ["```python\nprint('a' in globals())\n```", "no code"])
    assert all(session._process is None for session in old) and len(tool.sessions) == 1
    assert tool_message(stepped)["content"] == "Code block 1 executed successfully:\nFalse\n"
    time.sleep(0.1)
    tool.close()
    assert tool.sessions == {}
