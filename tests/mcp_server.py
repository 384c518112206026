"""A tiny MCP server over stdio for the MCPToolTransform tests (no network): ``python mcp_server.py``.

Tools: ``add(a, b)``, ``echo(text)``, ``fail(message)`` (a tool error the model sees),
``sleep(seconds)`` (for timeouts), ``count()`` (calls so far: one process serves a transform's
whole life), ``pid()`` and ``run_python_code(python_code)``, which runs the code in rlpost's sandbox (as
the ``mcp-run-python`` server of TorchRL's test runs it in Pyodide): model-written code never
runs on the host here either.
"""

from __future__ import annotations

import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("rlpost-test-tools", log_level="ERROR")
_calls = {"count": 0}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    _calls["count"] += 1
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    _calls["count"] += 1
    return text


@server.tool()
def fail(message: str) -> str:
    """Fail with ``message``."""
    raise ToolError(message)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def count() -> int:
    """How many add/echo calls this server process has answered."""
    return _calls["count"]


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def run_python_code(python_code: str) -> str:
    """Run Python code in rlpost's sandbox; its output, or why it failed."""
    from rlpost.envs.tools import run_python

    result = run_python(python_code, timeout_s=10.0)
    return f"<status>{'success' if result.ok else 'error'}</status>\n<output>\n{result.output}</output>" + (
        "" if result.ok else f"\n<error>{result.error}</error>"
    )


if __name__ == "__main__":
    server.run()
