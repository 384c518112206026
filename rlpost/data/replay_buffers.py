"""A small replay buffer with TorchRL's API: ``ReplayBuffer``, storages and samplers.

What TorchRL's GRPO recipe composes, with the same names and call forms
(``torchrl.data`` -> ``rlpost.data``)::

    rb = ReplayBuffer(
        storage=LazyStackStorage(steps_per_batch),
        sampler=SamplerWithoutReplacement(),
        batch_size=optim_batch_size,
    )
    rb.append_transform(MCAdvantage(grpo_size=repeats))
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=steps_per_batch, replay_buffer=rb)
    for _ in collector:                 # the collector writes with rb.extend
        for batch in rb:                # one pass over the buffer, optim_batch_size at a time
            loss = loss_fn(batch)

Writes run the transforms' ``inv`` hooks, last appended first (None stops the write, e.g.
:class:`~rlpost.objectives.MCAdvantage` holding an incomplete group), then fill the storage
round-robin (the oldest slots are overwritten). Reads run ``forward`` (or a plain callable) in
order; ``append_transform(t, invert=True)`` swaps the two hooks. Iteration stops at the end of a
:class:`SamplerWithoutReplacement` pass. Writes and samples hold one lock and a write hook runs
inside it, so several writer threads can share a buffer and a stateful transform's groups never
interleave.

Deliberate deviations from TorchRL: no writers, prefetching, priorities, checkpointing or
memory-mapped/tensor storages (the buffer holds LLM steps in lists); ``add`` of one element
whose write hook returns several (MCAdvantage completing a group) writes all of them and
returns their indices (TorchRL would store the group as one element); ``transform=`` also
takes a list of transforms (rlpost's ``Compose`` is for envs); a non-TensorDict sample is
passed to the read hooks as it is (TorchRL wraps it under a ``"data"`` key).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection

from rlpost.data.samplers import RandomSampler, Sampler, SamplerWithoutReplacement
from rlpost.data.storages import LazyStackStorage, ListStorage, Storage, default_collate, identity_collate

__all__ = [
    "LazyStackStorage",
    "ListStorage",
    "RandomSampler",
    "ReplayBuffer",
    "Sampler",
    "SamplerWithoutReplacement",
    "Storage",
]


# ---------------------------------------------------------------------------- transforms


class _Hooked:
    """One transform of a buffer and the direction it is applied in."""

    def __init__(self, transform: Any, invert: bool) -> None:
        has_inv = callable(getattr(transform, "inv", None))
        has_forward = callable(getattr(transform, "forward", None)) or callable(transform)
        if not (has_inv or has_forward):
            raise TypeError(
                f"a replay buffer transform needs an inv (write) or forward (read) method, or must be callable; "
                f"{type(transform).__name__} has none"
            )
        self.transform, self.invert = transform, invert

    def _read(self, data: Any) -> Any:
        forward = getattr(self.transform, "forward", None)
        if callable(forward):
            return forward(data)
        if callable(self.transform) and not callable(getattr(self.transform, "inv", None)):
            return self.transform(data)
        return data

    def _write(self, data: Any) -> Any:
        inv = getattr(self.transform, "inv", None)
        return inv(data) if callable(inv) else data

    def on_write(self, data: Any) -> Any:
        return self._read(data) if self.invert else self._write(data)

    def on_read(self, data: Any) -> Any:
        return self._write(data) if self.invert else self._read(data)


# ---------------------------------------------------------------------------- the buffer


class ReplayBuffer:
    """A replay buffer: a storage, a sampler and transforms (TorchRL's ``ReplayBuffer``).

    Keyword Args:
        storage, sampler: or callables building them (default: ``ListStorage(max_size=1_000)``,
            :class:`RandomSampler`).
        collate_fn: puts sampled items together (default: the storage's).
        transform: a transform, a callable, or a list of them; or ``transform_factory``.
        batch_size: items per :meth:`sample` and per step of iteration (or given to :meth:`sample`).
        generator: a ``torch.Generator`` the samplers draw from (default: torch's global one).
    """

    def __init__(
        self,
        *,
        storage: Storage | Callable[[], Storage] | None = None,
        sampler: Sampler | Callable[[], Sampler] | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        transform: Any = None,
        transform_factory: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self._storage = self._build(storage, Storage, "storage", lambda: ListStorage(max_size=1_000))
        self._sampler = self._build(sampler, Sampler, "sampler", RandomSampler)
        if generator is not None:
            self._sampler._rng = generator
        if collate_fn is None:
            collate_fn = identity_collate if isinstance(self._storage, LazyStackStorage) else default_collate
        self._collate_fn = collate_fn
        if transform_factory is not None:
            if transform is not None:
                raise TypeError("ReplayBuffer takes transform or transform_factory, not both")
            transform = transform_factory()
        self._transforms: list[_Hooked] = []
        for item in transform if isinstance(transform, (list, tuple)) else ([] if transform is None else [transform]):
            self._transforms.append(_Hooked(item, invert=False))
        if batch_size is not None:
            _check_batch_size(batch_size)
        if batch_size is None and getattr(self._sampler, "drop_last", False):
            raise ValueError("a sampler with drop_last=True needs the batch size: pass batch_size= to ReplayBuffer")
        self._batch_size = batch_size
        self._cursor = 0
        self._write_count = 0
        self._lock = threading.RLock()

    @staticmethod
    def _build(component: Any, kind: type, name: str, default: Callable[[], Any]) -> Any:
        if component is None:
            return default()
        if not isinstance(component, kind) and callable(component):
            component = component()
        if not isinstance(component, kind):
            raise TypeError(
                f"{name} must be a {kind.__name__} or a callable building one, got {type(component).__name__}"
            )
        return component

    # ------------------------------------------------------------------ properties

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def batch_size(self) -> int | None:
        """Items per :meth:`sample` and per step of iteration (None: give it to ``sample``)."""
        return self._batch_size

    @property
    def write_count(self) -> int:
        """Items written so far by ``add`` and ``extend`` (reset by :meth:`empty`)."""
        return self._write_count

    def __len__(self) -> int:
        with self._lock:
            return len(self._storage)

    # ------------------------------------------------------------------ transforms

    def append_transform(self, transform: Any, *, invert: bool = False) -> ReplayBuffer:
        """Add a transform after the others (``invert=True``: its hooks swapped)."""
        self._transforms.append(_Hooked(transform, invert))
        return self

    def insert_transform(self, index: int, transform: Any, *, invert: bool = False) -> ReplayBuffer:
        """Add a transform at position ``index`` of the transforms."""
        self._transforms.insert(index, _Hooked(transform, invert))
        return self

    def _on_write(self, data: Any) -> Any:
        for hooked in reversed(self._transforms):
            data = hooked.on_write(data)
            if data is None:
                return None
        return data

    def _on_read(self, data: Any) -> Any:
        for hooked in self._transforms:
            data = hooked.on_read(data)
        return data

    # ------------------------------------------------------------------ writing

    def add(self, data: Any) -> int | torch.Tensor:
        """Write one element; return its index. A TensorDict passes the write hooks as a ``[1]``
        batch (TorchRL's); a longer result (a completed group) is written element by element,
        returning their indices (a deviation, module docstring)."""
        with self._lock:
            if self._transforms:
                if is_tensor_collection(data):
                    out = self._on_write(data.unsqueeze(0))
                    if out is None:
                        return _no_index()
                    if out.batch_size != torch.Size([1]):
                        return self._write(_items_of(out))
                    data = out.squeeze(0)
                else:
                    data = self._on_write(data)
                    if data is None:
                        return _no_index()
            return int(self._write([data])[0])

    def extend(self, data: Any) -> torch.Tensor:
        """Write each element of ``data`` (along dim 0 of a TensorDict or tensor, or each item
        of a list); return their indices. The write hooks see ``data`` whole first."""
        with self._lock:
            if self._transforms:
                data = self._on_write(data)
                if data is None:
                    return _no_index()
            return self._write(_items_of(data))

    def _write(self, items: list[Any]) -> torch.Tensor:
        indices = []
        for item in items:
            self._storage.set(self._cursor, item)
            indices.append(self._cursor)
            self._cursor = (self._cursor + 1) % self._storage.max_size
            self._write_count += 1
        index = torch.tensor(indices, dtype=torch.long)
        self._sampler.extend(index)
        return index

    def empty(self, empty_write_count: bool = True) -> None:
        """Remove every item; the next write goes to index 0."""
        with self._lock:
            self._storage._empty()
            self._sampler._empty()
            self._cursor = 0
            if empty_write_count:
                self._write_count = 0

    # ------------------------------------------------------------------ reading

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """``batch_size`` items drawn, collated and read-transformed (``return_info``: with
        ``{"index": indices}``)."""
        if batch_size is not None and self._batch_size is not None and batch_size != self._batch_size:
            warnings.warn(
                f"ReplayBuffer.sample(batch_size={batch_size}) differs from the buffer's "
                f"batch_size={self._batch_size}; the argument is used",
                stacklevel=2,
            )
        elif batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError("batch_size not specified: pass batch_size= to ReplayBuffer or to sample()")
        _check_batch_size(batch_size)
        with self._lock:
            index, info = self._sampler.sample(self._storage, batch_size)
            data = self._collate_fn(self._storage.get(index))
        info["index"] = index
        data = self._on_read(data)
        return (data, info) if return_info else data

    def __getitem__(self, index: Any) -> Any:
        with self._lock:
            data = self._storage.get(index)
        if isinstance(data, list):
            data = self._collate_fn(data)
        return self._on_read(data)

    def __iter__(self) -> Iterator[Any]:
        """Batches of ``batch_size`` until the sampler ends a pass (never, for RandomSampler)."""
        if self._batch_size is None:
            raise RuntimeError("cannot iterate over a ReplayBuffer without batch_size (pass batch_size= to it)")
        self._sampler.ran_out = False
        while not self._sampler.ran_out:
            yield self.sample()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        transforms = [type(h.transform).__name__ for h in self._transforms]
        return (
            f"ReplayBuffer(storage={self._storage!r}, sampler={self._sampler!r}, batch_size={self._batch_size}, "
            f"transforms={transforms})"
        )


def _check_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


def _no_index() -> torch.Tensor:
    """The indices of a write that stored nothing (TorchRL's empty ``[0, ndim]`` tensor)."""
    return torch.zeros((0, 1), dtype=torch.long)


def _items_of(data: Any) -> list[Any]:
    """The elements ``extend`` writes: along dim 0 of a TensorDict or a tensor, else each item."""
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        if data.ndim == 0:
            raise ValueError(
                f"extend needs data with a leading dimension to split into elements, got a {type(data).__name__} "
                "with batch size []: use add() for one element"
            )
        return list(data.unbind(0))
    if isinstance(data, (str, bytes, Mapping)) or not hasattr(data, "__iter__"):
        raise TypeError(f"extend needs a list, tuple, tensor or TensorDict of elements, got {type(data).__name__}")
    return list(data)
