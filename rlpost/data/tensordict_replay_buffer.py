"""TensorDictReplayBuffer: a :class:`~rlpost.data.ReplayBuffer` of TensorDicts that keeps track of
where each item is (TorchRL's ``TensorDictReplayBuffer``).

Writes set ``"index"`` (after the write hooks); samples carry ``"index"`` and, from a
:class:`~rlpost.data.prioritized.PrioritizedSampler`, ``"priority_weight"``. With a
PrioritizedSampler an item's ``priority_key`` entry (default ``"td_error"``; TorchRL's
expert-iteration script: ``("next", "reward")``) is its priority, several values reduced by the
sampler's ``reduction``.

Deviations from TorchRL: those of :class:`~rlpost.data.ReplayBuffer` (no writers, prefetching,
``dim_extend`` or multi-dimensional storages); ``extend`` reduces several priority values per item
as ``add`` does (TorchRL's ``extend`` needs one per item).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase, is_tensor_collection

from rlpost.data.prioritized import PrioritizedSampler, reduce_priority
from rlpost.data.replay_buffers import ReplayBuffer


def _as_column(value: torch.Tensor, data: TensorDictBase) -> torch.Tensor:
    """``value`` (one entry per row of ``data``) expanded to ``data``'s batch size."""
    value = torch.as_tensor(value)
    if data.device is not None:
        value = value.to(data.device)
    if value.ndim < data.ndim:
        value = value.reshape(*value.shape, *([1] * (data.ndim - value.ndim))).expand(
            *data.batch_size, *value.shape[data.ndim :]
        )
    return value


def _rows(data: TensorDictBase) -> list[TensorDictBase]:
    if data.ndim == 0:
        raise ValueError(
            "extend needs a TensorDict with a leading dimension to split into elements, got batch size []: "
            "use add() for one element"
        )
    return list(data.unbind(0))


def _write_index(data: TensorDictBase, index: torch.Tensor) -> None:
    """Set ``"index"`` in ``data`` (one entry per row, expanded), unlocking it if it is locked."""
    value = _as_column(index, data) if data.ndim else torch.as_tensor(index).reshape(())
    if data.is_locked:
        data.unlock_()
        data.set("index", value)
        data.lock_()
    else:
        data.set("index", value)


