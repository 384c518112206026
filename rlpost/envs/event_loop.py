"""One asyncio event loop on a thread of its own, for transforms whose clients are coroutines.

Trap: the env's hooks may run in any thread, some of which already run a loop of their own, where
``loop.run_until_complete`` fails; and the MCP sessions' and the browser's connections are bound
to the loop that opened them. :class:`EventLoopThread` keeps one loop on a daemon thread for the
transform's lifetime; ``run(coro, timeout_s)`` submits a coroutine to it and waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class EventLoopThread:
    """A running event loop on a daemon thread named ``name``; ``close()`` stops it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the loop and return its result; ``TimeoutError`` after ``timeout_s``
        (the coroutine is cancelled). Its exceptions propagate."""
        if not self.running:
            coro.close()
            raise RuntimeError("the event loop thread is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timeout after {timeout_s}s") from None

    def close(self) -> None:
        """Stop the loop and wait for its thread (idempotent)."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self.loop.close()
