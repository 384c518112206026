"""Tools served over the Model Context Protocol (MCP): TorchRL's ``MCPToolTransform``.

Each configured server runs as a subprocess speaking MCP over stdio (the ``mcp`` package's
client); its tools are called from TorchRL's blocks::

    <tool>server.tool_name
    {"arg": "value"}
    </tool>

The sessions live on the transform's own event loop thread
(:class:`~rlpost.envs.event_loop.EventLoopThread`). A server is a program the user configured,
trusted as such: it gets the model's arguments and nothing else, and must contain model-written
code itself (or use :class:`~rlpost.envs.tool_transforms.PythonInterpreter`'s sandbox).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from tensordict import TensorDictBase

from rlpost.envs.event_loop import EventLoopThread
from rlpost.envs.tool_transforms import ToolCall, ToolTransformBase, find_pattern_calls

logger = logging.getLogger(__name__)

_CONFIG_KEYS = {"command", "args", "env", "cwd"}


class MCPToolTransform(ToolTransformBase):
    """Call the tools of MCP servers named in each latest response; append a tool message.

    TorchRL's constructor: ``servers`` maps a name to ``{"command", "args", "env" (merged over
    the default environment by the mcp client), "cwd"}``; ``tool_call_pattern`` captures
    (``server.tool``, JSON arguments), a bare ``tool`` goes to the first server; ``timeout``
    bounds each call. rlpost adds ``connect_timeout`` (seconds for all servers to start and list
    their tools) and ``max_workers``. :attr:`tool_schemas` describes the tools for the model;
    ``close()`` stops the servers.

    Deliberate deviations from TorchRL: a server that cannot start or list its tools raises at
    construction, naming it and its command (TorchRL logs it, then answers every call "not
    connected"); the session is initialized (the MCP handshake); a result renders as the text of
    its content blocks (TorchRL: the repr of the content list) and one marked ``is_error`` is a
    failure (TorchRL: a success); a tool the server did not list fails without a round trip,
    naming those it has; a row's calls make one message (TorchRL: one per call).
    """

    def __init__(
        self,
        servers: dict[str, dict],
        tool_call_pattern: str | None = None,
        tool_name: str = "tool",
        timeout: float = 10.0,
        *,
        connect_timeout: float = 30.0,
        max_workers: int = 1,
    ) -> None:
        super().__init__(tool_role=tool_name, max_workers=max_workers)
        _check_servers(servers)
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(
                f"MCPToolTransform needs timeout and connect_timeout > 0, got {timeout}, {connect_timeout}"
            )
        try:
            import mcp  # noqa: F401
        except ImportError as exc:
            raise ImportError("MCPToolTransform needs the mcp package: pip install mcp") from exc
        self.server_configs = {name: dict(config) for name, config in servers.items()}
        self.tool_call_pattern = re.compile(tool_call_pattern or r"<tool>([\w.]+)\n(.*?)</tool>", re.DOTALL)
        self.timeout = timeout
        self._sessions: dict[str, Any] = {}
        self._tools_cache: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop: asyncio.Event | None = None
        self._loop = EventLoopThread(name="MCPToolTransform")
        try:
            self._loop.run(self._connect_all(), connect_timeout)
        except TimeoutError as exc:
            self.close()
            raise RuntimeError(
                f"MCPToolTransform: the MCP servers {sorted(servers)} did not start within {connect_timeout}s"
            ) from exc
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ connections

    async def _connect_all(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        readies = {}
        for name, config in self.server_configs.items():
            readies[name] = loop.create_future()
            self._tasks[name] = asyncio.create_task(self._serve(name, config, readies[name]))
        outcomes = await asyncio.gather(*readies.values(), return_exceptions=True)
        for name, outcome in zip(readies, outcomes):
            if isinstance(outcome, BaseException):
                config = self.server_configs[name]
                raise RuntimeError(
                    f"MCPToolTransform: could not connect to MCP server {name!r} "
                    f"({' '.join([config['command'], *config.get('args', [])])}): {_reason(outcome)}"
                ) from outcome

    async def _serve(self, name: str, config: dict, ready: asyncio.Future) -> None:
        """Hold server ``name``'s session open until :meth:`close` (the mcp client's contexts
        must be entered and left by the same task)."""
        from mcp import ClientSession, StdioServerParameters, stdio_client

        params = StdioServerParameters(command=config["command"], args=list(config.get("args", [])),
                                       env=config.get("env"), cwd=config.get("cwd"))  # fmt: skip
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                self._tools_cache[name] = {tool.name: tool for tool in listed.tools}
                self._sessions[name] = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("MCP server %r stopped: %s", name, _reason(exc))
        finally:
            self._sessions.pop(name, None)

    async def _disconnect_all(self) -> None:
        if self._stop is not None:
            self._stop.set()
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()

    @property
    def tool_schemas(self) -> dict[str, dict]:
        """Each server's tools as ``{"server.tool": {"name", "description", "parameters"}}``."""
        return {
            f"{server}.{name}": {"name": f"{server}.{name}", "description": tool.description or "",
                                 "parameters": tool.input_schema}
            for server, tools in self._tools_cache.items()
            for name, tool in tools.items()
        }  # fmt: skip

    # ------------------------------------------------------------------ calls

    def find_calls(self, text: str) -> list[ToolCall]:
        return find_pattern_calls(self.tool_call_pattern, text)

    def split_name(self, full_name: str) -> tuple[str, str]:
        """``"server.tool"`` -> (server, tool); a bare ``"tool"`` goes to the first server."""
        if "." in full_name:
            server, tool = full_name.split(".", 1)
            return server, tool
        return next(iter(self.server_configs)), full_name

    def run_call(self, call: ToolCall, row: int, td: TensorDictBase) -> tuple[str, bool]:
        server, tool = self.split_name(call.tool)
        outcome, ok = (call.error, False) if call.error is not None else self._call(server, tool, call.args)
        verdict = "executed successfully" if ok else "failed"
        return f"Tool {server}.{tool} {verdict}:\n{outcome}", ok

    def _call(self, server: str, tool: str, args: dict) -> tuple[str, bool]:
        session = self._sessions.get(server)
        if session is None:
            return f"MCP server '{server}' not connected (servers: {sorted(self._sessions)})", False
        if tool not in self._tools_cache.get(server, {}):
            return f"MCP server '{server}' has no tool {tool!r} (tools: {sorted(self._tools_cache[server])})", False
        try:
            result = self._loop.run(session.call_tool(tool, arguments=args), self.timeout)
        except TimeoutError:
            return f"Tool execution timed out after {self.timeout}s", False
        except Exception as exc:  # the server's failure is the call's result, shown to the model
            return f"MCP tool call failed: {_reason(exc)}", False
        return render_content(result.content), not result.is_error

    def close(self) -> None:
        """Stop the servers, the loop and the row threads (idempotent)."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.running:
            try:
                loop.run(self._disconnect_all(), 15.0)
            except Exception as exc:  # closing must not hide the error that led here
                logger.warning("MCPToolTransform: stopping the servers failed: %s", _reason(exc))
        if loop is not None:
            loop.close()
        super().close()

    def __repr__(self) -> str:
        return f"MCPToolTransform(servers={sorted(self.server_configs)}, timeout={self.timeout})"


def render_content(blocks: list[Any]) -> str:
    """The text an MCP result shows the model: its text blocks, one per line; other blocks
    (images, audio, resources) as ``[type content]``."""
    return "\n".join(block.text if getattr(block, "type", None) == "text" else f"[{block.type} content]"
                     for block in blocks)  # fmt: skip


def _check_servers(servers: Any) -> None:
    if not isinstance(servers, dict) or not servers:
        raise ValueError("MCPToolTransform needs servers: {name: {'command': ..., 'args': [...]}}, at least one")
    for name, config in servers.items():
        if "." in name:
            raise ValueError(f"MCPToolTransform: server name {name!r} must not contain '.' (calls are server.tool)")
        if not isinstance(config, dict) or not isinstance(config.get("command"), str):
            raise ValueError(f"MCPToolTransform: servers[{name!r}] needs a 'command' string, got {config!r}")
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"MCPToolTransform: servers[{name!r}] has unknown keys {unknown}; known: {sorted(_CONFIG_KEYS)}"
            )
        if not all(isinstance(arg, str) for arg in config.get("args", [])):
            raise ValueError(f"MCPToolTransform: servers[{name!r}]['args'] must be a list of strings")


def _reason(exc: BaseException) -> str:
    """One line for ``exc``; an exception group (the mcp client's task groups) by its first leaf."""
    while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
