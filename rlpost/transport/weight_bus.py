"""Weight-sync bus: the learner publishes versioned weights, every inference worker receives them.

Two implementations behind one small interface:

- `LocalWeightBus` / `LocalWeightReceiver`: one process; `publish` snapshots (copies) the
  tensors, `receive` hands each receiver its own copy of the latest update.
- `TorchWeightPublisher` (rank 0, the learner) / `TorchWeightReceiver` (ranks 1..N, one per
  inference worker): a torch.distributed group of the bus's own, gloo on CPU and NCCL on GPU
  through the same code. It never touches the global default group (vLLM owns one in its
  worker): the group is a bare `ProcessGroupGloo` / `ProcessGroupNCCL` backend built on a
  `TCPStore`, without `init_process_group`, and collectives are called on it directly.

Protocol (store keys live under `rlpost-bus/gen{g}/`, g = the generation):

1. The publisher hosts the `TCPStore` (`host`, `port`; port 0 picks a free one) and hands
   `publisher.spec` (a `BusSpec`) to every worker, which builds `TorchWeightReceiver(spec, rank)`.
2. Connect (`connect()`, or lazily in the first `publish` / `receive`): each rank sets
   `joined/{rank}` and waits up to `timeout_s` for all the others (so a missing rank is named,
   NCCL never starts a communicator without it, and this timeout can simply be retried), then
   builds the backend on the prefix `pg/`.
3. Update s of a generation (s = 0, 1, ...): the publisher plans per-dtype buckets of
   `bucket_mb` (`bucketing.plan_buckets`), stores the layout once per generation under
   `layout/{signature}`, sets `update/{s}` = {version, layout}, and broadcasts the buckets from
   rank 0, two in flight. Metadata thus travels over the store and the group carries only
   bucket bytes; no checksum (TCP / NCCL deliver exact bytes; the integration test checks bit
   equality). A receiver waits for `update/{s}`, receives into fresh buckets, hands out views
   (no copies) and sets `done/{s}/{rank}`. `publish` returns once every `done` key is set, so
   every receiver then holds the version. `publish(wait=False)` returns once the buckets are
   sent and leaves the `done` keys to `confirm`, which the next `publish` calls first; the
   receivers' reload after their receive thus overlaps the publisher's next work.
4. Versions: `publish` refuses a version below the last published (`ValueError`); a receiver
   refuses one below what it holds (`WeightSyncError`, after draining the bytes so the group
   stays in step). An equal version is a resend and is accepted.
5. Timeouts: store waits, every collective (`work.wait(timeout)`) and the backend carry
   `timeout_s`. A timeout or a dead peer (gloo sees the closed socket at once; NCCL only by the
   timeout) raises `WeightSyncError` with the version, generation, suspect ranks and elapsed
   time. The failing side destroys its backend, so the others fail fast too; a failing receiver
   sets `failed/{s}/{rank}`, and a failing publisher waits up to 1 s for those reports: the
   suspects are the receivers that stayed silent (dead or stuck). Both sides then refuse work
   until `reform`. A `receive` that finds no update announced in time leaves the group usable.
6. Recovery: `spec = publisher.reform(world_size)` opens generation g+1 (fresh keys, nothing of
   the broken group reused); each surviving worker calls `receiver.reform(spec, rank)` and a
   restarted one builds a receiver from `spec` (ranks 1..world_size-1); the learner then
   publishes its current weights (the same version is fine). Whom to drop or restart is the
   caller's decision (the controller sees actor deaths).

Same node (``BusSpec.shared_memory``): the publisher offers a shared segment under `shm-probe`
before it joins: host memory (:mod:`rlpost.transport.shared_memory`) for CPU weights on gloo, GPU
memory exported over CUDA IPC (:mod:`rlpost.transport.cuda_ipc`) for GPU weights. Each receiver
tries to map it (a host segment from a CPU receiver on the node, a CUDA one from a receiver on
the same GPU) and sets `route/{rank}` to "shm" or "bus". The receivers on "shm" take no part in
the collectives: the publisher writes each bucket into the segment (growing it when an update
needs more room; the header `update/{s}` names the segment) and sets `ready/{s}/{bucket}` at the
segment's ready points (every bucket of host memory; only the last of GPU memory), and
they read the tensors as views of the segment, valid until they confirm `done` (`receive`
copies them; `receive_streamed` hands the views to its consumer). On a GPU both sides first
wait for their queued copies (the segment's `settle`) before they set those keys. The others
form the collective backend among themselves with the publisher (ranks renumbered), and the
publisher broadcasts the same bucket memory to them: one copy of the weights serves both.
Versions, timeouts, failure reports and `reform` are the same on both routes.

NCCL: by default a timed-out NCCL collective makes torch's watchdog kill the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3); the bus builds its NCCL backend with mode 2 (abort the
communicator, keep the process), so a dead inference worker cannot take the learner with it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import NamedTuple, Protocol

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from rlpost.transport import cuda_ipc, shared_memory
from rlpost.transport.bucketing import (
    BucketLayout,
    StreamedTensors,
    as_named_list,
    empty_buckets,
    flatten_bucket,
    plan_buckets,
    stream_buckets,
)
from rlpost.transport.cuda_ipc import CudaSegment, CudaSegmentRef
from rlpost.transport.shared_memory import SegmentRef, SharedSegment

# a dict, (name, tensor) pairs, or StreamedTensors (made while they are sent)
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StreamedTensors
_log = logging.getLogger(__name__)
Segment = SharedSegment | CudaSegment  # the publisher's shared buckets: host memory or GPU memory
_MAX_IN_FLIGHT = 2  # buckets the publisher keeps in flight: overlap flattening with sending, bound memory
_REPORT_GRACE_S = 1.0  # how long a failed publish waits for live receivers to report their side
_NCCL_ERROR_MODE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class WeightSyncError(RuntimeError):
    """A weight sync failed (timeout, dead peer, broken group); recover with `reform`. `peers`: the
    suspect ranks where known (publish: receivers that neither confirmed nor reported a failure of
    their own; connect: ranks that never joined; receive: [0], the publisher)."""

    def __init__(
        self,
        message: str,
        *,
        version: int | None = None,
        generation: int | None = None,
        peers: Iterable[int] = (),
        elapsed_s: float = 0.0,
    ):
        self.version, self.generation, self.peers, self.elapsed_s = version, generation, sorted(peers), elapsed_s
        super().__init__(
            f"weight sync of version {version} (generation {generation}) failed after {elapsed_s:.1f}s; "
            f"suspect peer ranks: {self.peers or 'unknown'}: {message}"
        )


@dataclass(frozen=True)
class PublishStats:
    """What one `publish` did. Made by the publisher, read by the learner's metrics."""

    version: int
    generation: int
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    connect_s: float = 0.0
    # the receivers by route (module docstring): reading from shared memory, or on the collective bus
    shm_receivers: int = 0
    bus_receivers: int = 0


