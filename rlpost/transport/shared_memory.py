"""Shared memory between the processes of one node, for the weight bus's same-node receivers.

A :class:`SharedSegment` is an anonymous file in memory (``memfd_create``) that its creator, the
publisher, holds open; another process on the same node maps the same pages by opening
``/proc/<creator pid>/fd/<fd>``. Nothing is named in ``/dev/shm``: the memory is freed when the
last process holding it (the creator's descriptor, a mapping) lets go, so a killed learner leaks
nothing, and a container's small ``/dev/shm`` does not limit it.

Whether a receiver shares memory with the publisher is tested, not guessed: the segment starts
with a random token, and :meth:`SharedSegment.open` checks it. Another node, another container
(another PID namespace) or a host without ``memfd_create`` fails that check, and that receiver
stays on the network bus.

Layout of a segment: ``HEADER_BYTES`` (the token, then zeros), then the data. Data offsets are
multiples of ``ALIGN`` bytes, so every bucket can be viewed as any dtype.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch

from rlpost.transport.bucketing import BucketLayout, dtype_from_str

HEADER_BYTES = 4096
ALIGN = 64
TOKEN_BYTES = 16


@dataclass(frozen=True)
class SegmentRef:
    """How another process finds a segment (plain data: it travels through the bus's store)."""

    pid: int
    fd: int
    nbytes: int  # the whole segment, header included
    token: str  # hex of the segment's first bytes

    def to_dict(self) -> dict:
        return {"pid": self.pid, "fd": self.fd, "nbytes": self.nbytes, "token": self.token}

    @classmethod
    def from_dict(cls, raw: dict) -> SegmentRef:
        return cls(int(raw["pid"]), int(raw["fd"]), int(raw["nbytes"]), str(raw["token"]))


def available() -> bool:
    """Whether this platform can create segments (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def bucket_offsets(layout: BucketLayout) -> list[int]:
    """Byte offset of each bucket of ``layout`` in a segment's data (after the header)."""
    offsets, position = [], HEADER_BYTES
    for dtype, numel in zip(layout.bucket_dtypes, layout.bucket_numels):
        offsets.append(position)
        position += -(-numel * dtype_from_str(dtype).itemsize // ALIGN) * ALIGN
    return offsets


def segment_bytes(layout: BucketLayout) -> int:
    """The size of a segment that holds every bucket of ``layout``."""
    if not layout.bucket_numels:
        return HEADER_BYTES
    last = layout.num_buckets - 1
    return (
        bucket_offsets(layout)[last] + layout.bucket_numels[last] * dtype_from_str(layout.bucket_dtypes[last]).itemsize
    )


def filled_buckets(layout: BucketLayout) -> list[int]:
    """The indices of the buckets of ``layout`` that hold any element."""
    return [index for index, numel in enumerate(layout.bucket_numels) if numel]


def bucket_views(memory: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
    """Each bucket of ``layout`` as a flat tensor of its dtype, in a segment's ``memory`` (uint8,
    the whole segment, header included)."""
    if segment_bytes(layout) > memory.numel():
        raise ValueError(f"layout needs {segment_bytes(layout)} bytes, segment has {memory.numel()}")
    views = []
    for offset, dtype, numel in zip(bucket_offsets(layout), layout.bucket_dtypes, layout.bucket_numels):
        dt = dtype_from_str(dtype)
        views.append(memory[offset : offset + numel * dt.itemsize].view(dt))
    return views


class SharedSegment:
    """One mapped segment; :meth:`create` it (the publisher) or :meth:`open` a ref (a receiver)."""

    def __init__(self, ref: SegmentRef, memory: torch.Tensor, fd: int | None):
        self.ref, self.memory, self._fd = ref, memory, fd  # memory: uint8, the whole segment

    @classmethod
    def create(cls, nbytes: int) -> SharedSegment:
        """A new segment of ``nbytes`` (at least the header), its pages reserved now: a node
        short of memory fails here with ``OSError`` (ENOSPC, ENOMEM), not with a SIGBUS on a
        later write."""
        if not available():
            raise OSError("shared memory segments need Linux's memfd_create")
        nbytes = max(int(nbytes), HEADER_BYTES)
        fd = os.memfd_create("rlpost-weights", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            memory = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
            token = secrets.token_bytes(TOKEN_BYTES)
            memory[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        except BaseException:
            os.close(fd)
            raise
        return cls(SegmentRef(os.getpid(), fd, nbytes, token.hex()), memory, fd)

    @classmethod
    def open(cls, ref: SegmentRef) -> SharedSegment:
        """Map the segment ``ref`` names; ``OSError`` when this process cannot reach it or what it
        reaches is not that segment (another node, PID namespace or a reused descriptor)."""
        if not available():
            raise OSError("shared memory segments need Linux's memfd_create")
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        try:
            memory = torch.from_file(path, shared=True, size=ref.nbytes, dtype=torch.uint8)
        except RuntimeError as exc:  # torch reports open/mmap failures as RuntimeError
            raise OSError(f"cannot map {path}: {exc}") from exc
        if bytes(memory[:TOKEN_BYTES].tolist()).hex() != ref.token:
            raise OSError(f"{path} is not the publisher's segment (its token differs)")
        return cls(ref, memory, None)

    def bucket_views(self, layout: BucketLayout) -> list[torch.Tensor]:
        """Each bucket of ``layout`` as a flat tensor of its dtype, in this segment's memory."""
        return bucket_views(self.memory, layout)

    def ready_points(self, layout: BucketLayout) -> list[int]:
        """The buckets after which the publisher tells its readers what is written: every one
        (readers load a bucket while the next is written)."""
        return filled_buckets(layout)

    def settle(self) -> None:
        """Nothing to wait for: host memory is written when the copy returns (see the CUDA
        segment's, whose copies are queued on a stream)."""

    def close(self) -> None:
        """Drop this process's hold (the mapping goes once no view of it is left)."""
        self.memory = torch.empty(0, dtype=torch.uint8)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