class TensorDictReplayBuffer(ReplayBuffer):
    """A replay buffer of TensorDicts whose writes and samples carry ``"index"`` (module
    docstring); ``**kwargs`` as :class:`~rlpost.data.ReplayBuffer`'s."""

    def __init__(self, *, priority_key: NestedKey = "td_error", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.priority_key = priority_key

    # ------------------------------------------------------------------ writing

    def add(self, data: TensorDictBase) -> int | torch.Tensor:
        """Write one element; set its ``"index"``; take its priority from ``priority_key``."""
        if not is_tensor_collection(data):
            return super().add(data)
        with self._lock:
            written = data
            if self._transforms:
                out = self._on_write(data.unsqueeze(0))
                if out is None:
                    return torch.zeros((0, 1), dtype=torch.long)
                if out.batch_size != torch.Size([1]):  # a write hook completed a group: write each
                    index = self._write(_rows(out))
                    _write_index(out, index)
                    self.update_tensordict_priority(out)
                    return index
                written = out.squeeze(0)
            index = int(self._write([written])[0])
            _write_index(written, torch.tensor(index))
            self.update_tensordict_priority(written)
        return index

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """Write each element of ``tensordicts`` along dim 0; set their ``"index"``; unless
        ``update_priority=False``, take their priorities from ``priority_key`` where present."""
        if not isinstance(tensordicts, TensorDictBase):
            raise ValueError(
                f"{type(self).__name__} only accepts TensorDictBase subclasses, got {type(tensordicts).__name__}: "
                "use a regular ReplayBuffer for other data"
            )
        with self._lock:
            data = self._on_write(tensordicts) if self._transforms else tensordicts
            if data is None:
                return torch.zeros((0, 1), dtype=torch.long)
            index = self._write(_rows(data))
            _write_index(data, index)
            if update_priority is None or update_priority:
                try:
                    self._update_from_key(data, index)
                except Exception as err:
                    raise RuntimeError(
                        "Failed to update priority of extended data. You can try to set update_priority=False in "
                        "the extend method and update the priority manually."
                    ) from err
        return index

    # ------------------------------------------------------------------ priorities

    def _priorities(self, rows: list[TensorDictBase]) -> torch.Tensor:
        """One priority per row: its ``priority_key`` reduced, or the sampler's default."""
        default = getattr(self._sampler, "default_priority", 1.0)
        reduction = getattr(self._sampler, "reduction", "max")
        values = []
        for row in rows:
            value = row.get(self.priority_key, None)
            if value is None:
                values.append(float(default))
            else:
                values.append(float(reduce_priority(torch.as_tensor(value).reshape(1, -1), reduction)[0]))
        return torch.tensor(values, dtype=torch.float64)

    def _update_from_key(self, data: TensorDictBase, index: torch.Tensor) -> None:
        if self.priority_key not in data.keys(include_nested=True):
            return
        self.update_priority(index, self._priorities(_rows(data)))

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Set the priorities of the items of ``data`` (a sample, or written data: it has
        ``"index"``) from its ``priority_key`` entry (the sampler's default where it has none).
        Does nothing unless the sampler is a PrioritizedSampler."""
        if not isinstance(self._sampler, PrioritizedSampler):
            return
        index = data.get("index")
        if data.ndim == 0:
            priority = self._priorities([data])
            index = torch.as_tensor(index).reshape(1)
        else:
            priority = self._priorities(_rows(data))
            index = torch.as_tensor(index)
            while index.ndim > 1:  # "index" was expanded to the batch size: one per row
                index = index[..., 0]
        self.update_priority(index, priority)

    def update_priority(self, index: int | torch.Tensor, priority: float | torch.Tensor) -> None:
        """Set the priorities of the items at ``index`` (the sampler's ``update_priority``)."""
        update = getattr(self._sampler, "update_priority", None)
        if update is None:
            warnings.warn(
                f"Calling update_priority() on a sampler {type(self._sampler).__name__} that is not prioritized. "
                "Make sure this is the intended behavior.",
                stacklevel=2,
            )
            return
        with self._lock:
            update(index, priority, storage=self._storage)

    def mark_update(self, index: int | torch.Tensor) -> None:
        """Give the items at ``index`` the sampler's default priority."""
        mark = getattr(self._sampler, "mark_update", None)
        if mark is not None:
            with self._lock:
                mark(index, storage=self._storage)

    # ------------------------------------------------------------------ reading

    def sample(self, batch_size: int | None = None, return_info: bool = False, include_info: bool | None = None) -> Any:
        """A batch with the sampler's info set in it (``include_info=False``, TorchRL's deprecated
        flag: not), and also as a dict with ``return_info=True``."""
        if include_info is not None:
            warnings.warn(
                "include_info is going to be deprecated soon: the sampler's info is set in the sample by default",
                stacklevel=2,
            )
        data, info = super().sample(batch_size, return_info=True)
        if include_info in (True, None):
            if not is_tensor_collection(data):
                raise RuntimeError("Cannot include info in non-tensordict data")
            locked = data.is_locked
            if locked:
                data.unlock_()
            try:
                for key, value in info.items():
                    data.set(key, _as_column(value, data))
            except RuntimeError as err:
                raise RuntimeError(
                    "Failed to set the sampler's info (indices, weights) in the sample of a TensorDictReplayBuffer: "
                    "a read transform probably changed the sample's batch size. sample(return_info=True) returns "
                    "them apart."
                ) from err
            finally:
                if locked:
                    data.lock_()
        return (data, info) if return_info else data

    def __repr__(self) -> str:
        return super().__repr__().replace("ReplayBuffer(", f"{type(self).__name__}(", 1)
