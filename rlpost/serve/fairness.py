"""Tenants take turns (:class:`FairTurns`) and each has a bound on its queued work (:class:`Admission`).

The trainer runs one call at a time and each engine a few; a tenant that sends as fast as it can
must not starve the others. Every call into an actor first waits for a turn at that actor: each
tenant's calls wait in their arrival order, and among the tenants with a call waiting the next
turn goes to the one that has held the actor least (fair queuing by time, not by count: a tenant
whose calls are ten times longer gets no more of the actor than one with short calls). With K
tenants always waiting, each gets 1/K of the actor's time.

Each tenant may have at most ``max_pending_per_tenant`` requests accepted and not finished; past
that a new request is answered 429 ("try again later"), which the SDK retries with back-off. A
request that is its model's next ``seq_id`` is always accepted, since requests queued behind it
could otherwise never run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable


class Busy(Exception):
    """A tenant's queue is full: the client should try again later (HTTP 429)."""


class FairTurns:
    """``slots`` calls at a time at one actor, shared by time among the tenants waiting (module
    docstring). ``held_s``: the seconds each tenant held a turn; ``on_held`` is told each turn's
    (tenant, seconds) as it ends; ``clock``: the time source (a test's can be stepped by hand).

    Each tenant has a virtual time: the seconds of turns it held, moved up to the time of the turn
    last granted when it starts to wait after a pause (so it gets its share from then on, not the
    time it missed). The next turn goes to the waiting tenant with the least, ties to the one
    waiting longest."""

    def __init__(self, slots: int = 1, on_held: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):  # fmt: skip
        self.slots, self.on_held, self.clock = slots, on_held, clock
        self.active = 0
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}  # in the order they began to wait
        self.vtime: dict[str, float] = {}
        self._now = 0.0  # the virtual time of the turn granted last
        self.granted: collections.Counter[str] = collections.Counter()  # turns each tenant had
        self.held_s: collections.Counter[str] = collections.Counter()

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        await self._acquire(tenant)
        start = self.clock()
        try:
            yield
        finally:
            held = self.clock() - start
            self.held_s[tenant] += held
            self.vtime[tenant] += held
            if self.on_held is not None:
                self.on_held(tenant, held)
            self._release()

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    @property
    def idle(self) -> bool:
        """No call holds a turn or waits for one."""
        return self.active == 0 and not self._waiting

    async def _acquire(self, tenant: str) -> None:
        if tenant not in self._waiting:  # not behind a call of its own: its time catches up
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), self._now)
        if self.active < self.slots and not self._waiting:
            self._grant(tenant)
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, collections.deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as it was cancelled: hand it on
                self._release()
            else:
                self._forget(tenant, future)
            raise

    def _grant(self, tenant: str) -> None:
        self.active += 1
        self.granted[tenant] += 1
        self._now = self.vtime[tenant]

    def _release(self) -> None:
        self.active -= 1
        while self._waiting and self.active < self.slots:
            tenant = min(self._waiting, key=self.vtime.__getitem__)  # the first of equals: waiting longest
            queue = self._waiting[tenant]
            future = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if not future.done():
                self._grant(tenant)
                future.set_result(None)

    def _forget(self, tenant: str, future: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(future)
        if not queue:
            del self._waiting[tenant]


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