class WeightUpdate(NamedTuple):
    """One received update: `version, tensors = receiver.receive()`; tensors in the sender's order."""

    version: int
    tensors: dict[str, torch.Tensor]


class WeightPublisher(Protocol):
    def publish(self, named_tensors: NamedTensors, version: int) -> PublishStats: ...
    def close(self) -> None: ...


class WeightReceiver(Protocol):
    version: int  # the last version received; -1 before the first

    def receive(self, timeout_s: float | None = None) -> WeightUpdate: ...
    def close(self) -> None: ...


def _check_version(version: int, last: int) -> None:
    if not isinstance(version, int) or version < last:
        raise ValueError(f"weight version must be an int >= the last published ({last}), got {version!r}")


# --------------------------------------------------------------------------------------- local


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
        _check_version(version, self._latest.version if self._latest else -1)
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


# --------------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class BusSpec:
    """How to join the bus. Made by `TorchWeightPublisher.spec`, read by each `TorchWeightReceiver`
    (it crosses process boundaries: plain, picklable data)."""

    host: str
    port: int
    world_size: int
    generation: int = 0
    backend: str = "gloo"
    bucket_mb: float = 64
    timeout_s: float = 60.0
    shared_memory: bool = True  # same-node receivers read the buckets from shared memory (CPU weights)
    # which publisher made the spec: a new publisher on the same host and port (one closed, another
    # started, e.g. a new weight sender for the same engines) is a new store to connect to
    session: str = ""


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "auto" -> "nccl" when CUDA and NCCL are available and the weights live on a GPU, else "gloo"."""
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"weight_sync.backend must be auto, nccl or gloo, got {backend!r}")
    if backend == "auto":
        gpu = device.type == "cuda" and torch.cuda.is_available() and torch.distributed.is_nccl_available()
        return "nccl" if gpu else "gloo"
    return backend


def full_device(device: torch.device) -> torch.device:
    """ "cuda" -> "cuda:<current>": NCCL binds its communicator to one indexed device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _connect_store(spec: BusSpec, is_master: bool) -> TCPStore:
    return TCPStore(spec.host, spec.port, None, is_master, timedelta(seconds=spec.timeout_s), wait_for_workers=False)


