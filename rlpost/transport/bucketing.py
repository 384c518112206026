"""Bucketing of named parameters into flat per-dtype buffers, and back into views.

A few large flat tensors instead of hundreds of small collectives. A tensor larger than a bucket
travels alone (never split, so the receiver hands it out as a view). The `BucketLayout` travels
as JSON, so the receiver allocates buckets before the bytes arrive and views them without copies.

Pure: imports torch only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives: `bucket` index, element `offset` in it, and its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class BucketLayout:
    """The agreed packing of a set of named tensors: slots in the sender's order, bucket sizes.

    Made by the publisher (`plan_buckets`), read by every receiver (`from_json`).
    """

    slots: tuple[TensorSlot, ...]
    bucket_dtypes: tuple[str, ...]
    bucket_numels: tuple[int, ...]

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_numels)

    @property
    def num_bytes(self) -> int:
        return sum(n * dtype_from_str(d).itemsize for d, n in zip(self.bucket_dtypes, self.bucket_numels))

    def to_json(self) -> str:
        slots = [[s.name, s.dtype, list(s.shape), s.bucket, s.offset] for s in self.slots]
        return json.dumps({"slots": slots, "dtypes": self.bucket_dtypes, "numels": self.bucket_numels})

    @classmethod
    def from_json(cls, text: str | bytes) -> BucketLayout:
        raw = json.loads(text)
        slots = tuple(TensorSlot(n, d, tuple(shape), b, o) for n, d, shape, b, o in raw["slots"])
        return cls(slots, tuple(raw["dtypes"]), tuple(raw["numels"]))

    def signature(self) -> str:
        """A short content hash: equal layouts have equal signatures."""
        return self._digest

    @cached_property
    def _digest(self) -> str:  # hashed once per layout: the bus announces it on every update
        return hashlib.sha1(self.to_json().encode()).hexdigest()[:16]

    @cached_property
    def bucket_slots(self) -> tuple[tuple[TensorSlot, ...], ...]:
        """The slots of each bucket, in the sender's order, which is their order in the bucket:
        each slot starts where the one before it ends."""
        per_bucket: list[list[TensorSlot]] = [[] for _ in self.bucket_numels]
        for slot in self.slots:
            per_bucket[slot.bucket].append(slot)
        return tuple(tuple(slots) for slots in per_bucket)


def dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_named_list(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Materialise a dict or an iterable of (name, tensor) pairs; names must be unique."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    seen: set[str] = set()
    for name, tensor in items:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        seen.add(name)
    return items


@dataclass(frozen=True)
class StreamedTensors:
    """Named tensors made one at a time while they are sent, so the sender never holds them all.

    ``specs``: each tensor's ``(name, dtype, shape)`` up front (the layout is announced before
    any byte moves); ``produce()`` yields the pairs in that order, pulled bucket by bucket (a
    sharded learner gathers each tensor only when its bucket is filled).
    """

    specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    produce: Callable[[], Iterable[tuple[str, torch.Tensor]]]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.produce())

    def placeholders(self) -> list[tuple[str, torch.Tensor]]:
        """Storage-less tensors of the specs' dtypes and shapes (for :func:`plan_buckets`)."""
        return [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, dtype, shape in self.specs]


