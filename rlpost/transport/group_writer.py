"""GroupWriter: one producer's exactly-once writes into the buffer (guarantees: :mod:`rlpost.transport.buffer`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlpost.transport.buffer import BufferLost, BufferTimeout, PutReceipt

DEFAULT_PUT_TIMEOUT_S = 600.0


class GroupWriter:
    """One producer's exactly-once writes into a :class:`LocalBuffer` (or a :class:`RayBuffer`).

    ``extend(groups)`` (a replay buffer's call) numbers the groups (``Group.producer``,
    ``Group.seq`` = 1, 2, ... continued across restarts from ``num_groups_put``), keeps them in
    :attr:`outbox` until the receipt acknowledges them, and puts them in one call with
    ``state()`` (read after the numbering) and ``epoch``; a fenced put raises.
    :meth:`wait_for_room` reserves room before a batch is generated, so the pipeline stays one
    batch deep and no batch ages in a queue. When the buffer dies (:class:`BufferLost`) a call
    waits up to ``buffer_wait_s`` for :meth:`set_buffer`, which puts the outbox into the new one.

    Args:
        producer: unique in the run (an env pool's actor name).
        epoch: the producer's incarnation (the buffer refuses older epochs once fenced).
        state: returns the producer's state to store with each put (None: no state).
        put_timeout_s: how long a put, or the wait for room, may block on a full buffer before
            :class:`BufferTimeout` (a partial put cannot be retried without duplicates).
    """

    def __init__(
        self,
        buffer: Any,
        producer: str,
        *,
        epoch: int = 0,
        state: Callable[[], Any] | None = None,
        put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S,
        buffer_wait_s: float = DEFAULT_PUT_TIMEOUT_S,
    ) -> None:
        self.buffer, self.producer, self.epoch = buffer, producer, epoch
        self.state = state or (lambda: None)
        self.put_timeout_s, self.buffer_wait_s = put_timeout_s, buffer_wait_s
        self.outbox: list[Any] = []  # groups put and not yet acknowledged by the consumer
        self.num_groups_put = 0  # the last group's seq
        self.num_batches_put = 0
        self.put_s = 0.0  # seconds blocked on a full buffer (backpressure)
        self._changed = threading.Condition()  # guards buffer, outbox and the numbering
        self._generation = 0

    def __getstate__(self) -> dict[str, Any]:  # sent to a collector's actor: the lock is made there
        state = dict(self.__dict__)
        del state["_changed"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._changed = threading.Condition()

    def extend(self, groups: Sequence[Any]) -> None:
        """Number ``groups``, keep them and put them with the producer's new state. Even an
        empty put records the new position (e.g. the DAPO filter dropped every group)."""
        start = time.perf_counter()
        with self._changed:
            for group in groups:
                self.num_groups_put += 1
                group.producer, group.seq = self.producer, self.num_groups_put
            self.outbox.extend(groups)
            state = self.state()
        receipt = self._call(
            "put", list(groups), timeout_s=self.put_timeout_s, producer=self.producer, producer_state=state,
            epoch=self.epoch,
        )  # fmt: skip
        self._after_put(receipt)
        self.put_s += time.perf_counter() - start
        self.num_batches_put += 1

    def wait_for_room(self, num_groups: int, stop: threading.Event | None = None) -> bool:
        """Block until the buffer holds room for ``num_groups`` more groups of this producer (a
        reservation its next put releases); False when ``stop`` was set meanwhile."""
        if not hasattr(self.buffer, "reserve"):
            return True
        start = time.perf_counter()
        while not self._call("reserve", num_groups, 1.0, self.producer):
            if stop is not None and stop.is_set():
                return False
            if time.perf_counter() - start > self.put_timeout_s:
                raise BufferTimeout(f"{self.producer}: no room in the buffer for {self.put_timeout_s:.0f}s")
        self.put_s += time.perf_counter() - start
        return True

    def set_buffer(self, buffer: Any, timeout_s: float = 60.0) -> int:
        """Write to ``buffer`` (the old one died): put the outbox into it, beyond its capacity if
        need be (the old buffer held these groups); returns how many groups it took."""
        with self._changed:
            self.buffer = buffer
            self._generation += 1
            replay, state = list(self.outbox), self.state()
            self._changed.notify_all()
        receipt = buffer.put(
            replay, timeout_s=timeout_s, producer=self.producer, producer_state=state, epoch=self.epoch, force=True
        )
        self._after_put(receipt)
        return sum(g.seq > receipt.acknowledged for g in replay)

    def _after_put(self, receipt: PutReceipt) -> None:
        if not receipt.accepted:
            raise RuntimeError(f"{self.producer} (epoch {self.epoch}) was replaced: the buffer refuses its puts")
        with self._changed:
            self.outbox = [g for g in self.outbox if g.seq > receipt.acknowledged]

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the buffer; when it died, wait for :meth:`set_buffer` and call the new one."""
        while True:
            with self._changed:
                buffer, generation = self.buffer, self._generation
            try:
                return getattr(buffer, method)(*args, **kwargs)
            except BufferLost:
                self._wait_for_new_buffer(generation)

    def _wait_for_new_buffer(self, generation: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._generation != generation, timeout=self.buffer_wait_s):
                raise BufferLost(
                    f"{self.producer}: the buffer died and no new one came within {self.buffer_wait_s:.0f}s"
                )