class BusGroup:
    """One generation of the bus: its key space in the store and its collective backend."""

    def __init__(self, store: TCPStore, spec: BusSpec, rank: int, device: torch.device):
        self.spec, self.rank, self.device = spec, rank, device
        self.timeout = timedelta(seconds=spec.timeout_s)
        self.keys = PrefixStore(f"rlpost-bus/gen{spec.generation}/", store)
        self.backend = None
        self.shm_ranks: list[int] = []  # receivers that read from shared memory (module docstring)
        self.pids: dict[int, int] = {}  # their process ids
        self.bus_ranks: list[int] = list(range(spec.world_size))  # the publisher and the others

    def await_peers(self, wait_s: float, probe: Segment | None = None) -> Segment | None:
        """Announce this rank and wait (bounded) until every rank has, then agree on who reads
        from shared memory; safe to retry. ``probe``: the publisher's segment, offered to the
        receivers. Returns a receiver's mapping of it (None: this rank is on the bus)."""
        wait = timedelta(seconds=wait_s)
        everyone = range(self.spec.world_size)
        if self.rank == 0:  # the offer goes up before rank 0 counts as joined
            self.keys.set("shm-probe", json.dumps(probe.ref.to_dict() if probe is not None else None))
        self.keys.set(f"joined/{self.rank}", str(os.getpid()))
        self.keys.wait([f"joined/{r}" for r in everyone], wait)
        mapped = None
        if self.rank != 0:
            offer = json.loads(self.keys.get("shm-probe"))
            if offer is not None and self.spec.shared_memory:
                try:
                    mapped = _open_segment(offer, self.device)
                except Exception as exc:  # noqa: BLE001 - any failure to map leaves the bus, which always works
                    _log_fallback(exc, f"rank {self.rank} stays on the bus, the offered segment")
                    mapped = None
            self.keys.set(f"route/{self.rank}", "shm" if mapped is not None else "bus")
        receivers = [f"route/{r}" for r in everyone if r != 0]
        if receivers:
            self.keys.wait(receivers, wait)
        self.shm_ranks = [r for r in everyone if r != 0 and self.keys.get(f"route/{r}") == b"shm"]
        self.bus_ranks = [r for r in everyone if r not in self.shm_ranks]
        self.pids = {r: int(self.keys.get(f"joined/{r}")) for r in self.shm_ranks}  # same node: same PIDs
        return mapped

    @property
    def on_bus(self) -> bool:
        """Whether this rank takes part in the collectives (the publisher does when any
        receiver is on the bus)."""
        return self.rank in self.bus_ranks and len(self.bus_ranks) > 1

    def build_backend(self) -> None:
        """The collective backend over the bus ranks (renumbered 0..n-1); none when every
        receiver reads from shared memory."""
        if not self.on_bus:
            return
        store = PrefixStore("pg/", self.keys)
        rank, size = self.bus_ranks.index(self.rank), len(self.bus_ranks)
        self.backend = self._gloo(store, rank, size) if self.spec.backend == "gloo" else self._nccl(store, rank, size)

    def _gloo(self, store: PrefixStore, rank: int, size: int):
        opts = ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        local = self.spec.host in _LOOPBACK  # every rank on this host: talk over loopback
        device = (
            ProcessGroupGloo.create_device(hostname="127.0.0.1") if local else ProcessGroupGloo.create_default_device()
        )
        opts._devices = [device]
        return ProcessGroupGloo(store, rank, size, opts)

    def _nccl(self, store: PrefixStore, rank: int, size: int):
        from torch._C._distributed_c10d import ProcessGroupNCCL  # absent from CPU builds of torch

        opts = ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        opts.is_high_priority_stream = False
        previous = os.environ.get(_NCCL_ERROR_MODE)
        os.environ[_NCCL_ERROR_MODE] = "2"  # read by the constructor: abort on error, don't kill (docstring)
        try:
            backend = ProcessGroupNCCL(store, rank, size, opts)
        finally:
            if previous is None:
                del os.environ[_NCCL_ERROR_MODE]
            else:
                os.environ[_NCCL_ERROR_MODE] = previous
        backend.eager_connect_single_device(self.device)  # form the communicator now, not in the first broadcast
        return backend

    def broadcast(self, flat: torch.Tensor):
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        return self.backend.broadcast([flat], opts)

    def broadcast_all(self, flats: Iterable[torch.Tensor]) -> None:
        """Broadcast each tensor from rank 0 in turn, at most `_MAX_IN_FLIGHT` posted at once.

        The window bounds the sender's memory and how many ops can still be pending after a
        failure (gloo finishes or times out pending ops before its backend can be destroyed).
        """
        in_flight: deque = deque()
        for flat in flats:
            if len(in_flight) == _MAX_IN_FLIGHT:
                in_flight.popleft()[0].wait(self.timeout)
            in_flight.append((self.broadcast(flat), flat))  # keep `flat` alive until sent
        while in_flight:
            in_flight.popleft()[0].wait(self.timeout)

    def unconfirmed(self, ranks: Iterable[int], *patterns: str) -> list[int]:
        """The `ranks` for which none of the keys `pattern.format(rank)` is set (best effort)."""
        try:
            return [r for r in ranks if not any(self.keys.check([p.format(r)]) for p in patterns)]
        except (RuntimeError, OSError):
            return []  # the store is gone too: nothing to tell

    def abort(self) -> None:
        """Drop the backend now: destroying it closes its sockets, so the peers fail fast too."""
        if self.backend is not None:
            try:
                self.backend.abort()  # NCCL: abort the communicator; gloo: no-op, destruction closes
            except (RuntimeError, OSError):
                pass  # already broken; dropping it below is what matters
            self.backend = None


