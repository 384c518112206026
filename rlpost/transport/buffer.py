"""The buffer between collectors and the learner: bounded, batched, with a staleness cap.

Env pools ``put`` whole GRPO groups; the learner ``take``s a batch. :class:`LocalBuffer` (a deque
under a condition variable) runs in process or inside the Ray actor, whose one client is
:class:`RayBuffer` (:func:`rlpost.actors.buffer.start_buffer`); a put travels GroupWriter ->
RayBuffer -> LocalBuffer. One actor call moves a whole batch: single-item Ray queue calls cost
~2.5 ms each here, batched ones ~1000x less per item.

A LocalBuffer also has a ReplayBuffer's API (also as ``RayReplayBuffer(replay_buffer_cls=
LocalBuffer, ...)``); deviation: ``extend`` waits for room (backpressure) and ``sample`` takes
the oldest groups, each exactly once, instead of drawing at random with replacement.

Rules:
- Backpressure: ``put`` blocks while the buffer is full, up to ``timeout_s``, then raises
  :class:`BufferTimeout` with nothing put. A put is atomic: its groups go in together as soon as
  one slot is free, so the buffer may hold up to one batch beyond its capacity. (Group by group
  left a timed-out batch half in, not puttable again without duplicates; waiting for room for
  the whole batch could deadlock with a consumer waiting for a full step after a short DAPO batch.)
- Staleness: a group more than ``max_staleness`` policy versions behind the consumer's is
  dropped and counted. Nothing else is ever dropped. Every blocking call has a timeout.
- Reservations: a producer ``reserve``s room for its next batch *before* generating it (its next
  ``put`` releases it), so two producers never generate for the same free slots (without it, 2
  env pools over a one-step buffer generated 18% of their groups only to see them dropped stale).

Producer positions: a put may carry its producer's state (its prompt-stream position), stored
under the same lock, so :meth:`LocalBuffer.snapshot`'s groups and positions agree: a checkpoint
loses no completed group and repeats none.

Surviving a lost actor, for groups that carry a ``seq`` (an env pool numbers its groups 1, 2, ...
across its restarts):
- Replays are harmless: a group whose ``seq`` is not above its producer's last accepted one is skipped.
- Fencing: :meth:`LocalBuffer.fence` (when a dead producer is replaced) returns its state and
  refuses later puts of an older ``epoch``: a put the dead producer left in flight cannot land.
- Acknowledgements: the consumer passes ``acknowledged`` (per producer, the highest ``seq`` it
  received, took or was told dropped) to :meth:`LocalBuffer.take`; each :class:`PutReceipt` hands
  it back to the producer, which keeps every group until then. A new buffer actor is started with
  the consumer's acknowledgements and the producers put again what they keep: nothing completed
  is lost or taken twice. ``take`` reports stale drops so the consumer counts each once.

The producer's side is :class:`~rlpost.transport.group_writer.GroupWriter`. Items are opaque
except for ``policy_version`` and, when present, ``producer`` and ``seq`` (attributes or keys).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpost.runtime.actors import ActorLost, CallTimeout, alive, kill


class BufferTimeout(TimeoutError):
    """A put or take waited ``timeout_s`` without completing."""


class BufferLost(ActorLost):
    """The buffer actor died; its client's call cannot complete."""


@dataclass(frozen=True)
class BufferStats:
    size: int
    capacity: int
    num_put: int
    num_got: int
    num_dropped_stale: int
    put_wait_s: float  # total time producers spent blocked (backpressure)
    last_seqs: dict[str, int] = field(default_factory=dict)  # producer -> highest seq accepted


@dataclass
class BufferSnapshot:
    """The groups waiting in the buffer and each producer's state after its last put (plus the
    sequence numbers and acknowledgements, for a buffer rebuilt after its actor died)."""

    groups: list[Any]
    producer_states: dict[str, Any]
    last_seqs: dict[str, int] = field(default_factory=dict)
    acknowledged: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PutReceipt:
    """What a put tells its producer: whether the buffer took the batch (False: the producer was
    fenced off) and the consumer's acknowledgement for it (the highest ``seq`` received)."""

    accepted: bool
    acknowledged: int


@dataclass(frozen=True)
class Taken:
    """A take's groups and the groups the buffer dropped as stale since the last take's reply:
    how many, and per producer the highest ``seq`` among them."""

    groups: list[Any]
    num_dropped_stale: int
    dropped_seqs: dict[str, int]


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def policy_version_of(group: Any) -> int:
    return int(_field(group, "policy_version"))


