"""The ``buffer`` actor: a thin Ray shell around :class:`rlpost.transport.buffer.LocalBuffer`.

It is a threaded actor (``max_concurrency`` > 1) so that a producer blocked in ``put`` by
backpressure does not stop the learner's ``take`` from running and freeing space.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from rlpost.transport.buffer import BufferSnapshot, BufferStats, LocalBuffer, PutReceipt, RayBuffer, Taken


class BufferActor:
    def __init__(self, capacity: int, max_staleness: int | None, run_name: str = ""):
        from rlpost.metrics import RoleMetrics

        self.buffer = LocalBuffer(capacity, max_staleness)
        self.metrics = RoleMetrics("buffer", run_name, "buffer")

    def put(
        self,
        groups: Sequence[Any],
        timeout_s: float,
        producer: str | None = None,
        producer_state: Any = None,
        epoch: int = 0,
        force: bool = False,
    ) -> PutReceipt:
        try:
            return self.buffer.put(groups, timeout_s, producer, producer_state, epoch, force)
        finally:
            self._report()

    def take(
        self, num_groups: int, timeout_s: float, current_version: int | None, acknowledged: dict[str, int] | None = None
    ) -> Taken:
        try:
            return self.buffer.take(num_groups, timeout_s, current_version, acknowledged)
        finally:
            self._report()

    def fence(self, producer: str, epoch: int) -> Any:
        return self.buffer.fence(producer, epoch)

    def _report(self) -> None:
        stats = self.buffer.stats()
        self.metrics.record(size=stats.size, groups_dropped_stale=stats.num_dropped_stale)

    def reserve(self, num_groups: int, timeout_s: float, producer: str | None = None) -> bool:
        return self.buffer.reserve(num_groups, timeout_s, producer)

    def drop_stale(self, current_version: int) -> int:
        return self.buffer.drop_stale(current_version)

    def drain(self) -> list[Any]:
        return self.buffer.drain()

    def stats(self) -> BufferStats:
        return self.buffer.stats()

    def snapshot(self) -> BufferSnapshot:
        return self.buffer.snapshot()

    def restore(self, snapshot: BufferSnapshot) -> None:
        self.buffer.restore(snapshot)
        self._report()

    def producer_state(self, producer: str) -> Any:
        return self.buffer.producer_state(producer)


def start_buffer(
    capacity: int,
    max_staleness: int | None,
    *,
    name: str = "buffer",
    namespace: str | None = None,
    num_cpus: float = 0.0,
    max_concurrency: int = 16,
    run_name: str = "",
) -> RayBuffer:
    """Start the named buffer actor and return a client for it."""
    handle = (
        ray.remote(BufferActor)
        .options(name=name, namespace=namespace, num_cpus=num_cpus, max_concurrency=max_concurrency)
        .remote(capacity, max_staleness, run_name)
    )
    return RayBuffer(handle)
