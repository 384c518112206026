"""One generation of the distributed weight bus (its store keys and collective backend) and what
its two ends share: joining, failure reports, the shared segment (protocol:
:mod:`rlpost.transport.weight_bus`)."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from rlpost.transport import cuda_ipc
from rlpost.transport.bus_types import BusSpec, WeightSyncError
from rlpost.transport.cuda_ipc import CudaSegment, CudaSegmentRef
from rlpost.transport.shared_memory import SegmentRef, SharedSegment

_log = logging.getLogger(__name__)
Segment = SharedSegment | CudaSegment  # the publisher's shared buckets: host memory or GPU memory
_MAX_IN_FLIGHT = 2  # buckets the publisher keeps in flight: overlap flattening with sending, bound memory
_NCCL_ERROR_MODE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


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


def connect_store(spec: BusSpec, is_master: bool) -> TCPStore:
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
                    mapped = open_segment(offer, self.device)
                except Exception as exc:  # noqa: BLE001 - any failure to map leaves the bus, which always works
                    log_fallback(exc, f"rank {self.rank} stays on the bus, the offered segment")
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


class SyncFailure:
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


class TorchEnd:
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
        fail = SyncFailure(
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
    def _failing(self, fail: SyncFailure, message: str, report: str | None = None) -> Iterator[None]:
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


def open_segment(raw: dict, device: torch.device) -> Segment:
    """Map the segment a publisher offered (``raw``: its ref's ``to_dict``), host or CUDA, for a
    receiver whose weights live on ``device``; ``OSError`` when this receiver cannot."""
    if raw.get("kind") == cuda_ipc.KIND:
        return CudaSegment.open(CudaSegmentRef.from_dict(raw), device)
    if device.type != "cpu":
        raise OSError(f"host shared memory is for receivers on the CPU, not on {device}")
    return SharedSegment.open(SegmentRef.from_dict(raw))


def log_fallback(exc: Exception, what: str) -> None:
    """Log why shared memory is not used: quietly for an ``OSError`` (another node, PID
    namespace or GPU, no memfd: expected), as a warning otherwise (this torch's CUDA IPC
    misbehaving)."""
    _log.log(logging.DEBUG if isinstance(exc, OSError) else logging.WARNING, "%s: %s", what, exc)