class LocalBuffer:
    """Bounded FIFO of groups with blocking, batched put/take and a staleness cap.

    Args:
        max_staleness: policy versions a group may lag the consumer's (None: never dropped).
        batch_size: groups per :meth:`sample` when it is not given one.
        wait_s: how long :meth:`extend` / :meth:`sample` wait, then :class:`BufferTimeout`.
        report: called with the :class:`BufferStats` after each put, take and restore, outside
            the lock (the service's metrics).
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int | None = None,
        *,
        batch_size: int | None = None,
        wait_s: float = 600.0,
        report: Any = None,
    ):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.wait_s = wait_s
        self.report = report
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._num_put = self._num_got = self._num_dropped_stale = 0
        self._put_wait_s = 0.0
        self._producer_states: dict[str, Any] = {}
        self._reserved: dict[str, int] = {}  # producer -> slots held for its next put
        self._last_seqs: dict[str, int] = {}  # producer -> highest seq accepted
        self._epochs: dict[str, int] = {}  # producer -> lowest epoch still accepted (fence)
        self._acknowledged: dict[str, int] = {}  # producer -> highest seq the consumer received
        self._unreported: list[Any] = []  # dropped as stale, not yet in a take's reply

    def put(
        self,
        groups: Sequence[Any],
        timeout_s: float,
        producer: str | None = None,
        producer_state: Any = None,
        epoch: int = 0,
        force: bool = False,
    ) -> PutReceipt:
        """Append ``groups`` together once a slot is free, skipping replays, refusing a fenced
        ``epoch`` (module docstring); the producer's reservation is released first (it held the
        room for these). ``force``: no wait for room (a producer putting again what a dead
        buffer held: waiting could block the consumer that rebuilds it).
        """
        try:
            return self._put(groups, timeout_s, producer, producer_state, epoch, force)
        finally:
            self._report()

    def _put(self, groups: Sequence[Any], timeout_s: float, producer: str | None, producer_state: Any, epoch: int,
             force: bool) -> PutReceipt:  # fmt: skip
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if producer is not None and self._reserved.pop(producer, 0):
                self._cond.notify_all()
            if producer is not None and epoch < self._epochs.get(producer, 0):
                return self._receipt(producer, accepted=False)
            last = self._last_seqs.get(producer, 0) if producer is not None else 0
            new = [g for g in groups if _field(g, "seq") is None or _field(g, "seq") > last]
            start = time.monotonic()
            while new and not force and len(self._items) >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferTimeout(
                        f"buffer full ({self.capacity} groups) for {timeout_s:.1f}s: none of {len(new)} groups put"
                    )
                self._cond.wait(left)
            self._put_wait_s += time.monotonic() - start
            self._items.extend(new)
            self._num_put += len(new)
            seqs = [_field(g, "seq") for g in new if _field(g, "seq") is not None]
            if producer is not None:
                if seqs:
                    self._last_seqs[producer] = max(seqs)
                self._producer_states[producer] = producer_state
            self._cond.notify_all()
            return self._receipt(producer, accepted=True)

    def _receipt(self, producer: str | None, accepted: bool) -> PutReceipt:
        return PutReceipt(accepted, self._acknowledged.get(producer, 0))

    def reserve(self, num_groups: int, timeout_s: float, producer: str | None = None) -> bool:
        """Wait until ``num_groups`` more groups fit (capped at the capacity) beside what is held
        and what *other* producers reserved, then hold that room for ``producer`` until its next
        put; False on timeout (nothing held). A new reservation replaces the producer's old one
        (a restarted producer leaks no room); without ``producer`` it only waits.
        """
        need = min(num_groups, self.capacity)
        with self._cond:
            self._reserved.pop(producer, None)
            held = lambda: sum(self._reserved.values())  # noqa: E731
            if not self._cond.wait_for(lambda: self.capacity - len(self._items) - held() >= need, timeout=timeout_s):
                return False
            if producer is not None:
                self._reserved[producer] = need
            return True

    def take(
        self,
        num_groups: int,
        timeout_s: float,
        current_version: int | None = None,
        acknowledged: dict[str, int] | None = None,
    ) -> Taken:
        """Take exactly ``num_groups`` fresh groups, oldest first, waiting up to ``timeout_s`` (on
        a timeout nothing is taken). With ``current_version`` stale groups are dropped first,
        reported in this or the next successful take's reply.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        try:
            return self._take(num_groups, timeout_s, current_version, acknowledged)
        finally:
            self._report()

    def _take(self, num_groups: int, timeout_s: float, current_version: int | None,
              acknowledged: dict[str, int] | None) -> Taken:  # fmt: skip
        deadline = time.monotonic() + timeout_s
        with self._cond:
            for producer, seq in (acknowledged or {}).items():
                self._acknowledged[producer] = max(seq, self._acknowledged.get(producer, 0))
            while True:
                if current_version is not None:
                    self._drop_stale(current_version)
                if len(self._items) >= num_groups:
                    batch = [self._items.popleft() for _ in range(num_groups)]
                    self._num_got += num_groups
                    dropped, self._unreported = self._unreported, []
                    self._cond.notify_all()
                    return Taken(batch, len(dropped), _highest_seqs(dropped))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferTimeout(
                        f"waited {timeout_s:.1f}s for {num_groups} groups, buffer holds {len(self._items)}"
                    )
                self._cond.wait(left)

    def get(self, num_groups: int, timeout_s: float, current_version: int | None = None) -> list[Any]:
        """:meth:`take`'s groups alone (for a consumer that needs no drop report)."""
        return self.take(num_groups, timeout_s, current_version).groups

    def drop_stale(self, current_version: int) -> int:
        with self._cond:
            return self._drop_stale(current_version)

    def _drop_stale(self, current_version: int) -> int:
        if self.max_staleness is None:
            return 0
        fresh, stale = deque(), []
        for g in self._items:
            (fresh if current_version - policy_version_of(g) <= self.max_staleness else stale).append(g)
        if stale:
            self._items = fresh
            self._num_dropped_stale += len(stale)
            self._unreported.extend(stale)
            self._cond.notify_all()
        return len(stale)

    def fence(self, producer: str, epoch: int) -> Any:
        """Accept ``producer``'s puts only from ``epoch`` on (a dead producer replaced); returns its
        state after its last accepted put and releases its reservation."""
        with self._cond:
            self._epochs[producer] = max(epoch, self._epochs.get(producer, 0))
            if self._reserved.pop(producer, 0):
                self._cond.notify_all()
            return self._producer_states.get(producer)

    def drain(self) -> list[Any]:
        """Remove and return every group held (for a checkpoint); nothing is counted as dropped."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    def snapshot(self) -> BufferSnapshot:
        """A copy of the waiting groups, producer states and sequence numbers, under one lock."""
        with self._cond:
            return BufferSnapshot(
                list(self._items), dict(self._producer_states), dict(self._last_seqs), dict(self._acknowledged)
            )

    def restore(self, snapshot: BufferSnapshot) -> None:
        """Put a checkpoint back into an empty buffer (beyond the capacity if need be: it held
        these groups)."""
        with self._cond:
            if self._items:
                raise RuntimeError(f"restore needs an empty buffer, it holds {len(self._items)} groups")
            self._items.extend(snapshot.groups)
            self._num_put = len(snapshot.groups)
            self._producer_states = dict(snapshot.producer_states)
            self._last_seqs = dict(snapshot.last_seqs)
            self._acknowledged = dict(snapshot.acknowledged)
            self._reserved.clear()  # the producers that held room are gone or start again
            self._cond.notify_all()
        self._report()

    def producer_state(self, producer: str) -> Any:
        """``producer``'s state after its last put (None before its first)."""
        with self._cond:
            return self._producer_states.get(producer)

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats(
                size=len(self._items),
                capacity=self.capacity,
                num_put=self._num_put,
                num_got=self._num_got,
                num_dropped_stale=self._num_dropped_stale,
                put_wait_s=self._put_wait_s,
                last_seqs=dict(self._last_seqs),
            )

    def _report(self) -> None:
        if self.report is not None:
            self.report(self.stats())

    # ------------------------------------------------------------------ a ReplayBuffer's API

    def extend(self, groups: Sequence[Any]) -> list[int]:
        """Put ``groups`` (waiting up to ``wait_s`` for room); their write positions."""
        groups = list(groups)
        with self._cond:
            first = self._num_put
        self.put(groups, self.wait_s)
        return list(range(first, first + len(groups)))

    def add(self, group: Any) -> int:
        return self.extend([group])[0]

    def sample(self, batch_size: int | None = None, current_version: int | None = None) -> list[Any]:
        """Take the ``batch_size`` oldest groups (each is sampled once), waiting up to
        ``wait_s``; with ``current_version``, stale groups are dropped first."""
        size = batch_size if batch_size is not None else self.batch_size
        if size is None:
            raise RuntimeError("LocalBuffer.sample needs a batch size: pass batch_size= to it or to the buffer")
        return self.take(size, self.wait_s, current_version).groups

    def empty(self) -> None:
        """Remove every group held (not counted as dropped)."""
        self.drain()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def write_count(self) -> int:
        """Groups put so far (what a restored buffer held counts as put)."""
        with self._cond:
            return self._num_put


