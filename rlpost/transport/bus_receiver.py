"""The inference workers' end (ranks 1..N) of the distributed weight bus (protocol:
:mod:`rlpost.transport.weight_bus`)."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch

from rlpost.transport.bucketing import BucketLayout, empty_buckets
from rlpost.transport.bus_group import SyncFailure, TorchEnd, connect_store, full_device, open_segment
from rlpost.transport.bus_types import BusSpec, WeightSyncError, WeightUpdate


class TorchWeightReceiver(TorchEnd):
    """Inference side (rank 1..N) of the distributed bus. `version`: last version held (-1: none).

    `device` defaults to the current GPU on NCCL, the CPU on gloo. Received tensors are views into
    the bucket buffers of that update (one full copy of the weights lives until they are dropped).
    """

    def __init__(self, spec: BusSpec, rank: int, *, device: str | torch.device | None = None):
        _check_rank(spec, rank)
        device = full_device(
            torch.device(device if device is not None else "cuda" if spec.backend == "nccl" else "cpu")
        )
        super().__init__(spec, rank, device, connect_store(spec, is_master=False))
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
        """Receive the next update, handing it to ``consume(version, tensors)`` while it arrives:
        ``tensors`` yields each bucket's tensors as soon as it is in, so loading overlaps the
        transfer; returns the version. What ``consume`` leaves is received and dropped; an error
        it raises fails the update as a transfer error does (publisher told, generation given
        up, :class:`WeightSyncError`).
        """
        wait_s = self.spec.timeout_s if timeout_s is None else timeout_s
        self._join(wait_s, None)
        seq = self._seq
        fail = SyncFailure(None, self.generation, lambda: [0])
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

    def _arriving(self, layout: BucketLayout, fail: SyncFailure) -> Iterator[tuple[str, torch.Tensor]]:
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
                         fail: SyncFailure) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """As :meth:`_arriving`, from the publisher's shared segment (``ref``: its header entry):
        each bucket's tensors once the ``ready/`` key of a bucket at or after it is set (the
        publisher fills buckets in order), as views of the segment (valid until this update is
        done)."""
        if self._segment is None or self._segment.ref.to_dict() != ref:  # the publisher grew its segment
            with fail.guard("mapping the shared weights"):
                self._use_segment(open_segment(ref, self.device))
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
            self._store = connect_store(spec, is_master=False)
        self.spec, self.rank = spec, rank
        self._layouts.clear()

    def _layout(self, signature: str) -> BucketLayout:
        if signature not in self._layouts:
            self._layouts[signature] = BucketLayout.from_json(self._group.keys.get(f"layout/{signature}"))
        return self._layouts[signature]


def _check_rank(spec: BusSpec, rank: int) -> None:
    if not 1 <= rank < spec.world_size:
        raise ValueError(f"receiver rank must be in 1..{spec.world_size - 1}, got {rank}")
