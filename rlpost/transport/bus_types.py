"""The weight bus's types: what crosses between publisher and receivers (see
:mod:`rlpost.transport.weight_bus` for the protocol)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from rlpost.transport.bucketing import StreamedTensors

# a dict, (name, tensor) pairs, or StreamedTensors (made while they are sent)
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StreamedTensors


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


def check_version(version: int, last: int) -> None:
    if not isinstance(version, int) or version < last:
        raise ValueError(f"weight version must be an int >= the last published ({last}), got {version!r}")


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
