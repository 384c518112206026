"""The samplers of :class:`~rlpost.data.ReplayBuffer` (TorchRL's
``torchrl.data.replay_buffers.samplers``): :class:`RandomSampler` (with replacement) and
:class:`SamplerWithoutReplacement` (each item once per pass)."""

from __future__ import annotations

from typing import Any

import torch

from rlpost.data.storages import Storage

_EMPTY_STORAGE_ERROR = "Cannot sample from an empty storage."


class Sampler:
    """Base class of samplers: ``sample(storage, batch_size) -> (indices, info)``."""

    def __init__(self) -> None:
        self._rng: torch.Generator | None = None
        self._ran_out = False

    @property
    def ran_out(self) -> bool:
        """Whether the last sample ended a pass over the storage (iteration stops then)."""
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        self._ran_out = value

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def add(self, index: int) -> None:
        """Told after an item is written at ``index``."""

    def extend(self, index: torch.Tensor) -> None:
        """Told after items are written at ``index``."""

    def _empty(self) -> None:
        self._ran_out = False


class RandomSampler(Sampler):
    """Uniform sampling with replacement (TorchRL's default sampler).

    Keyword Args:
        replacement: False builds a :class:`SamplerWithoutReplacement` instead, with the other
            keyword arguments (``drop_last``, ``shuffle``).
    """

    def __new__(cls, *, replacement: bool = True, **kwargs: Any) -> Sampler:
        if not replacement:
            return SamplerWithoutReplacement(**kwargs)
        if kwargs:
            raise TypeError(f"RandomSampler got unexpected arguments {sorted(kwargs)} (they need replacement=False)")
        return super().__new__(cls)

    def __init__(self, *, replacement: bool = True, **kwargs: Any) -> None:
        super().__init__()

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if len(storage) == 0:
            raise RuntimeError(_EMPTY_STORAGE_ERROR)
        return torch.randint(len(storage), (batch_size,), generator=self._rng), {}

    def __repr__(self) -> str:
        return "RandomSampler()"


class SamplerWithoutReplacement(Sampler):
    """Each stored item once per pass, in a random order (TorchRL's).

    A pass is a permutation of the storage's indices, drawn anew when a pass ends or when the
    storage's size changed since the last sample. The sample that ends a pass sets
    ``ran_out``, which ends iteration over the buffer.

    Args:
        drop_last: never return a short batch: a pass ends when fewer than ``batch_size``
            indices are left (they are skipped); sampling more than the storage holds raises.
        shuffle: False walks the storage in write order.
    """

    def __init__(self, drop_last: bool = False, shuffle: bool = True) -> None:
        super().__init__()
        self.drop_last = drop_last
        self.shuffle = shuffle
        self._sample_list: torch.Tensor | None = None
        self.len_storage = 0

    def _new_pass(self, len_storage: int) -> None:
        if self.shuffle:
            self._sample_list = torch.randperm(len_storage, generator=self._rng)
        else:
            self._sample_list = torch.arange(len_storage)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        len_storage = len(storage)
        if len_storage == 0:
            raise RuntimeError(_EMPTY_STORAGE_ERROR)
        if self.drop_last and len_storage < batch_size:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {len_storage} items stored: with drop_last=True "
                "no batch can be drawn without repeating items (use drop_last=False or a smaller batch)"
            )
        if self._sample_list is None or len_storage != self.len_storage:
            self._new_pass(len_storage)
        self.len_storage = len_storage
        index = self._sample_list[:batch_size]
        self._sample_list = self._sample_list[batch_size:]
        left = self._sample_list.numel()
        if left == 0 or (self.drop_last and left < batch_size):
            self.ran_out = True
            self._new_pass(len_storage)
        else:
            self.ran_out = False
        return index, {}

    def _empty(self) -> None:
        super()._empty()
        self._sample_list = None
        self.len_storage = 0

    def __repr__(self) -> str:
        left = 0 if self._sample_list is None else self._sample_list.numel()
        return f"SamplerWithoutReplacement(drop_last={self.drop_last}, shuffle={self.shuffle}, left_in_pass={left})"