class _SyncFailure:
    """Turns torch/store errors of one operation into a `WeightSyncError` with its context."""

    def __init__(self, version: int | None, generation: int, peers: Callable[[], list[int]]):
        self.version, self.generation, self.peers, self.t0 = version, generation, peers, time.perf_counter()

    def error(self, message: str, cause: BaseException | None = None) -> WeightSyncError:
        detail = f"{message}: {cause}" if cause is not None else message
        return WeightSyncError(
            detail,
            version=self.version,
            generation=self.generation,
            peers=self.peers(),
            elapsed_s=time.perf_counter() - self.t0,
        )

    @contextmanager
    def guard(self, message: str) -> Iterator[None]:
        try:
            yield
        except WeightSyncError:
            raise
        except (RuntimeError, OSError) as exc:
            # The finished frames of the failed call hold gloo works, which own the group's
            # sockets: clear them now, or the sockets outlive the abort for as long as someone
            # keeps the exception, and the peers wait for their timeout instead of failing fast.
            traceback.clear_frames(exc.__traceback__)
            raise self.error(message, exc) from exc


class _TorchEnd:
    """What publisher and receiver share: the store client, the current group, failure state."""

    def __init__(self, spec: BusSpec, rank: int, device: torch.device, store: TCPStore):
        self.spec, self.rank, self.device, self._store = spec, rank, device, store
        self._group: BusGroup | None = None
        self._broken: str | None = None  # why the current generation is unusable
        self._seq = 0
        # shared memory of this generation: the publisher's segment, or a receiver's mapping of it
        self._segment: Segment | None = None

    @property
    def generation(self) -> int:
        return self.spec.generation

    def connect(self, timeout_s: float | None = None) -> float:
        """Join the current generation (no-op when joined); returns the seconds it took."""
        return self._join(timeout_s, version=None)

    def _join(self, wait_s: float | None, version: int | None) -> float:
        if self._broken:
            raise WeightSyncError(
                f"bus is broken ({self._broken}); call reform() first", version=version, generation=self.generation
            )
        if self._group is not None:
            return 0.0
        group = BusGroup(self._store, self.spec, self.rank, self.device)
        fail = _SyncFailure(
            version, self.generation, lambda: group.unconfirmed(range(self.spec.world_size), "joined/{}")
        )
        with fail.guard("not every rank joined the bus"):  # nothing built yet: connect can be retried
            mapped = group.await_peers(self.spec.timeout_s if wait_s is None else wait_s, self._offer())
        if self.rank != 0:
            self._use_segment(mapped)
        self._group = group
        with self._failing(fail, "could not build the bus group"):
            group.build_backend()
        return time.perf_counter() - fail.t0

    @contextmanager
    def _failing(self, fail: _SyncFailure, message: str, report: str | None = None) -> Iterator[None]:
        """Like `fail.guard`; on failure also set the key `report` (if given) for the publisher to
        see, and abort the group so that the peers stop waiting."""
        try:
            with fail.guard(message):
                yield
        except WeightSyncError as exc:
            if report and self._group is not None:
                try:
                    self._group.keys.set(report, str(exc)[:500])
                except (RuntimeError, OSError):
                    pass  # the publisher (and its store) is gone: nobody to tell
            self._broken = f"sync of version {exc.version} failed in generation {exc.generation}"
            if self._group is not None:
                self._group.abort()
            raise

    def _offer(self) -> Segment | None:
        """The segment the publisher offers its receivers (None: no shared memory)."""
        return None

    def _use_segment(self, segment: Segment | None) -> None:
        if self._segment is not None and self._segment is not segment:
            self._segment.close()
        self._segment = segment

    @property
    def _reads_shared_memory(self) -> bool:
        return self._group is not None and self.rank in self._group.shm_ranks

    def close(self) -> None:
        """Leave the group (its sockets close at once); the store goes with this object."""
        self._drop_group()
        self._broken = "closed"

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.abort()
        self._use_segment(None)
        self._group, self._broken, self._seq = None, None, 0


class _Unconfirmed(NamedTuple):
    """An update sent by ``publish(wait=False)``: what ``confirm`` needs to collect it."""

    seq: int
    version: int
    layout: BucketLayout
    fail: _SyncFailure


