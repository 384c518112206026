"""Keys and per-row values of the TensorDicts the LLM envs and transforms read: a ``[B]`` batch,
or the ``[]`` one of a batch-less :class:`~rlpost.envs.llm_env.LLMEnv`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from rlpost.envs.errors import EnvInputError

NestedKey = Any  # a str or a tuple of str


def as_key(key: NestedKey) -> NestedKey:
    """A nested key in one spelling: a str, or a tuple of two or more str."""
    if isinstance(key, tuple):
        if not key or not all(isinstance(part, str) for part in key):
            raise ValueError(f"a key must be a str or a tuple of str, got {key!r}")
        return key[0] if len(key) == 1 else key
    if not isinstance(key, str):
        raise ValueError(f"a key must be a str or a tuple of str, got {key!r}")
    return key


def as_keys(keys: Sequence[NestedKey] | NestedKey | None) -> list:
    if keys is None:
        return []
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    return [as_key(key) for key in keys]


def replace_last(key: NestedKey, last: str) -> NestedKey:
    """``key`` with its last part replaced by ``last`` (``"tokens"`` -> ``last``,
    ``("a", "ids")`` -> ``("a", last)``)."""
    return last if isinstance(key, str) else (*key[:-1], last)


def has_key(td: TensorDictBase, key: NestedKey) -> bool:
    return key in td.keys(include_nested=isinstance(key, tuple))


def count_rows(td: TensorDictBase) -> int:
    if td.batch_dims > 1:
        raise EnvInputError(f"expected a TensorDict of batch [] or [B], got batch {tuple(td.batch_size)}")
    return td.batch_size[0] if td.batch_dims else 1


def object_rows(td: TensorDictBase, key: NestedKey) -> list:
    """The Python values (strings, chats...) of ``td[key]``, one per row (one for batch ``[]``)."""
    value = td.get(key)
    num = count_rows(td)
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    elif isinstance(value, NonTensorData):
        value = value.data
        return [value] * num if td.batch_dims else [value]
    if td.batch_dims == 0:
        return [value]
    if isinstance(value, (list, tuple)) and len(value) == num:
        return list(value)
    return [value] * num


def tensor_rows(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor]:
    """The tensors of ``td[key]``, one per row: dense, nested (jagged) or lazily stacked rows of
    different lengths alike (one for batch ``[]``)."""
    if td.batch_dims == 0:
        return [td.get(key)]
    try:
        value = td.get(key)
    except RuntimeError:  # a lazy stack whose rows differ in length
        return [row.get(key) for row in td.unbind(0)]
    if not isinstance(value, torch.Tensor):
        raise EnvInputError(f"expected a tensor under {key!r}, got {type(value).__name__}")
    return list(value.unbind(0))


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked densely when they have one shape, else as a jagged nested tensor."""
    if len({tuple(row.shape) for row in rows}) == 1:
        return torch.stack(rows)
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def batch_value(values: list, td: TensorDictBase) -> Any:
    """Per-row Python values as a TensorDict entry of ``td``'s batch (NonTensorData for ``[]``)."""
    if td.batch_dims == 0:
        return NonTensorData(values[0])
    return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=td.batch_size)
