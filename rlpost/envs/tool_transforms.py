"""The tool transforms: calls in the policy's answer, run, their results appended to the next
prompt as one ``"tool"`` message (TorchRL's ``torchrl.envs.llm.transforms.tools``).

:class:`PythonInterpreter` runs ```` ```python ```` blocks in the sandbox
(:mod:`rlpost.envs.sandbox`); :class:`SimpleToolTransform` calls the user's functions named in
``<tool_call>`` blocks (:class:`HermesToolCallParser`) or TorchRL's ``<tool>name\nargs</tool>``.
Both count calls, errors and seconds per row under :data:`TOOL_STAT_KEYS` in ``next`` (the
collector sums them per episode). :class:`StopWithoutToolCall` ends an episode whose turn called
no tool.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from rlpost.envs.function_pool import FunctionPool
from rlpost.envs.python_executor import PythonExecutor, RayExecutorHandle, check_run_options, result_from_execution
from rlpost.envs.tools import PythonResult, PythonSession, extract_python_blocks, format_tool_response, run_python
from rlpost.envs.transforms import Transform

_OPEN, _CLOSE = "<tool_response>\n", "\n</tool_response>"
TOOL_STAT_KEYS = ("tool_calls", "tool_errors", "tool_time_s")  # per row of ``next``, summed over tools
DEFAULT_PYTHON_TIMEOUT_S = 10.0  # TorchRL's PythonInterpreter default


def add_tool_stats(next_td: TensorDictBase, calls: list[int], errors: list[int], seconds: list[float]) -> None:
    """Add one tool transform's per-row counts to ``next_td``'s :data:`TOOL_STAT_KEYS` ([B, 1])."""
    for key, values, dtype in zip(TOOL_STAT_KEYS, (calls, errors, seconds), (torch.int64, torch.int64, torch.float64)):
        added = torch.tensor(values, dtype=dtype).view(-1, 1)
        current = next_td.get(key, None)
        next_td.set(key, added if current is None else current + added)


class ToolTransformBase(Transform):
    """A tool transform's step: for each row not done, run the calls of the latest response (rows
    concurrently, up to ``max_workers``), append one tool message with the results and count them.
    Subclasses define :meth:`find_calls`, :meth:`run_call` and :meth:`render`. A failing call is
    reported to the model in the message; nothing raises. ``stop_on_error`` (TorchRL's option of
    ``ExecuteToolsInOrder``): a row's calls after its first failure are not run.
    """

    stop_on_error: bool = False

    def __init__(self, *, tool_role: str = "tool", max_workers: int = 1) -> None:
        super().__init__()
        if max_workers < 1:
            raise ValueError(f"{type(self).__name__} max_workers must be >= 1, got {max_workers}")
        self.tool_role, self.max_workers = tool_role, max_workers
        self.num_calls = self.num_errors = 0
        # Trap: long-lived threads, as a sandbox dies with the thread that started it (bwrap's
        # --die-with-parent is per thread).
        self._executor: ThreadPoolExecutor | None = None

    def find_calls(self, text: str) -> list:
        raise NotImplementedError

    def run_call(self, call: Any, row: int, td: TensorDictBase) -> tuple[str, bool]:
        """Run one call for row ``row``: (its rendered result, whether it succeeded)."""
        raise NotImplementedError

    def render(self, parts: list[str]) -> str:
        return "\n".join(parts)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        env = self._chat_env()
        done = next_td.get("done").view(-1).tolist()
        calls_per_row = [[] if done[i] else self.find_calls(text) for i, text in enumerate(env.last_responses(td))]
        self.after_turn(td, done)
        rows = [i for i, calls in enumerate(calls_per_row) if calls]
        results = self._run_rows(rows, calls_per_row, td)
        num = len(calls_per_row)
        calls, errors, seconds = [0] * num, [0] * num, [0.0] * num
        messages: list[str | None] = [None] * num
        for i, (parts, oks, elapsed) in zip(rows, results):
            calls[i], errors[i], seconds[i] = len(oks), oks.count(False), elapsed
            messages[i] = self.render(parts)
        self.num_calls += sum(calls)
        self.num_errors += sum(errors)
        add_tool_stats(next_td, calls, errors, seconds)
        return env.append_messages(next_td, self.tool_role, messages) if rows else next_td

    def after_turn(self, td: TensorDictBase, done: list[bool]) -> None:
        """Hook after the calls were found: e.g. free what a finished episode held."""

    def _run_rows(self, rows: list[int], calls_per_row: list[list], td: TensorDictBase) -> list:
        def run_row(i: int) -> tuple[list[str], list[bool], float]:
            start = time.monotonic()
            outcomes = []
            for call in calls_per_row[i]:
                outcomes.append(self.run_call(call, i, td))
                if self.stop_on_error and not outcomes[-1][1]:
                    break
            return [text for text, _ in outcomes], [ok for _, ok in outcomes], time.monotonic() - start

        if self.max_workers == 1 or len(rows) <= 1:
            return [run_row(i) for i in rows]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=type(self).__name__)
        return list(self._executor.map(run_row, rows))

    def close(self) -> None:
        """Stop the transform's threads (it stays usable: they start again when needed)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class PythonInterpreter(ToolTransformBase):
    """Run the ```` ```python ```` blocks of each latest assistant message in the sandbox; append
    a tool message (:func:`~rlpost.envs.tools.format_tool_response`).

    TorchRL's constructor plus rlpost's keywords: ``tool_role`` (= ``tool_name``), ``max_workers``
    (> 1: a batch's rows run concurrently) and ``run_kwargs`` (``timeout_s``, ``memory_mb``,
    ``sandbox``, ... as :func:`~rlpost.envs.tools.run_python` takes them; ``timeout`` is
    ``timeout_s``, give one). ``persistent=True`` gives each episode one interpreter (killed when
    the episode ends, all of them at a reset of the whole batch); else every block is a fresh
    process. ``services``: ``"ray"`` finds the Ray actor ``service_name`` (in ``namespace``), a
    :class:`~rlpost.envs.python_executor.PythonExecutorService`; any object with
    ``execute(code) -> dict`` is used as it is.

    Deliberate deviations from TorchRL: the sandbox limits CPU, memory, files, processes and
    network (TorchRL's only limits time, and runs blocks as plain host processes), and the
    ``sandbox`` option refuses to run where namespaces are unavailable unless "guard" is asked
    for; the blocks of one response make one tool message (TorchRL: one message per block); a
    failed block's message gives the one-line reason and the output (TorchRL: its stderr);
    ``services`` with ``persistent=True`` or with sandbox options raises ``ValueError`` (TorchRL
    ignores them: its service's interpreters are shared round-robin, so nothing persists per
    episode); a failing Ray service raises (TorchRL reports it to the model as the block's
    failure, which would put an infrastructure fault into the training data).
    """

    state_keys = ("tool_episode",)

    def __init__(
        self,
        tokenizer: Any = None,
        tool_name: str = "tool",
        persistent: bool = False,
        timeout: float | None = None,
        services: str | PythonExecutor | None = None,
        service_name: str = "python_executor",
        namespace: str | None = None,
        *,
        tool_role: str | None = None,
        max_workers: int = 1,
        **run_kwargs: Any,
    ) -> None:
        if tool_role is not None and tool_name not in ("tool", tool_role):
            raise ValueError(f"PythonInterpreter: tool_name={tool_name!r} and tool_role={tool_role!r} disagree")
        super().__init__(tool_role=tool_role if tool_role is not None else tool_name, max_workers=max_workers)
        if timeout is not None and "timeout_s" in run_kwargs:
            raise ValueError("PythonInterpreter: give timeout (TorchRL's name) or timeout_s, not both")
        self.tokenizer, self.persistent = tokenizer, persistent
        self.services, self.service_name, self.namespace = services, service_name, namespace
        self.executor = self._executor_of(services, persistent, timeout, run_kwargs)
        if self.executor is None:
            run_kwargs.setdefault("timeout_s", timeout if timeout is not None else DEFAULT_PYTHON_TIMEOUT_S)
            check_run_options("PythonInterpreter", run_kwargs)
        self.run_kwargs = run_kwargs
        self.timeout = run_kwargs.get("timeout_s")
        self.sessions: dict[int, PythonSession] = {}
        self._episode_ids = itertools.count()

    def _executor_of(self, services: Any, persistent: bool, timeout: float | None,
                     run_kwargs: dict[str, Any]) -> PythonExecutor | None:  # fmt: skip
        if services is None:
            return None
        if persistent:
            raise ValueError(
                "PythonInterpreter: services= runs every block in a fresh interpreter of the shared executor; "
                "persistent=True needs the transform's own sandboxes (services=None)"
            )
        if timeout is not None or run_kwargs:
            given = sorted(run_kwargs) + (["timeout"] if timeout is not None else [])
            raise ValueError(
                f"PythonInterpreter: {given} do not apply with services=: the executor's own limits do "
                "(PythonExecutorService(timeout=..., **run_kwargs))"
            )
        if services == "ray":
            return RayExecutorHandle(self.service_name, self.namespace)
        if callable(getattr(services, "execute", None)):
            return services
        raise ValueError(f"PythonInterpreter: services must be None, 'ray' or an executor with execute(code); "
                         f"got {services!r}")  # fmt: skip

    @property
    def num_blocks_run(self) -> int:
        return self.num_calls

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        num = reset_td.batch_size[0]
        if self.sessions and num == self._env().batch_size[0]:  # every episode starts over
            self._close_sessions()
        ids = [next(self._episode_ids) for _ in range(num)]
        reset_td.set("tool_episode", torch.tensor(ids, dtype=torch.int64))
        return reset_td

    def find_calls(self, text: str) -> list[str]:
        return extract_python_blocks(text)

    def run_call(self, code: str, row: int, td: TensorDictBase) -> tuple[PythonResult, bool]:
        if self.executor is not None:
            result = result_from_execution(self.executor.execute(code))
        elif not self.persistent:
            result = run_python(code, **self.run_kwargs)
        else:
            episode = int(td.get("tool_episode")[row])
            if episode not in self.sessions:
                self.sessions[episode] = PythonSession(**self.run_kwargs)
            result = self.sessions[episode].run(code)
        return result, result.ok

    def render(self, results: list[PythonResult]) -> str:
        """The tool message's content. Trap: Qwen-style templates wrap a ``"tool"`` message in
        ``<tool_response>`` themselves, so that role gets the inner text (rendering exactly as
        :func:`format_tool_response`); any other role gets the wrapped text."""
        wrapped = format_tool_response(results)
        if self.tool_role != "tool":
            return wrapped
        assert wrapped.startswith(_OPEN) and wrapped.endswith(_CLOSE), wrapped[:40]
        return wrapped[len(_OPEN) : -len(_CLOSE)]

    def after_turn(self, td: TensorDictBase, done: list[bool]) -> None:
        if not self.persistent or "tool_episode" not in td.keys():
            return
        for row, episode in enumerate(td.get("tool_episode").view(-1).tolist()):
            if done[row] and episode in self.sessions:
                self.sessions.pop(episode).close()

    def clone(self) -> PythonInterpreter:
        """A new transform with the same options and no interpreters (TorchRL's ``clone``)."""
        run_kwargs = dict(self.run_kwargs) if self.executor is None else {}
        return type(self)(self.tokenizer, self.tool_role, self.persistent, services=self.services,
                          service_name=self.service_name, namespace=self.namespace,
                          max_workers=self.max_workers, **run_kwargs)  # fmt: skip

    def _close_sessions(self) -> None:
        while self.sessions:
            self.sessions.popitem()[1].close()

    def close(self) -> None:
        """Kill every episode's interpreter (persistent mode) and stop the threads."""
        self._close_sessions()
        super().close()

    def __repr__(self) -> str:
        where = f"services={self.executor!r}" if self.executor is not None else f"run_kwargs={self.run_kwargs}"
        return f"PythonInterpreter(tool_role={self.tool_role!r}, persistent={self.persistent}, {where})"