class TorchWeightPublisher(_TorchEnd):
    """Learner side (rank 0) of the distributed bus; hosts the store. See the module docstring.

    `world_size`: 1 + number of receivers. `host`: the address receivers dial (this node's IP on
    a cluster). `device`: where the weights live; with backend "auto" it picks NCCL for a GPU.
    `shared_memory`: offer receivers on this node the buckets in shared memory (CPU weights on
    gloo; GPU weights over CUDA IPC to receivers on the same GPU; module docstring).
    """

    def __init__(
        self,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "auto",
        device: str | torch.device | None = None,
        bucket_mb: float = 64,
        timeout_s: float = 60.0,
        shared_memory: bool = True,
    ):
        if world_size < 1 or bucket_mb <= 0 or timeout_s <= 0:
            raise ValueError(
                f"need world_size >= 1, bucket_mb > 0, timeout_s > 0; got {world_size}, {bucket_mb}, {timeout_s}"
            )
        device = full_device(torch.device(device if device is not None else "cpu"))
        spec = BusSpec(host, port, world_size, 0, resolve_backend(backend, device), bucket_mb, timeout_s, shared_memory,
                       session=uuid.uuid4().hex)  # fmt: skip
        if spec.backend == "nccl" and device.type != "cuda":
            raise ValueError(f"weight_sync.backend nccl needs the publisher's weights on a GPU, not {device}")
        store = _connect_store(spec, is_master=True)
        super().__init__(replace(spec, port=store.port), 0, device, store)
        self._version = -1
        self._layouts: set[str] = set()
        self._unconfirmed: _Unconfirmed | None = None
        self._last_plan: tuple[tuple, BucketLayout] | None = None  # (what it packs, layout)

    def _plan(self, named: list[tuple[str, torch.Tensor]], in_order: bool) -> BucketLayout:
        """The bucket layout of ``named``; the last one again when names, dtypes and shapes are
        the same (a learner publishes the same set every time: milliseconds saved per update)."""
        key = (in_order, self.spec.bucket_mb, tuple((name, t.dtype, t.shape) for name, t in named))
        if self._last_plan is None or self._last_plan[0] != key:
            layout = plan_buckets(named, int(self.spec.bucket_mb * 2**20), in_order=in_order)
            self._last_plan = (key, layout)
        return self._last_plan[1]

    def publish(self, named_tensors: NamedTensors, version: int, *, wait: bool = True) -> PublishStats:
        """Send `named_tensors` as `version` to every receiver; returns once all confirmed.

        ``wait=False`` returns once the bytes are sent: in shared memory or broadcast to the
        receivers on the bus, so the caller may change its tensors from then on. The receivers'
        confirmations are collected by :meth:`confirm`, which the next ``publish`` calls first
        (the shared segment is reused only after every reader confirmed). A failure found
        there raises from ``confirm`` (or that ``publish``) as it would have here.
        """
        self.confirm()
        _check_version(version, self._version)
        streamed = isinstance(named_tensors, StreamedTensors)
        named = named_tensors.placeholders() if streamed else as_named_list(named_tensors)
        layout = self._plan(named, streamed)
        t0 = time.perf_counter()
        connect_s = self._join(None, version)
        seq = self._seq
        fail = _SyncFailure(version, self.generation, lambda: self._silent_peers(seq))
        with self._failing(fail, "publish"):
            shared = self._shared_buckets(layout)
            self._announce(layout, version, seq)
            self._send(layout, iter(named_tensors) if streamed else dict(named), seq, shared)
        self._unconfirmed = _Unconfirmed(seq, version, layout, fail)
        if wait:
            self.confirm()
        return PublishStats(
            version,
            self.generation,
            len(named),
            layout.num_buckets,
            layout.num_bytes,
            time.perf_counter() - t0,
            connect_s,
            shm_receivers=len(self._group.shm_ranks),
            bus_receivers=len(self._group.bus_ranks) - 1,  # bus_ranks holds the publisher, rank 0
        )

    def close(self) -> None:
        self._unconfirmed = None
        super().close()

    @property
    def unconfirmed_version(self) -> int | None:
        """The version sent by ``publish(wait=False)`` whose confirmations are not collected yet."""
        return self._unconfirmed.version if self._unconfirmed is not None else None

    def confirm(self) -> None:
        """Wait (up to ``timeout_s``) until every receiver confirmed the update that
        ``publish(wait=False)`` sent; a no-op when there is none. A receiver that failed, exited
        or stayed silent raises WeightSyncError, and the bus then needs ``reform``."""
        pending, self._unconfirmed = self._unconfirmed, None
        if pending is None:
            return
        with self._failing(pending.fail, "publish"):
            self._await_done(pending.seq, pending.layout)
        self._seq, self._version = pending.seq + 1, pending.version

    @property
    def shared_memory_ranks(self) -> list[int]:
        """The receivers of the current generation that read from shared memory (known once
        connected; the others are on the collective bus)."""
        return list(self._group.shm_ranks) if self._group is not None else []

    def reform(self, world_size: int | None = None) -> BusSpec:
        """Drop the current group and open the next generation; hand the result to the receivers.
        An update whose confirmations were not collected is forgotten (its version is sent again)."""
        self._unconfirmed = None
        self._drop_group()
        self._layouts.clear()
        world_size = self.spec.world_size if world_size is None else world_size
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.spec = replace(self.spec, world_size=world_size, generation=self.generation + 1)
        return self.spec

    def _silent_peers(self, seq: int) -> list[int]:
        """Receivers that neither confirmed update `seq` nor reported a failure of their own.

        Live receivers only notice a broken broadcast once this side's backend is gone, so abort
        first and give their `failed/` reports a moment: what stays silent is dead or stuck.
        """
        group = self._group
        pending = group.unconfirmed(range(1, self.spec.world_size), f"done/{seq}/{{}}")
        group.abort()
        deadline = time.monotonic() + min(_REPORT_GRACE_S, self.spec.timeout_s)
        silent = pending
        while silent and time.monotonic() < deadline:
            time.sleep(0.05)
            silent = group.unconfirmed(pending, f"done/{seq}/{{}}", f"failed/{seq}/{{}}")
        return silent

    def _offer(self) -> Segment | None:
        if not self.spec.shared_memory or (self.device.type == "cpu" and self.spec.backend != "gloo"):
            return None
        if self._segment is None:
            try:
                self._segment = self._new_segment(shared_memory.HEADER_BYTES)
            except Exception as exc:  # noqa: BLE001 - without a segment every receiver uses the bus, which works
                _log_fallback(exc, "no shared segment offered, every receiver uses the bus")
                return None
        return self._segment

    def _new_segment(self, nbytes: int) -> Segment:
        """Host shared memory for CPU weights, GPU memory exported over CUDA IPC for GPU weights."""
        if self.device.type == "cuda":
            return CudaSegment.create(nbytes, self.device)
        return SharedSegment.create(nbytes)

    def _shared_buckets(self, layout: BucketLayout) -> list[torch.Tensor] | None:
        """The buckets as views of the shared segment, grown to fit ``layout`` (a bigger segment
        replaces the old one; receivers map it from the update's header); None when no receiver
        reads from shared memory."""
        if not self._group.shm_ranks:
            return None
        need = shared_memory.segment_bytes(layout)
        if self._segment.ref.nbytes < need:
            try:
                grown = self._new_segment(need)
            except (OSError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                where = "GPU memory" if self.device.type == "cuda" else "shared memory"
                raise RuntimeError(
                    f"could not reserve {need / 2**20:.0f} MiB of {where} for the weights ({exc}); "
                    "free memory on this node or set weight_sync.shared_memory: false"
                ) from exc
            self._use_segment(grown)
        return self._segment.bucket_views(layout)

    def _await_shared_readers(self, seq: int) -> None:
        """Wait for the shared-memory receivers' ``done`` keys, watching their processes: one
        that exits fails the update at once, as a closed socket does on the bus (no collective
        would notice it), and so does one that reports a failure (:meth:`_await_confirmations`)."""
        pids = self._group.pids

        def gone(ranks: list[int]) -> str | None:
            exited = [r for r in ranks if _process_gone(pids[r])]
            return f"receiver rank(s) {exited} exited during the update" if exited else None

        self._await_confirmations(seq, sorted(pids), gone)

    def _announce(self, layout: BucketLayout, version: int, seq: int) -> None:
        keys = self._group.keys
        signature = layout.signature()
        if signature not in self._layouts:
            keys.set(f"layout/{signature}", layout.to_json())
            self._layouts.add(signature)
        header = {"version": version, "layout": signature}
        if self._group.shm_ranks:
            header["shm"] = self._segment.ref.to_dict()
        keys.set(f"update/{seq}", json.dumps(header))

    def _send(self, layout: BucketLayout, tensors: dict[str, torch.Tensor] | Iterator, seq: int,
              shared: list[torch.Tensor] | None) -> None:  # fmt: skip
        """Fill each bucket (in shared memory when ``shared``, telling its readers with a
        ``ready/`` key) and broadcast it to the receivers on the bus; from a stream
        (``StreamedTensors``) each bucket is filled only when the bus is ready for it."""
        group = self._group
        if isinstance(tensors, dict):
            flats = (
                (i, flatten_bucket(layout, i, tensors, self.device, out=None if shared is None else shared[i]))
                for i, n in enumerate(layout.bucket_numels) if n
            )  # fmt: skip
        else:
            flats = stream_buckets(layout, tensors, self.device, out=shared)

        points = set(self._segment.ready_points(layout)) if shared is not None else set()

        def filled() -> Iterator[torch.Tensor]:
            for index, flat in flats:
                if index in points:
                    self._segment.settle()  # a GPU copy is only queued: finish it before telling
                    group.keys.set(f"ready/{seq}/{index}", "1")
                yield flat

        if group.on_bus:
            group.broadcast_all(filled())
        else:
            for _ in filled():
                pass

    def _await_done(self, seq: int, layout: BucketLayout) -> None:
        keys = self._group.keys
        ranks = list(range(1, self.spec.world_size))
        ready = []  # the shared-memory readers' per-bucket keys
        if self._group.shm_ranks:
            self._await_shared_readers(seq)
            ready = [f"ready/{seq}/{i}" for i in self._segment.ready_points(layout)]
        self._await_confirmations(seq, ranks)
        for key in [f"update/{seq}", *[f"done/{seq}/{r}" for r in ranks], *ready]:
            keys.delete_key(key)

    def _await_confirmations(self, seq: int, ranks: list[int],
                             also: Callable[[list[int]], str | None] | None = None) -> None:  # fmt: skip
        """Wait (up to ``timeout_s``) until each of ``ranks`` confirmed update ``seq``. A receiver
        that reports a failure of its own (``failed/{seq}/{rank}``: its receive or its reload
        raised) fails the update at once, with its message, instead of after the whole timeout;
        ``also(pending)`` may name another reason to fail (a reader's process gone). Polls the
        store 0.2 ms apart for the first 20 ms (a GPU update of a small model takes milliseconds),
        then backs off to 20 ms apart."""
        keys = self._group.keys
        start = time.monotonic()
        deadline, pause, pending = start + self.spec.timeout_s, 0.0002, list(ranks)
        while pending:
            pending = [r for r in pending if not keys.check([f"done/{seq}/{r}"])]
            failed = [r for r in pending if keys.check([f"failed/{seq}/{r}"])]
            if failed:
                reasons = "; ".join(f"rank {r}: {keys.get(f'failed/{seq}/{r}').decode()}" for r in failed)
                raise RuntimeError(f"receiver rank(s) {failed} failed the update ({reasons})")
            why = also(pending) if also is not None and pending else None
            if why:
                raise RuntimeError(why)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"receiver rank(s) {pending} did not confirm within {self.spec.timeout_s}s")
            if pending:
                time.sleep(pause)
                if time.monotonic() - start > 0.02:
                    pause = min(pause * 2, 0.02)


