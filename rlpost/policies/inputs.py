"""Reading a wrapper's input from a TensorDict without surprises.

TorchRL's inputs come in several shapes: a container (ChatHistory / Text / Tokens) or a bare
value (a History, strings, ids) at the input key; dense tensors with an attention mask, or lazy
stacks of rows of different lengths. These helpers find an entry without reading it (a ragged
lazy stack cannot be read as one tensor) and turn what is found into per-row Python lists.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDictBase

from rlpost.data.history import History


def masked_ids(ids: torch.Tensor, mask: torch.Tensor | None, key: NestedKey, is_prompt: bool) -> list[int]:
    """The ids of one row where its attention mask is True (all of them without a mask)."""
    if mask is None:
        return ids.tolist()
    if is_prompt and mask.shape[-1] > ids.shape[-1]:
        mask = mask[..., : ids.shape[-1]]  # a full-sequence mask: the prompt is its left part
    if mask.shape != ids.shape:
        raise ValueError(f"attention mask {tuple(mask.shape)} does not match {key!r} {tuple(ids.shape)}")
    return ids[mask.bool()].tolist()


def join_key(key: NestedKey, part: str) -> tuple:
    return (*key, part) if isinstance(key, tuple) else (key, part)


def has_entry(td: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``td`` has an entry at ``key`` (without reading it: a ragged lazy stack cannot be
    read as one tensor)."""
    key = key if isinstance(key, str) else (key[0] if len(key) == 1 else tuple(key))
    return key in set(td.keys(include_nested=True))


def peek(td: TensorDictBase, key: NestedKey) -> Any:
    """The entry at ``key`` if it is a container (a sub-TensorDict, tensorclass or strings),
    else None: leaves are read by the callers that know how (``as_list`` for ragged rows)."""
    key = key if isinstance(key, str) else (key[0] if len(key) == 1 else tuple(key))
    if key in set(td.keys(include_nested=True, leaves_only=True, is_leaf=_is_tensor_leaf)):
        return None
    return td.get(key)


def _is_tensor_leaf(cls: type) -> bool:
    return issubclass(cls, torch.Tensor)


def container_of(input_key: NestedKey) -> NestedKey:
    """The container key of a user-given ``input_key``: ``("history", "prompt")`` lives in
    ``"history"``; a key that names no part is its own container."""
    if isinstance(input_key, tuple) and len(input_key) > 1 and input_key[-1] in ("prompt", "response", "full"):
        return input_key[:-1] if len(input_key) > 2 else input_key[0]
    return input_key


def as_conversations(value: Any, key: NestedKey, batch_dims: int) -> History:
    """A History of batch ``[B, n_messages]``; a ``[B]`` History (one message per row) counts
    as ``[B, 1]``. Anything else is TorchRL's TypeError."""
    if not isinstance(value, History):
        raise TypeError(f"Expected History object for {key!r}, got {type(value).__name__}")
    if value.batch_dims == batch_dims:
        value = value.unsqueeze(-1)
    if value.batch_dims != 2:
        raise ValueError(f"history input at {key!r} must be a History of batch [B, n_messages], got {value.batch_size}")
    return value


def padded_flag(value) -> bool | None:
    """The ``padded`` flag of a container: a bool, or a (nested) list of them for lazy stacks."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return bool(value.any())
    flags = [padded_flag(v) for v in value]
    return any(flags) if flags else None


def strings(value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):  # a NonTensorStack (its items are NonTensorData, not str)
        value = value.tolist()
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"Expected strings for a text input, got {[type(v).__name__ for v in value][:3]}")
    return list(value)


def is_lazy(obj) -> bool:
    return isinstance(getattr(obj, "_tensordict", obj), LazyStackedTensorDict)


def check_prefixes(prompts: list[list[int]], fulls: list[list[int]], prompt_name: str, full_name: str) -> None:
    for i, (p, f) in enumerate(zip(prompts, fulls)):
        if f[: len(p)] != p:
            raise ValueError(f"row {i}: {prompt_name} is not a prefix of {full_name}; cannot split prompt and response")
