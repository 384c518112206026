"""Tenants take turns (:class:`FairTurns`) and each has a bound on its queued work (:class:`Admission`).

The trainer runs one call at a time and each engine a few; a tenant that sends as fast as it can
must not starve the others. Every call into an actor first waits for a turn at that actor: each
tenant's calls wait in their arrival order, and the tenants with a call waiting are served in
rotation, one call each. With K tenants always waiting, each gets one call in K.

Each tenant may have at most ``max_pending_per_tenant`` requests accepted and not finished; past
that a new request is answered 429 ("try again later"), which the SDK retries with back-off. A
request that is its model's next ``seq_id`` is always accepted, since requests queued behind it
could otherwise never run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class Busy(Exception):
    """A tenant's queue is full: the client should try again later (HTTP 429)."""


class FairTurns:
    """``slots`` calls at a time at one actor, granted to the waiting tenants in rotation."""

    def __init__(self, slots: int = 1):
        self.slots = slots
        self.active = 0
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}
        self._rotation: collections.deque[str] = collections.deque()
        self.granted: collections.Counter[str] = collections.Counter()  # turns each tenant had

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    async def _acquire(self, tenant: str) -> None:
        if self.active < self.slots and not self._rotation:
            self.active += 1
            self.granted[tenant] += 1
            return
        future = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, collections.deque())
        queue.append(future)
        if tenant not in self._rotation:
            self._rotation.append(tenant)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as it was cancelled: hand it on
                self._release()
            else:
                self._forget(tenant, future)
            raise

    def _release(self) -> None:
        self.active -= 1
        while self._rotation and self.active < self.slots:
            tenant = self._rotation.popleft()
            queue = self._waiting[tenant]
            future = queue.popleft()
            if queue:
                self._rotation.append(tenant)
            else:
                del self._waiting[tenant]
            if not future.done():
                self.active += 1
                self.granted[tenant] += 1
                future.set_result(None)

    def _forget(self, tenant: str, future: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(future)
        if not queue:
            del self._waiting[tenant]
            with contextlib.suppress(ValueError):
                self._rotation.remove(tenant)


class Admission:
    """Each tenant's requests accepted and not finished, bounded (module docstring)."""

    def __init__(self, max_pending_per_tenant: int):
        self.limit = max_pending_per_tenant
        self.pending: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # requests answered "try again later"

    def check(self, tenant: str, *, unblocks: bool = False) -> None:
        """Raise :class:`Busy` when ``tenant`` is at its bound, unless the request ``unblocks``
        others (its model's next ``seq_id``)."""
        if self.pending[tenant] >= self.limit and not unblocks:
            self.refused[tenant] += 1
            raise Busy(f"tenant {tenant!r} has {self.pending[tenant]} requests pending (max_pending_per_tenant="
                       f"{self.limit}); try again later")  # fmt: skip

    def started(self, tenant: str) -> None:
        self.pending[tenant] += 1

    def finished(self, tenant: str) -> None:
        self.pending[tenant] -= 1
        if self.pending[tenant] <= 0:
            del self.pending[tenant]