def stream_buckets(layout: BucketLayout, source: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                   out: list[torch.Tensor] | None = None) -> Iterator[tuple[int, torch.Tensor]]:  # fmt: skip
    """``(index, flat bucket)`` for each non-empty bucket of ``layout`` in order, filled from the
    tensors ``source`` yields (in the layout's slot order), into ``out[index]`` when given (else
    a new tensor). A tensor is dropped once its bucket is built. With a layout planned
    ``in_order`` the tensors come in bucket order; otherwise tensors of a later bucket (another
    dtype) wait until theirs."""
    waiting: dict[str, torch.Tensor] = {}
    for index, numel in enumerate(layout.bucket_numels):
        needed = [slot.name for slot in layout.bucket_slots[index]]
        for name in needed:
            while name not in waiting:
                try:
                    produced, tensor = next(source)
                except StopIteration:
                    raise ValueError(f"the streamed tensors ended before {name!r}") from None
                waiting[produced] = tensor
        if numel > 0:
            yield index, flatten_bucket(layout, index, waiting, device, out=None if out is None else out[index])
        for name in needed:
            del waiting[name]


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, *, in_order: bool = False) -> BucketLayout:
    """Pack tensors by dtype (first-seen dtype order, input order inside a dtype) into buckets.

    ``in_order``: keep the input order instead (each run of one dtype packed, a new bucket where
    the dtype changes), so the buckets fill in the order the tensors come: what a stream needs.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    runs: list[tuple[torch.dtype, list[tuple[str, torch.Tensor]]]] = []
    if in_order:
        for name, tensor in named:
            if not runs or runs[-1][0] != tensor.dtype:
                runs.append((tensor.dtype, []))
            runs[-1][1].append((name, tensor))
    else:
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in named:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        runs = list(by_dtype.items())
    placed: dict[str, TensorSlot] = {}
    dtypes: list[str] = []
    numels: list[int] = []
    for dtype, group in runs:
        capacity = max(1, bucket_bytes // dtype.itemsize)
        first = True
        for name, tensor in group:
            n = tensor.numel()
            if first or (numels[-1] > 0 and numels[-1] + n > capacity):
                dtypes.append(dtype_to_str(dtype))
                numels.append(0)
                first = False
            placed[name] = TensorSlot(name, dtype_to_str(dtype), tuple(tensor.shape), len(numels) - 1, numels[-1])
            numels[-1] += n
    slots = tuple(placed[name] for name, _ in named)
    return BucketLayout(slots, tuple(dtypes), tuple(numels))


def flatten_bucket(layout: BucketLayout, index: int, tensors: Mapping[str, torch.Tensor], device: torch.device,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Copy the tensors of bucket `index` into one flat tensor: ``out`` (of the bucket's dtype
    and size, e.g. a view of shared memory) or a new one on `device`."""
    dtype, numel = dtype_from_str(layout.bucket_dtypes[index]), layout.bucket_numels[index]
    if out is not None and (out.dtype != dtype or out.numel() != numel):
        raise ValueError(f"bucket {index} needs {numel} x {dtype}, out is {out.numel()} x {out.dtype}")
    flat = torch.empty(numel, dtype=dtype, device=device) if out is None else out
    slots = layout.bucket_slots[index]
    sources = [tensors[slot.name].detach() for slot in slots]
    if flat.is_cuda and all(t.device == flat.device and t.dtype == dtype and t.is_contiguous() for t in sources):
        # a GPU learner's own parameters: one concatenation instead of a kernel launch per
        # tensor (a small model's update is launch-bound there). On the CPU the copies below
        # measured the same or better.
        torch.cat([t.view(-1) for t in sources], out=flat)
        return flat
    for slot, source in zip(slots, sources):
        # view(shape).copy_ reads a non-contiguous or other-device source without a temporary
        flat[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(source)
    return flat


def empty_buckets(layout: BucketLayout, device: torch.device) -> list[torch.Tensor]:
    """Receiver side: allocate every bucket of `layout` on `device`, ready to be filled."""
    return [
        torch.empty(n, dtype=dtype_from_str(d), device=device)
        for d, n in zip(layout.bucket_dtypes, layout.bucket_numels)
    ]


def unflatten(layout: BucketLayout, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of `buckets` shaped as the original tensors, in the sender's order (no copies)."""
    if len(buckets) != layout.num_buckets:
        raise ValueError(f"layout has {layout.num_buckets} buckets, got {len(buckets)}")
    return {s.name: buckets[s.bucket][s.offset : s.offset + s.numel].view(s.shape) for s in layout.slots}