class TorchWeightReceiver(_TorchEnd):
    """Inference side (rank 1..N) of the distributed bus. `version`: last version held (-1: none).

    `device` defaults to the current GPU on NCCL, the CPU on gloo. Received tensors are views into
    the bucket buffers of that update (one full copy of the weights lives until they are dropped).
    """

    def __init__(self, spec: BusSpec, rank: int, *, device: str | torch.device | None = None):
        _check_rank(spec, rank)
        device = full_device(
            torch.device(device if device is not None else "cuda" if spec.backend == "nccl" else "cpu")
        )
        super().__init__(spec, rank, device, _connect_store(spec, is_master=False))
        self.version = -1
        self._layouts: dict[str, BucketLayout] = {}

    def receive(self, timeout_s: float | None = None) -> WeightUpdate:
        """Wait up to `timeout_s` (default: the bus timeout) for the next update and receive it
        whole (:meth:`receive_streamed`, every tensor kept)."""
        tensors: dict[str, torch.Tensor] = {}

        def keep(_: int, arriving: Iterator[tuple[str, torch.Tensor]]) -> None:
            # views of shared memory are rewritten by the next update: keep copies of them
            copy = self._reads_shared_memory
            tensors.update((name, tensor.clone() if copy else tensor) for name, tensor in arriving)

        version = self.receive_streamed(keep, timeout_s)
        return WeightUpdate(version, tensors)

    def receive_streamed(self, consume: Callable[[int, Iterator[tuple[str, torch.Tensor]]], None],
                         timeout_s: float | None = None) -> int:  # fmt: skip
        """Receive the next update as :meth:`receive` does, but hand it to ``consume(version,
        tensors)`` while it arrives: ``tensors`` yields each bucket's tensors (in the sender's
        order) as soon as that bucket is in, and the later buckets keep arriving meanwhile, so
        loading them overlaps the transfer. Returns the version.

        ``consume`` must exhaust ``tensors`` (what it leaves is received and dropped). An error it
        raises fails the update as a transfer error does: the publisher is told, this generation
        is given up (the next update re-forms it), and a :class:`WeightSyncError` is raised.
        """
        wait_s = self.spec.timeout_s if timeout_s is None else timeout_s
        self._join(wait_s, None)
        seq = self._seq
        fail = _SyncFailure(None, self.generation, lambda: [0])
        with fail.guard(f"no update announced within {wait_s}s"):  # nothing sent yet: group stays usable
            self._group.keys.wait([f"update/{seq}"], timedelta(seconds=wait_s))
        with self._failing(fail, "receive", report=f"failed/{seq}/{self.rank}"):
            header = json.loads(self._group.keys.get(f"update/{seq}"))
            version = fail.version = header["version"]
            layout = self._layout(header["layout"])
            if self._reads_shared_memory:
                arriving = self._arriving_shared(layout, header["shm"], seq, fail)
            else:
                arriving = self._arriving(layout, fail)
            if version < self.version:
                for _ in arriving:  # received and dropped, as receive() does, then refused below
                    pass
            else:
                try:
                    consume(version, arriving)
                except WeightSyncError:
                    raise
                except Exception as exc:
                    traceback.clear_frames(exc.__traceback__)
                    raise fail.error(f"loading version {version} failed", exc) from exc
                for _ in arriving:
                    pass
            if self._reads_shared_memory:
                self._segment.settle()  # the consumer's GPU copies out of the segment are done
            self._group.keys.set(f"done/{seq}/{self.rank}", "1")
        self._seq = seq + 1
        if version < self.version:
            raise fail.error(f"version went backwards ({self.version} -> {version}); update rejected")
        self.version = version
        return version

    def _arriving(self, layout: BucketLayout, fail: _SyncFailure) -> Iterator[tuple[str, torch.Tensor]]:
        """Post every bucket's receive at once (gloo runs them in order), then yield the tensors
        in the sender's order, each as soon as its bucket is complete (a transfer error is
        ``fail``'s). A learner's weights are one dtype, so their buckets follow that order too."""
        buckets = empty_buckets(layout, self.device)
        works = {k: self._group.broadcast(b) for k, b in enumerate(buckets) if b.numel() > 0}
        for slot in layout.slots:
            if slot.bucket in works:
                with fail.guard("receive"):
                    works.pop(slot.bucket).wait(self._group.timeout)
            yield slot.name, buckets[slot.bucket][slot.offset : slot.offset + slot.numel].view(slot.shape)
        for work in works.values():  # buckets no slot reads (none in practice)
            with fail.guard("receive"):
                work.wait(self._group.timeout)

    def _arriving_shared(self, layout: BucketLayout, ref: dict, seq: int,
                         fail: _SyncFailure) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """As :meth:`_arriving`, from the publisher's shared segment (``ref``: its header entry):
        each bucket's tensors once the ``ready/`` key of a bucket at or after it is set (the
        publisher fills buckets in order), as views of the segment (valid until this update is
        done)."""
        if self._segment is None or self._segment.ref.to_dict() != ref:  # the publisher grew its segment
            with fail.guard("mapping the shared weights"):
                self._use_segment(_open_segment(ref, self.device))
        views = self._segment.bucket_views(layout)
        points, ready_through = self._segment.ready_points(layout), -1  # buckets are written in order
        for slot in layout.slots:
            if slot.bucket > ready_through:
                ready_through = next(p for p in points if p >= slot.bucket)
                with fail.guard("receive"):
                    self._group.keys.wait([f"ready/{seq}/{ready_through}"], self._group.timeout)
            yield slot.name, views[slot.bucket][slot.offset : slot.offset + slot.numel].view(slot.shape)

    def reform(self, spec: BusSpec, rank: int) -> None:
        """Leave the current group and join generation `spec.generation` as `rank` (lazily)."""
        _check_rank(spec, rank)
        self._drop_group()
        if (spec.host, spec.port, spec.session) != (self.spec.host, self.spec.port, self.spec.session):
            self._store = _connect_store(spec, is_master=False)
        self.spec, self.rank = spec, rank
        self._layouts.clear()

    def _layout(self, signature: str) -> BucketLayout:
        if signature not in self._layouts:
            self._layouts[signature] = BucketLayout.from_json(self._group.keys.get(f"layout/{signature}"))
        return self._layouts[signature]


