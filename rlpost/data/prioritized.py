"""PrioritizedSampler: prioritized experience replay (TorchRL's ``PrioritizedSampler``).

Slots are drawn with replacement in proportion to ``(p_i + eps) ** alpha``::

    P(i) = (p_i + eps) ** alpha / sum_j (p_j + eps) ** alpha

with importance weights under ``"priority_weight"``, ``w_i = (N * P(i)) ** -beta`` scaled by the
largest possible one, i.e. ``((p_i + eps) ** alpha / min_j (p_j + eps) ** alpha) ** -beta`` (the
least likely item has weight 1). A new item gets the largest priority seen so far (1.0 before any;
with ``max_priority_within_buffer=True`` the largest among the items stored), so it is sampled at
least as often as any other until its own is known (:meth:`PrioritizedSampler.update_priority`, or
a :class:`~rlpost.data.tensordict_replay_buffer.TensorDictReplayBuffer` reading its ``priority_key``).

Deviations from TorchRL: the priorities are one torch tensor (sampling costs O(capacity), no C++
segment tree: LLM buffers hold hundreds of items, not millions); storages are one-dimensional, so
an index is one integer per item; no ``state_dict`` (rlpost's buffers are not checkpointed).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from rlpost.data.samplers import Sampler
from rlpost.data.storages import Storage

REDUCTIONS = ("max", "min", "mean", "median")
_DTYPES = (torch.float32, torch.float64)


def reduce_priority(priority: torch.Tensor, reduction: str) -> torch.Tensor:
    """One priority per row of ``priority`` (``[N, ...]`` -> ``[N]``), by ``reduction``."""
    flat = priority.reshape(priority.shape[0], -1) if priority.ndim else priority.reshape(1, 1)
    if flat.shape[1] == 1:
        return flat[:, 0]
    if reduction == "max":
        return flat.max(dim=1).values
    if reduction == "min":
        return flat.min(dim=1).values
    if reduction == "mean":
        return flat.float().mean(dim=1)
    return flat.median(dim=1).values


class PrioritizedSampler(Sampler):
    """Samples stored items in proportion to ``(priority + eps) ** alpha`` (module docstring).

    Args:
        max_capacity: the slots priorities are kept for.
        alpha: 0: uniform sampling; 1: in proportion to the priorities. beta: 0: all weights 1.
        reduction: how an item's several priority values become one ("max", "min", "mean",
            "median").
        device: accepted for TorchRL's signature; the priorities stay on the CPU.
    """

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(max_capacity, bool) or not isinstance(max_capacity, (int, np.integer)) or max_capacity < 1:
            raise ValueError(f"max_capacity must be an int >= 1, got {max_capacity!r}")
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if dtype not in _DTYPES:
            raise NotImplementedError(f"dtype {dtype} not supported by PrioritizedSampler (float32 or float64)")
        self._max_capacity = int(max_capacity)
        self._alpha = float(alpha)
        self._beta = float(beta)
        self._eps = float(eps)
        self.dtype = dtype
        self.reduction = reduction
        self._max_priority_within_buffer = max_priority_within_buffer
        self._init()

    def _init(self) -> None:
        # (p + eps) ** alpha per slot; 0 marks a slot never written
        self._values = torch.zeros(self._max_capacity, dtype=torch.float64)
        self._max_priority: tuple[float, int] | None = None  # the largest raw priority, and its slot

    # ------------------------------------------------------------------ parameters

    @property
    def max_size(self) -> int:
        return self._max_capacity

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def alpha(self) -> float:
        """The priority exponent. Setting it re-expresses the kept values with the new exponent
        (from 0 that is impossible: the values stay uniform until each priority is updated)."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={value}")
        old, self._alpha = self._alpha, float(value)
        written = self._values > 0
        if old == self._alpha or not written.any():
            return
        if old == 0:
            warnings.warn(
                "PrioritizedSampler: alpha changed away from 0; the priorities given while it was 0 cannot be "
                "recovered, so those items are sampled uniformly until their priority is updated",
                stacklevel=2,
            )
            return
        raw = (self._values[written] ** (1.0 / old) - self._eps).clamp_min(0)
        self._values[written] = (raw + self._eps) ** self._alpha

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)

    @property
    def eps(self) -> float:
        return self._eps

    @property
    def default_priority(self) -> float:
        """The priority a newly written item gets: the largest raw priority (1.0 before any)."""
        return 1.0 if self._max_priority is None else self._max_priority[0]

    # ------------------------------------------------------------------ sampling

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """``batch_size`` slots drawn with replacement in proportion to their values, and their
        importance weights under ``"priority_weight"``."""
        size = len(storage)
        if size == 0:
            raise RuntimeError("Cannot sample from an empty storage.")
        if size > self._max_capacity:
            raise RuntimeError(
                f"PrioritizedSampler(max_capacity={self._max_capacity}) holds priorities for fewer items than the "
                f"storage's {size}: give it max_capacity >= the storage's max_size"
            )
        values = self._values[:size]
        if not (values > 0).any():
            raise RuntimeError("non-positive p_sum: no stored item has a priority (write through the replay buffer)")
        index = torch.multinomial(values, batch_size, replacement=True, generator=self._rng)
        p_min = values[values > 0].min()
        weight = (values[index] / p_min).pow(-self._beta).to(self.dtype)
        return index, {"priority_weight": weight}

    # ------------------------------------------------------------------ priorities

    @torch.no_grad()
    def update_priority(
        self, index: int | torch.Tensor, priority: float | torch.Tensor, *, storage: Storage | None = None
    ) -> None:
        """Set the priority of the items at ``index`` (one number for all, or one per index).
        Negative indices are skipped (TorchRL's writers mark items not to update with -1)."""
        index = torch.as_tensor(index, dtype=torch.long).detach().cpu()
        priority = torch.as_tensor(priority).detach().cpu().to(torch.float64)
        if index.ndim > 1:
            raise ValueError(
                f"PrioritizedSampler: rlpost's storages are one-dimensional; got an index of shape {tuple(index.shape)}"
            )
        if priority.numel() > 1 and priority.shape != index.shape:
            try:
                priority = priority.reshape(index.shape[:1])
            except RuntimeError as err:
                raise RuntimeError(
                    "priority should be a number or an iterable of the same length as index. Got priority of "
                    f"shape {tuple(priority.shape)} and index {tuple(index.shape)}."
                ) from err
        elif priority.numel() <= 1:
            priority = priority.reshape(())
        index = index.reshape(-1)
        if priority.ndim:
            priority = priority.reshape(-1)
        valid = index >= 0
        if not valid.all():
            index = index[valid]
            if priority.ndim:
                priority = priority[valid]
        if index.numel() == 0:
            return
        if (index >= self._max_capacity).any():
            raise IndexError(f"PrioritizedSampler: index {index.max().item()} >= max_capacity={self._max_capacity}")
        priority = priority.expand(index.shape)
        best = int(priority.argmax())
        if self._max_priority is None or priority[best].item() > self._max_priority[0]:
            self._max_priority = (priority[best].item(), int(index[best]))
        self._values[index] = (priority + self._eps).pow(self._alpha)
        if self._max_priority_within_buffer and (index == self._max_priority[1]).any():
            self._recompute_max_priority()

    def _recompute_max_priority(self) -> None:
        """The largest raw priority among the stored items (the value kept is transformed)."""
        if self._alpha == 0:  # every kept value is 1: the raw priorities are gone
            return
        written = self._values > 0
        if not written.any():
            self._max_priority = None
            return
        value, slot = self._values.masked_fill(~written, 0).max(dim=0)
        raw = max(value.item() ** (1.0 / self._alpha) - self._eps, 0.0)
        self._max_priority = (raw, int(slot))

    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Give the items at ``index`` the default priority (what a write does)."""
        self.update_priority(index, self.default_priority, storage=storage)

    def _forget_overwritten_max(self, index: torch.Tensor) -> None:
        if self._max_priority_within_buffer and self._max_priority is not None:
            if (torch.as_tensor(index).reshape(-1) == self._max_priority[1]).any():
                self._max_priority = None

    def add(self, index: int) -> None:
        self.mark_update(index)
        self._forget_overwritten_max(torch.as_tensor(index))

    def extend(self, index: torch.Tensor) -> None:
        self.mark_update(index)
        self._forget_overwritten_max(index)

    def _empty(self) -> None:
        super()._empty()
        self._init()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, "
            f"reduction={self.reduction})"
        )
