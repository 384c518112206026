"""Tool services and the transform that calls them in order (TorchRL's tool service library).

A :class:`ToolService` is a named object called in the env's process (it may hold a client, a
cache, a sandbox pool), where :class:`~rlpost.envs.tool_transforms.SimpleToolTransform`'s tools
are importable functions run in worker processes with a time limit. A service that runs
model-written code must run it in the sandbox, as
:class:`~rlpost.envs.python_executor.PythonExecutorService` does::

    registry = ToolRegistry([WebSearch(), Calculator()])
    env = ChatEnv(batch_size=(1,)).append_transform(
        ExecuteToolsInOrder(registry=registry, parser=XMLBlockParser()))
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from rlpost.envs.tool_parsers import LLMToolParser, ParseResult
from rlpost.envs.tool_transforms import ToolCall, ToolTransformBase


class ToolService(Protocol):
    """A named tool: ``service(**kwargs)`` returns a dict of results; the schemas document its
    arguments and results (not enforced)."""

    name: str
    schema_in: dict[str, Any]
    schema_out: dict[str, Any]

    def __call__(self, **kwargs: Any) -> dict[str, Any]: ...


class ToolRegistry:
    """The services a transform may call, by name (TorchRL's ``ToolRegistry``: ``register``
    replaces a service of the same name, ``get`` raises ``KeyError("Unknown tool: NAME")``)."""

    def __init__(self, services: Sequence[ToolService] = ()) -> None:
        self._services: dict[str, ToolService] = {}
        for service in services:
            self.register(service)

    def register(self, service: ToolService) -> None:
        self._services[service.name] = service

    def get(self, name: str) -> ToolService:
        if name not in self._services:
            raise KeyError(f"Unknown tool: {name}")
        return self._services[name]

    def __contains__(self, name: str) -> bool:
        return name in self._services

    def __iter__(self) -> Iterator[str]:
        return iter(self._services)

    def __len__(self) -> int:
        return len(self._services)

    def __repr__(self) -> str:
        return f"ToolRegistry({sorted(self._services)})"


class ExecuteToolsInOrder(ToolTransformBase):
    """Call the services named in each latest response, in the order the calls appear.

    TorchRL's constructor (``pass_state_to_tools``: each service also gets ``_state=``) plus
    ``tool_role`` and ``max_workers`` (rows run concurrently on that many threads, so the
    services must then be thread-safe; a row's calls stay in order).

    A row's results make one message, as in TorchRL::

        <tool_results>
        Tool add (call 1) [tag: A] succeeded:
          Result: {"result": 8}            (json.dumps(result, indent=2))
        Tool search (call 2) failed:
          Error: ValueError: no index
        </tool_results>

    A call fails (counted in ``tool_errors``) when its tool is unknown, the parser could not read
    it, or the service raises or returns a non-dict or a dict with an ``"error"`` key (as TorchRL).

    Deliberate deviations from TorchRL: ``_state`` is the row's state (:meth:`row_state`;
    TorchRL passes an empty dict); an exception's message names its type (``ValueError: no
    index``); a service's result is never modified (TorchRL writes its bookkeeping keys into
    it) and values JSON cannot encode render with ``str`` (TorchRL's step raises).
    """

    def __init__(self, registry: ToolRegistry, parser: LLMToolParser, stop_on_error: bool = False,
                 pass_state_to_tools: bool = True, *, tool_role: str = "tool", max_workers: int = 1) -> None:  # fmt: skip
        super().__init__(tool_role=tool_role, max_workers=max_workers)
        self.registry, self.parser = registry, parser
        self.stop_on_error, self.pass_state_to_tools = stop_on_error, pass_state_to_tools

    def find_calls(self, text: str) -> list[tuple[int, ToolCall]]:
        parsed: ParseResult = self.parser(text)
        return list(enumerate(parsed["calls"]))

    def run_call(self, indexed: tuple[int, ToolCall], row: int, td: TensorDictBase) -> tuple[str, bool]:
        index, call = indexed
        header = f"Tool {call.tool} (call {index + 1})"
        error = call.error
        if error is None:
            if call.tool not in self.registry:
                error = f"Unknown tool: {call.tool} (known: {sorted(self.registry)})"
            else:
                out, error = self._call_service(call, row, td)
        if error is not None:
            return f"{header} failed:\n  Error: {error}", False
        tag = f" [tag: {call.tag}]" if call.tag else ""
        return f"{header}{tag} succeeded:\n  Result: {json.dumps(out, indent=2, default=str)}", True

    def _call_service(self, call: ToolCall, row: int, td: TensorDictBase) -> tuple[dict | None, str | None]:
        """The service's result and None, or None and why the call failed."""
        kwargs = dict(call.args)
        if self.pass_state_to_tools:
            kwargs["_state"] = self.row_state(td, row)
        try:
            out = self.registry.get(call.tool)(**kwargs)
        except Exception as exc:  # a service's failure is the call's result, shown to the model
            return None, f"{type(exc).__name__}: {exc}"
        if not isinstance(out, dict):
            return None, f"tool {call.tool} returned {type(out).__name__}, expected a dict"
        if "error" in out:
            return None, str(out["error"])
        return out, None

    def row_state(self, td: TensorDictBase, row: int) -> dict[str, Any]:
        """The ``_state`` a service gets: ``"row"`` and the row's state keys as Python values."""
        state: dict[str, Any] = {"row": row}
        keys = getattr(self.parent, "state_keys", ())
        for key in keys:
            if key in td.keys():
                state[key] = _row_value(td.get(key), row)
        return state

    def render(self, parts: list[str]) -> str:
        return "\n".join(["<tool_results>", *parts, "</tool_results>"])

    def __repr__(self) -> str:
        return f"ExecuteToolsInOrder(registry={self.registry!r}, stop_on_error={self.stop_on_error})"


def _row_value(value: Any, row: int) -> Any:
    if isinstance(value, NonTensorStack):
        return value.tolist()[row]
    if isinstance(value, NonTensorData):
        return value.data
    if isinstance(value, torch.Tensor):
        item = value[row]
        return item.item() if item.numel() == 1 else item.tolist()
    if isinstance(value, TensorDictBase):
        return value[row].to_dict()
    return value