def _open_segment(raw: dict, device: torch.device) -> Segment:
    """Map the segment a publisher offered (``raw``: its ref's ``to_dict``), host or CUDA, for a
    receiver whose weights live on ``device``; ``OSError`` when this receiver cannot."""
    if raw.get("kind") == cuda_ipc.KIND:
        return CudaSegment.open(CudaSegmentRef.from_dict(raw), device)
    if device.type != "cpu":
        raise OSError(f"host shared memory is for receivers on the CPU, not on {device}")
    return SharedSegment.open(SegmentRef.from_dict(raw))


def _log_fallback(exc: Exception, what: str) -> None:
    """Log why shared memory is not used: quietly for an ``OSError`` (another node, PID
    namespace or GPU, no memfd: expected), as a warning otherwise (this torch's CUDA IPC
    misbehaving)."""
    _log.log(logging.DEBUG if isinstance(exc, OSError) else logging.WARNING, "%s: %s", what, exc)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this node has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    except OSError:
        return False  # cannot tell: count it alive, the timeout still bounds the wait
    return state in ("Z", "X")


def _check_rank(spec: BusSpec, rank: int) -> None:
    if not 1 <= rank < spec.world_size:
        raise ValueError(f"receiver rank must be in 1..{spec.world_size - 1}, got {rank}")