@dataclass(frozen=True)
class ToolCall:
    """One call found in a response; ``tag``: TorchRL's label the model gave the call, echoed in
    its result. Deviations: frozen; ``error`` (rlpost's) says why an unreadable call (e.g.
    invalid JSON) fails, as reported to the model."""

    tool: str
    args: dict
    tag: str | None = None
    error: str | None = field(default=None, kw_only=True)


def find_pattern_calls(pattern: re.Pattern, text: str) -> list[ToolCall]:
    """The (tool name, JSON arguments) matches of ``pattern`` in ``text`` as calls; empty
    arguments are ``{}``, arguments that are not a JSON object make a call whose ``error`` says so."""
    calls = []
    for name, args_json in pattern.findall(text):
        try:
            args = json.loads(args_json) if args_json.strip() else {}
            if not isinstance(args, dict):
                raise TypeError("arguments must be a JSON object")
            calls.append(ToolCall(name.strip(), args))
        except (ValueError, TypeError) as exc:
            calls.append(ToolCall(name.strip(), {}, error=f"Failed to parse tool arguments: {exc}"))
    return calls


class HermesToolCallParser:
    """Tool calls in the Qwen/Hermes format that their chat templates teach::

        <tool_call>
        {"name": "multiply", "arguments": {"a": 3, "b": 4}}
        </tool_call>

    ``parser(text)`` -> ``{"text": text without the calls, "calls": [ToolCall, ...]}`` (TorchRL's
    layout). ``arguments`` may be a JSON string (some models write one); an unreadable block is a
    call whose ``error`` says why.
    """

    pattern = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def __call__(self, text: str) -> dict[str, Any]:
        calls = [self._parse(body) for body in self.pattern.findall(text)]
        return {"text": self.pattern.sub("", text), "calls": calls}

    @staticmethod
    def _parse(body: str) -> ToolCall:
        try:
            data = json.loads(body)
            name = data["name"]
            args = data.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("'name' must be a string and 'arguments' an object")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return ToolCall("?", {}, error=f"invalid tool call {body[:200]!r}: {type(exc).__name__}: {exc}")
        return ToolCall(name, args)


