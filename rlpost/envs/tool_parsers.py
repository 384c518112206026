"""Tool-call parsers: a model's response in, the ordered calls it makes out (TorchRL's parsers).

A parser is any callable ``parser(response) -> ParseResult`` (:class:`LLMToolParser`), taken by
:class:`~rlpost.envs.tool_services.ExecuteToolsInOrder` and
:class:`~rlpost.envs.tool_transforms.SimpleToolTransform`. Formats::

    XMLBlockParser    <tool name="search" tag="A">{"query": "torchrl"}</tool>
    JSONCallParser    {"message": "...", "tools": [{"tool": "search", "args": {...}, "tag": "A"}]}
    HermesToolCallParser (rlpost.envs.transforms)   <tool_call>{"name": ..., "arguments": ...}</tool_call>
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, TypedDict

from rlpost.envs.tool_transforms import ToolCall


class ParseResult(TypedDict):
    """What a parser returns: ``text``, the response without its call blocks (what a user would
    read); ``calls``, the calls in order of appearance; ``meta``, parser details (``count``)."""

    text: str
    calls: list[ToolCall]
    meta: dict[str, Any]


class LLMToolParser(Protocol):
    """A callable that reads the calls of one response (a string, or a dict already decoded)."""

    def __call__(self, response: str | dict[str, Any]) -> ParseResult: ...


def parse_result(text: str, calls: list[ToolCall]) -> ParseResult:
    return ParseResult(text=text, calls=calls, meta={"count": len(calls)})


class XMLBlockParser:
    """Calls as XML-style blocks whose body is a JSON object of arguments (``tag`` optional).
    A body that is not a JSON object is passed on as ``{"raw": body}`` (TorchRL's fallback, for
    tools that take free text); a dict response is read from its ``"text"``.

    Deviation from TorchRL: a body that is valid JSON but not an object (``[1, 2]``, ``"x"``)
    is also ``{"raw": body}``; TorchRL makes it the call's arguments, which no tool can take as
    keyword arguments.
    """

    pattern = re.compile(
        r'<tool\s+name="(?P<name>[^"]+)"(?:\s+tag="(?P<tag>[^"]+)")?\s*>\s*(?P<body>.*?)\s*</tool>', re.DOTALL
    )

    def __call__(self, response: str | dict[str, Any]) -> ParseResult:
        text = response if isinstance(response, str) else response.get("text", "")
        calls: list[ToolCall] = []

        def take(match: re.Match) -> str:
            calls.append(ToolCall(match["name"], self._arguments(match["body"]), tag=match["tag"]))
            return ""

        return parse_result(self.pattern.sub(take, text).strip(), calls)

    @staticmethod
    def _arguments(body: str) -> dict[str, Any]:
        if not body.strip():
            return {}
        try:
            args = json.loads(body)
        except json.JSONDecodeError:
            return {"raw": body}
        return args if isinstance(args, dict) else {"raw": body}


class JSONCallParser:
    """Calls given as one JSON object (function-calling style; the text is its ``message``); a
    string that does not decode to a JSON object is plain text with no calls.

    Deviation from TorchRL: an entry of ``tools`` that is not ``{"tool": str, "args": dict,
    "tag": str?}`` becomes a call whose ``error`` says why (reported to the model as that call's
    failure); TorchRL raises from inside the env step.
    """

    def __call__(self, response: str | dict[str, Any]) -> ParseResult:
        if isinstance(response, str):
            try:
                decoded = json.loads(response)
            except json.JSONDecodeError:
                decoded = None
            if not isinstance(decoded, dict):
                return parse_result(response, [])
            response = decoded
        message = response.get("message", "")
        return parse_result(message if isinstance(message, str) else json.dumps(message),
                            [self._call(entry) for entry in response.get("tools", [])])  # fmt: skip

    @staticmethod
    def _call(entry: Any) -> ToolCall:
        if isinstance(entry, dict) and set(entry) <= {"tool", "args", "tag"}:
            tool, args, tag = entry.get("tool"), entry.get("args", {}), entry.get("tag")
            if isinstance(tool, str) and isinstance(args, dict) and (tag is None or isinstance(tag, str)):
                return ToolCall(tool, args, tag=tag)
        name = entry.get("tool") if isinstance(entry, dict) and isinstance(entry.get("tool"), str) else "?"
        return ToolCall(name, {}, error=f"invalid tool entry {json.dumps(entry, default=str)[:200]}: "
                                        "expected {'tool': str, 'args': object, 'tag': str (optional)}")  # fmt: skip