class BufferMetrics:
    """A LocalBuffer's ``report`` in a run: its size and stale drops as the run's ``buffer``
    metrics (called in the buffer's actor, after each put, take and restore)."""

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self._metrics: Any = None  # made in the actor, on the first report

    def __call__(self, stats: BufferStats) -> None:
        from rlpost.record.metrics import RoleMetrics

        if self._metrics is None:
            self._metrics = RoleMetrics("buffer", self.run_name, "buffer")
        self._metrics.record(size=stats.size, groups_dropped_stale=stats.num_dropped_stale)


def _highest_seqs(groups: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        producer, seq = _field(g, "producer"), _field(g, "seq")
        if producer is not None and seq is not None:
            out[producer] = max(seq, out.get(producer, 0))
    return out


class RayBuffer:
    """The one client of the buffer actor; :class:`LocalBuffer`'s interface, one actor call per
    method, waited for ``timeout_s`` plus ``rpc_margin_s``: a dead actor is an error, never a hang:

        the actor died or was killed                -> BufferLost (an ActorLost of ``name``)
        no reply within the call's bound            -> CallTimeout(``name``): alive but silent
        the buffer's own wait ran out (full, empty) -> BufferTimeout, as LocalBuffer raises it

    Pickled (sent to an env pool) it is a copy of the handle, which does not own the actor.
    """

    def __init__(self, handle: Any, name: str = "buffer", rpc_margin_s: float = 30.0):
        self.handle, self.name, self.rpc_margin_s = handle, name, rpc_margin_s

    def put(
        self,
        groups: Sequence[Any],
        timeout_s: float,
        producer: str | None = None,
        producer_state: Any = None,
        epoch: int = 0,
        force: bool = False,
    ) -> PutReceipt:
        return self._call(timeout_s, "put", list(groups), timeout_s, producer, producer_state, epoch, force)

    def take(
        self,
        num_groups: int,
        timeout_s: float,
        current_version: int | None = None,
        acknowledged: dict[str, int] | None = None,
    ) -> Taken:
        return self._call(timeout_s, "take", num_groups, timeout_s, current_version, acknowledged)

    def get(self, num_groups: int, timeout_s: float, current_version: int | None = None) -> list[Any]:
        return self.take(num_groups, timeout_s, current_version).groups

    def reserve(self, num_groups: int, timeout_s: float, producer: str | None = None) -> bool:
        return self._call(timeout_s, "reserve", num_groups, timeout_s, producer)

    def fence(self, producer: str, epoch: int) -> Any:
        return self._call(0.0, "fence", producer, epoch)

    def drop_stale(self, current_version: int) -> int:
        return self._call(0.0, "drop_stale", current_version)

    def drain(self) -> list[Any]:
        return self._call(0.0, "drain")

    def stats(self) -> BufferStats:
        return self._call(0.0, "stats")

    def snapshot(self) -> BufferSnapshot:
        return self._call(0.0, "snapshot")

    def restore(self, snapshot: BufferSnapshot) -> None:
        self._call(0.0, "restore", snapshot)

    def producer_state(self, producer: str) -> Any:
        return self._call(0.0, "producer_state", producer)

    # what the supervisor and the watchdog ask of every client
    @property
    def names(self) -> list[str]:
        return [self.name]

    def alive(self) -> bool:
        """Whether Ray's record says the actor is alive and holds the name (never asks the actor)."""
        return alive(self.name, self.handle)

    def kill(self) -> None:
        kill(self.handle)

    def _call(self, timeout_s: float, method: str, *args: Any) -> Any:
        """``method(*args)`` in the actor, whose own wait is ``timeout_s``."""
        import ray

        bound = timeout_s + self.rpc_margin_s
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=bound)
        except ray.exceptions.GetTimeoutError:
            raise CallTimeout(f"{self.name} did not answer {method} within {bound:.1f}s", self.name) from None
        except ray.exceptions.RayActorError as exc:
            raise BufferLost(f"the buffer actor died: {str(exc).strip().splitlines()[0]}", self.name) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, BufferTimeout):
                raise BufferTimeout(str(cause).splitlines()[-1]) from None
            raise