class SimpleToolTransform(ToolTransformBase):
    """Call the user's functions named in the latest assistant message; append a tool message.

    TorchRL's constructor: ``tools`` maps a name to a function (or a ``"package.module:function"``
    path); ``parser`` (e.g. :class:`HermesToolCallParser`), else ``tool_call_pattern``, finds the
    calls. Results render as in TorchRL (``Tool NAME executed successfully:\\nRESULT``).

    Deviation from TorchRL: the functions run in worker processes (:class:`FunctionPool`) with
    ``timeout`` enforced (a call past it is killed and reported as failed); TorchRL calls them in
    the env's process and does not enforce its timeout. Functions must therefore be importable
    (module-level, or given by path). The calls of one response make one tool message, their
    results in order (TorchRL: one message per call), as in rlpost's other tool transforms; a
    function's exception is reported as ``TypeName: message`` (TorchRL: ``Tool execution failed:
    message``).
    """

    def __init__(
        self,
        tools: dict[str, Callable | str],
        tool_schemas: dict[str, dict] | None = None,
        parser: Callable[[str], dict] | None = None,
        tool_call_pattern: str | None = None,
        tool_name: str = "tool",
        timeout: float = 10.0,
        *,
        pool: FunctionPool | None = None,
        max_workers: int = 1,
    ) -> None:
        super().__init__(tool_role=tool_name, max_workers=max_workers)
        if not tools:
            raise ValueError("SimpleToolTransform needs at least one tool")
        if timeout <= 0:
            raise ValueError(f"SimpleToolTransform timeout must be > 0, got {timeout}")
        self.tools, self.tool_schemas = dict(tools), dict(tool_schemas or {})
        self.parser = parser
        self.tool_call_pattern = re.compile(tool_call_pattern or r"<tool>(.*?)\n(.*?)</tool>", re.DOTALL)
        self.timeout = timeout
        self.pool = pool if pool is not None else FunctionPool(max_workers)

    def find_calls(self, text: str) -> list[ToolCall]:
        if self.parser is not None:
            return list(self.parser(text)["calls"])
        return find_pattern_calls(self.tool_call_pattern, text)

    def run_call(self, call: ToolCall, row: int, td: TensorDictBase) -> tuple[str, bool]:
        if call.error is not None:
            return f"Tool {call.tool} failed:\n{call.error}", False
        fn = self.tools.get(call.tool)
        if fn is None:
            return f"Tool {call.tool} failed:\nTool {call.tool} not found (known: {sorted(self.tools)})", False
        result = self.pool.call(fn, kwargs=call.args, timeout_s=self.timeout)
        if result.ok:
            return f"Tool {call.tool} executed successfully:\n{result.value}", True
        return f"Tool {call.tool} failed:\n{result.message}", False

    def __repr__(self) -> str:
        return f"SimpleToolTransform(tools={sorted(self.tools)}, timeout={self.timeout})"


class StopWithoutToolCall(Transform):
    """End (``terminated``) every episode whose latest turn called no tool, which would else go
    on with nothing new to respond to until ``max_steps``. Append it after the tool transforms."""

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        calls = next_td.get("tool_calls", None)
        no_call = torch.ones_like(next_td.get("done")) if calls is None else (calls == 0).view_as(next_td.get("done"))
        next_td.set("terminated", next_td.get("terminated") | no_call)
        next_td.set("done", next_td.get("done") | no_call)
        return next_td
