"""The storages of :class:`~rlpost.data.ReplayBuffer` (TorchRL's
``torchrl.data.replay_buffers.storages``): :class:`ListStorage` stacks what is sampled,
:class:`LazyStackStorage` returns a lazy stack (see :mod:`rlpost.data.replay_buffers`)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, is_tensor_collection, lazy_stack


def _check_max_size(max_size: int | None) -> int:
    if max_size is None:
        return sys.maxsize
    if isinstance(max_size, bool) or not isinstance(max_size, (int, np.integer)) or max_size < 1:
        raise ValueError(f"max_size must be an int >= 1 or None (unlimited), got {max_size!r}")
    return int(max_size)


class Storage:
    """Base class of storages: ``max_size`` items addressed by integer index."""

    ndim = 1

    def __init__(self, max_size: int | None = None) -> None:
        self.max_size = _check_max_size(max_size)

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: Any) -> Any:
        raise NotImplementedError

    def set(self, cursor: int, data: Any) -> None:
        raise NotImplementedError

    def _empty(self) -> None:
        raise NotImplementedError

    def __getitem__(self, index: Any) -> Any:
        return self.get(index)


class ListStorage(Storage):
    """Items in a python list (TorchRL's ``ListStorage``); ``max_size`` None: unlimited;
    ``device``: where items with a ``.to`` are moved when written."""

    def __init__(self, max_size: int | None = None, *, device: torch.device | str | None = None) -> None:
        super().__init__(max_size)
        self.device = torch.device(device) if device is not None else None
        self._storage: list[Any] = []

    def __len__(self) -> int:
        return len(self._storage)

    def set(self, cursor: int, data: Any) -> None:
        """Write ``data`` at ``cursor`` (the next free slot, or an existing one)."""
        if not 0 <= cursor <= len(self._storage):
            raise RuntimeError(
                f"{type(self).__name__}: cannot write at index {cursor} of a storage holding {len(self._storage)} items"
            )
        if cursor >= self.max_size:
            raise RuntimeError(f"{type(self).__name__}: index {cursor} is beyond max_size={self.max_size}")
        if self.device is not None and hasattr(data, "to"):
            data = data.to(self.device)
        if cursor == len(self._storage):
            self._storage.append(data)
        else:
            self._storage[cursor] = data

    def get(self, index: Any) -> Any:
        """One item for an integer index; a list of items for a slice or a sequence of ints."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            return self._storage[int(index)]
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            return self._storage[int(index)]
        if isinstance(index, slice):
            return self._storage[index]
        if isinstance(index, torch.Tensor):
            index = index.cpu().tolist()
        elif isinstance(index, np.ndarray):
            index = index.tolist()
        return [self._storage[int(i)] for i in index]

    def _empty(self) -> None:
        self._storage = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_size={self.max_size}, items={len(self)})"


class LazyStackStorage(ListStorage):
    """A :class:`ListStorage` of TensorDicts whose reads are lazy stacks (TorchRL's).

    Items may differ in shapes and hold strings (LLM steps do); ``stack_dim`` (negative: from
    the end of the stacked batch size) is the dim reads stack them along.
    """

    def __init__(
        self, max_size: int | None = None, *, stack_dim: int = 0, device: torch.device | str | None = None
    ) -> None:
        super().__init__(max_size, device=device)
        self.stack_dim = stack_dim

    def set(self, cursor: int, data: Any) -> None:
        if not is_tensor_collection(data):
            raise TypeError(f"LazyStackStorage holds TensorDicts, got {type(data).__name__}; use ListStorage")
        super().set(cursor, data)

    def get(self, index: Any) -> Any:
        out = super().get(index)
        if isinstance(out, list) and out:
            stack_dim = self.stack_dim if self.stack_dim >= 0 else out[0].ndim + 1 + self.stack_dim
            return lazy_stack(out, stack_dim)
        return out


def default_collate(items: Any) -> Any:
    """How :class:`ListStorage` samples are put together: TensorDicts dense-stacked if they can
    be, tensors stacked, numbers into a tensor, anything else a list."""
    if not isinstance(items, list) or not items:
        return items
    if all(is_tensor_collection(item) for item in items):
        return LazyStackedTensorDict.maybe_dense_stack(items)
    if all(isinstance(item, torch.Tensor) for item in items):
        return torch.stack(items)
    if all(isinstance(item, (bool, int, float, np.number)) for item in items):
        return torch.tensor(items)
    return items


def identity_collate(items: Any) -> Any:
    return items
