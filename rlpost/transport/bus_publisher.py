"""The learner's end (rank 0) of the distributed weight bus (protocol: :mod:`rlpost.transport.weight_bus`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NamedTuple

import torch

from rlpost.transport import shared_memory
from rlpost.transport.bucketing import (
    BucketLayout,
    StreamedTensors,
    as_named_list,
    flatten_bucket,
    plan_buckets,
    stream_buckets,
)
from rlpost.transport.bus_group import (
    Segment,
    SyncFailure,
    TorchEnd,
    connect_store,
    full_device,
    log_fallback,
    resolve_backend,
)
from rlpost.transport.bus_types import BusSpec, NamedTensors, PublishStats, check_version
from rlpost.transport.cuda_ipc import CudaSegment
from rlpost.transport.shared_memory import SharedSegment

_REPORT_GRACE_S = 1.0  # how long a failed publish waits for live receivers to report their side


class _Unconfirmed(NamedTuple):
    """An update sent by ``publish(wait=False)``: what ``confirm`` needs to collect it."""

    seq: int
    version: int
    layout: BucketLayout
    fail: SyncFailure


class TorchWeightPublisher(TorchEnd):
    """Learner side (rank 0) of the distributed bus; hosts the store. See the module docstring.

    `world_size`: 1 + number of receivers. `host`: the address receivers dial (this node's IP on
    a cluster). `device`: where the weights live (backend "auto": NCCL for a GPU).
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
        store = connect_store(spec, is_master=True)
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

        ``wait=False`` returns once the bytes are sent (the caller may change its tensors) and
        leaves the confirmations to :meth:`confirm`, which the next ``publish`` calls first (the
        shared segment is reused only after every reader confirmed); a failure raises there.
        """
        self.confirm()
        check_version(version, self._version)
        streamed = isinstance(named_tensors, StreamedTensors)
        named = named_tensors.placeholders() if streamed else as_named_list(named_tensors)
        layout = self._plan(named, streamed)
        t0 = time.perf_counter()
        connect_s = self._join(None, version)
        seq = self._seq
        fail = SyncFailure(version, self.generation, lambda: self._silent_peers(seq))
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
                log_fallback(exc, "no shared segment offered, every receiver uses the bus")
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
        """Wait (up to ``timeout_s``) until each of ``ranks`` confirmed update ``seq``. A receiver's
        own ``failed/{seq}/{rank}`` report fails the update at once, with its message;
        ``also(pending)`` may name another reason (a reader's process gone). Polls 0.2 ms apart
        for 20 ms (a small GPU update takes milliseconds), then backs off to 20 ms."""
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
