"""Weight-sync bus: the learner publishes versioned weights, every inference worker receives them.

Two implementations of :mod:`rlpost.transport.bus_types`'s interface: `LocalWeightBus` (one
process; each receiver gets its own copy of the latest update) and `TorchWeightPublisher` (rank 0,
the learner) / `TorchWeightReceiver` (ranks 1..N, one per inference worker): a bare gloo (CPU) or
NCCL (GPU) backend on a `TCPStore` of the bus's own, never the global default group (vLLM owns
one in its worker).

Protocol (store keys under `rlpost-bus/gen{g}/`, g = the generation):

1. The publisher hosts the `TCPStore` (`host`, `port`; port 0 picks a free one) and hands
   `publisher.spec` (a `BusSpec`) to every worker, which builds `TorchWeightReceiver(spec, rank)`.
2. Connect (`connect()`, or lazily in the first `publish` / `receive`): each rank sets
   `joined/{rank}` and waits up to `timeout_s` for all the others (a missing rank is named, NCCL
   never starts a communicator without it, and the timeout can be retried), then builds the
   backend on the prefix `pg/`.
3. Update s (0, 1, ... within a generation): the publisher plans per-dtype buckets of `bucket_mb`
   (`bucketing.plan_buckets`), stores the layout once under `layout/{signature}`, sets
   `update/{s}` = {version, layout} and broadcasts the buckets from rank 0, two in flight: metadata
   travels over the store, the group carries only bucket bytes (no checksum: TCP / NCCL deliver
   exact bytes; the integration test checks bit equality). A receiver waits for `update/{s}`,
   receives into fresh buckets, hands out views (no copies) and sets `done/{s}/{rank}`. `publish`
   returns once every `done` is set; `publish(wait=False)` returns once the bytes are sent and
   leaves the `done` keys to `confirm` (called by the next `publish`), so the receivers' reload
   overlaps the publisher's next work.
4. Versions: `publish` refuses a version below the last published (`ValueError`); a receiver
   refuses one below what it holds (`WeightSyncError`, after draining the bytes so the group stays
   in step). An equal version is a resend and is accepted.
5. Timeouts: store waits, every collective and the backend carry `timeout_s`. A timeout or a dead
   peer (gloo sees the closed socket at once; NCCL only by the timeout) raises `WeightSyncError`
   with the version, generation, suspect ranks and elapsed time. The failing side destroys its
   backend, so the others fail fast too; a failing receiver sets `failed/{s}/{rank}`, and a failing
   publisher waits up to 1 s for those reports: the suspects are the receivers that stayed silent.
   Both sides then refuse work until `reform`. A `receive` that finds no update announced in time
   leaves the group usable.
6. Recovery: `spec = publisher.reform(world_size)` opens generation g+1 (nothing of the broken
   group reused); each surviving worker calls `receiver.reform(spec, rank)`, a restarted one builds
   a receiver from `spec`, and the learner publishes its current weights again (the same version
   is fine). Whom to drop or restart is the caller's decision (the controller sees actor deaths).

Same node (``BusSpec.shared_memory``): before joining, the publisher offers a segment under
`shm-probe` (host memory for CPU weights on gloo, CUDA IPC for GPU weights); each receiver that
maps it sets `route/{rank}` to "shm", else "bus". "shm" receivers skip the collectives: the
publisher writes each bucket into the segment (grown when needed; `update/{s}` names it) and sets
`ready/{s}/{bucket}` at its ready points (every host bucket; only the last GPU one, after
`settle`); they read views valid until they confirm `done` (`receive` copies them). The others
form the backend (ranks renumbered) and get the same bucket memory broadcast: one copy serves
both routes. Versions, timeouts, failure reports and `reform` are the same on both.

NCCL: by default a timed-out NCCL collective makes torch's watchdog kill the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3); the bus builds its NCCL backend with mode 2 (abort the
communicator, keep the process), so a dead inference worker cannot take the learner with it.
"""

from __future__ import annotations

import threading
import time

from rlpost.transport.bucketing import as_named_list
from rlpost.transport.bus_group import BusGroup, full_device, resolve_backend
from rlpost.transport.bus_publisher import TorchWeightPublisher
from rlpost.transport.bus_receiver import TorchWeightReceiver
from rlpost.transport.bus_types import (
    BusSpec,
    NamedTensors,
    PublishStats,
    WeightPublisher,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
    check_version,
)

__all__ = [
    "BusGroup",
    "BusSpec",
    "LocalWeightBus",
    "LocalWeightReceiver",
    "NamedTensors",
    "PublishStats",
    "TorchWeightPublisher",
    "TorchWeightReceiver",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSyncError",
    "WeightUpdate",
    "full_device",
    "resolve_backend",
]


class LocalWeightBus:
    """In-process bus (tests, single process): publish snapshots, each receiver gets copies.

    A receiver that falls behind sees only the latest update, not every one.
    """

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._seq = 0
        self._latest: WeightUpdate | None = None

    def publish(self, named_tensors: NamedTensors, version: int) -> PublishStats:
        t0 = time.perf_counter()
        named = as_named_list(named_tensors)
        check_version(version, self._latest.version if self._latest else -1)
        snapshot = {name: t.detach().clone() for name, t in named}
        with self._cond:
            self._seq += 1
            self._latest = WeightUpdate(version, snapshot)
            self._cond.notify_all()
        num_bytes = sum(t.numel() * t.element_size() for t in snapshot.values())
        return PublishStats(version, 0, len(snapshot), 0, num_bytes, time.perf_counter() - t0)

    def receiver(self) -> LocalWeightReceiver:
        return LocalWeightReceiver(self)

    def close(self) -> None:
        self._latest = None


class LocalWeightReceiver:
    """Receiving end of a `LocalWeightBus`; `version` is the last version received (-1: none)."""

    def __init__(self, bus: LocalWeightBus):
        self._bus, self._seen, self.version = bus, 0, -1

    def receive(self, timeout_s: float | None = None) -> WeightUpdate:
        wait_s = self._bus.timeout_s if timeout_s is None else timeout_s
        with self._bus._cond:
            if not self._bus._cond.wait_for(lambda: self._bus._seq > self._seen, wait_s):
                raise WeightSyncError(f"no update published within {wait_s}s", version=None, elapsed_s=wait_s)
            self._seen, update = self._bus._seq, self._bus._latest
        assert update is not None
        self.version = update.version
        return WeightUpdate(update.version, {name: t.clone() for name, t in update.tensors.items()})

    def close(self) -> None:
        pass
