"""GPU memory shared between the processes of one node (CUDA IPC), for the weight bus's receivers
that run on the publisher's own GPU.

A :class:`CudaSegment` is a GPU buffer of the publisher exported with torch's CUDA IPC reduction
(``reduce_tensor``: an IPC handle plus torch's reference counter, so the memory outlives the
publisher's tensor while a receiver maps it); the handle travels as plain JSON in a
:class:`CudaSegmentRef`.

Only a receiver on the same physical GPU maps it: the ref names the GPU by UUID (indices differ
under different ``CUDA_VISIBLE_DEVICES``, as Ray's actors have). Mapping another GPU's buffer
would open a CUDA context there, and NCCL between GPUs is fast anyway; CUDA refuses a process its
own export, so a receiver in the publisher's process stays on the bus too. As with host segments
(whose layout it shares, :mod:`rlpost.transport.shared_memory`), a random token read back by
:meth:`CudaSegment.open` tests the mapping.

Trap: writes and reads are queued on CUDA streams, so each side calls :meth:`CudaSegment.settle`
before it tells the other that a bucket is written or read.
"""

from __future__ import annotations

import inspect
import json
import os
import secrets
from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from rlpost.transport.bucketing import BucketLayout
from rlpost.transport.shared_memory import HEADER_BYTES, TOKEN_BYTES, bucket_views, filled_buckets

KIND = "cuda"
# the storage classes a handle may name (it names its class; anything else is refused)
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}


@dataclass(frozen=True)
class CudaSegmentRef:
    """How another process finds a segment (plain data: it travels through the bus's store)."""

    pid: int  # the exporting process (it cannot map its own export)
    device_uuid: str  # the GPU that holds the memory
    nbytes: int  # the whole segment, header included
    token: str  # hex of the segment's first bytes
    handle: str  # JSON: rebuild_cuda_tensor's arguments, bytes as hex

    def to_dict(self) -> dict:
        return {
            "kind": KIND,
            "pid": self.pid,
            "device_uuid": self.device_uuid,
            "nbytes": self.nbytes,
            "token": self.token,
            "handle": self.handle,
        }

    @classmethod
    def from_dict(cls, raw: dict) -> CudaSegmentRef:
        return cls(int(raw["pid"]), str(raw["device_uuid"]), int(raw["nbytes"]), str(raw["token"]), str(raw["handle"]))


def device_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device: the same GPU has the same UUID in every process of the node."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        raise OSError("this torch does not report GPU UUIDs: cannot tell whether two processes share a GPU")
    return str(uuid)


def _export(memory: torch.Tensor) -> str:
    """``memory``'s CUDA IPC handle as JSON (what ``rebuild_cuda_tensor`` needs, by name)."""
    rebuild, args = reductions.reduce_tensor(memory)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise OSError(f"torch reduced a CUDA tensor with {rebuild.__name__}, not rebuild_cuda_tensor")
    named = dict(zip(inspect.signature(rebuild).parameters, args))
    exported = {}
    for name, value in named.items():
        if name in ("tensor_cls", "dtype", "requires_grad"):
            continue  # always a plain uint8 tensor without grad
        if name == "storage_cls":
            value = value.__name__
        elif isinstance(value, bytes):
            value = {"hex": value.hex()}
        elif isinstance(value, tuple):  # sizes and strides (torch.Size is a tuple)
            value = list(value)
        exported[name] = value
    return json.dumps(exported)


def _import(handle: str, device_index: int) -> torch.Tensor:
    """Map the exported memory into this process on ``device_index`` (a uint8 tensor)."""
    exported = json.loads(handle)
    arguments = {"tensor_cls": torch.Tensor, "dtype": torch.uint8, "requires_grad": False}
    for name, value in exported.items():
        if name == "storage_cls":
            if value not in _STORAGE_CLASSES:
                raise OSError(f"unknown storage class {value!r} in a CUDA IPC handle")
            value = _STORAGE_CLASSES[value]
        elif isinstance(value, dict):
            value = bytes.fromhex(value["hex"])
        elif isinstance(value, list):
            value = tuple(value)
        arguments[name] = value
    arguments["storage_device"] = device_index
    expected = set(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    if set(arguments) != expected:  # another torch version on the other side
        raise OSError(f"CUDA IPC handle has arguments {sorted(arguments)}, this torch expects {sorted(expected)}")
    return reductions.rebuild_cuda_tensor(**arguments)


class CudaSegment:
    """One segment of GPU memory; :meth:`create` it (the publisher) or :meth:`open` a ref (a
    receiver on the same GPU)."""

    def __init__(self, ref: CudaSegmentRef, memory: torch.Tensor):
        self.ref, self.memory = ref, memory  # memory: uint8 on the GPU, the whole segment

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> CudaSegment:
        """A new segment of ``nbytes`` (at least the header) on ``device``. A GPU short of memory
        raises ``torch.OutOfMemoryError`` here."""
        nbytes = max(int(nbytes), HEADER_BYTES)
        memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        token = secrets.token_bytes(TOKEN_BYTES)
        memory[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        torch.cuda.current_stream(device).synchronize()  # the token is in place before anyone maps it
        ref = CudaSegmentRef(os.getpid(), device_uuid(device), nbytes, token.hex(), _export(memory))
        return cls(ref, memory)

    @classmethod
    def open(cls, ref: CudaSegmentRef, device: torch.device) -> CudaSegment:
        """Map the segment ``ref`` names, for a receiver whose weights live on ``device``;
        ``OSError`` when it is on another GPU, exported by this very process, not reachable, or
        not that segment (its token differs)."""
        if device.type != "cuda":
            raise OSError(f"a CUDA segment is for receivers on a GPU, not on {device}")
        if ref.pid == os.getpid():
            raise OSError("a process cannot map its own CUDA IPC export")
        if device_uuid(device) != ref.device_uuid:
            raise OSError(f"the segment is on GPU {ref.device_uuid}, this receiver on {device_uuid(device)}")
        try:
            memory = _import(ref.handle, device.index if device.index is not None else torch.cuda.current_device())
            token = bytes(memory[:TOKEN_BYTES].tolist()).hex()
        except RuntimeError as exc:  # CUDA reports a failed cudaIpcOpenMemHandle as RuntimeError
            raise OSError(f"cannot map the publisher's CUDA memory: {exc}") from exc
        if memory.numel() < ref.nbytes or token != ref.token:
            raise OSError("the mapped CUDA memory is not the publisher's segment (its token differs)")
        return cls(ref, memory[: ref.nbytes])

    def bucket_views(self, layout: BucketLayout) -> list[torch.Tensor]:
        """Each bucket of ``layout`` as a flat tensor of its dtype, in this segment's memory."""
        return bucket_views(self.memory, layout)

    def ready_points(self, layout: BucketLayout) -> list[int]:
        """Only the last bucket: on one GPU readers and publisher share the memory bandwidth, so
        overlap gains nothing, while a handshake per 64 MB bucket (stream sync + store round
        trip, tens of µs) halved the rate."""
        return filled_buckets(layout)[-1:]

    def settle(self) -> None:
        """Wait until this process's queued copies into or out of the segment are done (its
        current stream on the segment's GPU): call before telling the other side."""
        torch.cuda.current_stream(self.memory.device).synchronize()

    def close(self) -> None:
        """Drop this process's hold (a receiver's mapping goes once no view of it is left; the
        publisher's memory once no receiver maps it either)."""
        self.memory = torch.empty(0, dtype=torch.uint8)
