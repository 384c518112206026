"""The per-row values of a :class:`~rlpost.envs.chat.ChatEnv`'s TensorDicts and prompt
containers: reading a batch entry as a list, stacking rows back, and the distinct chats of a
batch (which its reset renders once each)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase, lazy_stack

from rlpost.data import Text, Tokens
from rlpost.policies.inputs import is_lazy


def is_padded(tokens: Any) -> bool:
    padded = getattr(tokens, "padded", None)
    if isinstance(padded, torch.Tensor):
        return bool(padded.any())
    return bool(padded)


def is_strings(value: Any) -> bool:
    """A plain string entry (str, NonTensorData or NonTensorStack of str), not a Text container."""
    if isinstance(value, str):
        return True
    if isinstance(value, (NonTensorData, NonTensorStack)):
        data = value.tolist() if isinstance(value, NonTensorStack) else [value.data]
        return all(isinstance(v, str) for v in data)
    return False


def as_list(value: Any, num_rows: int) -> list:
    """Python values of a batch ``[num_rows]`` entry (non-tensor stack, data or plain list)."""
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    elif isinstance(value, NonTensorData):
        value = [value.data] * num_rows
    elif isinstance(value, str) or not isinstance(value, (list, tuple)):
        value = [value] * num_rows
    if len(value) != num_rows:
        raise ValueError(f"expected {num_rows} values, got {len(value)}")
    return list(value)


def distinct_chats(chats: list[list[dict]]) -> tuple[list[list[dict]], list[int]]:
    """The distinct chats, in first-seen order, and for each input row the index of its chat
    there. Chats are compared by their messages' (role, content) when those are the only keys
    and the contents are strings (the messages a reset builds); any other chat counts as
    distinct from every other."""
    distinct: list[list[dict]] = []
    row_of: list[int] = []
    index_of: dict[tuple, int] = {}
    for row, chat in enumerate(chats):
        index = index_of.setdefault(chat_key(chat) or ("row", row), len(distinct))
        if index == len(distinct):
            distinct.append(chat)
        row_of.append(index)
    return distinct, row_of


def chat_key(chat: list[dict]) -> tuple | None:
    if all(message.keys() == {"role", "content"} and isinstance(message["content"], str) for message in chat):
        return tuple((message["role"], message["content"]) for message in chat)
    return None


def row_list(td: TensorDictBase, key: tuple[str, str]) -> list[torch.Tensor]:
    """The rows of entry ``key``, one tensor each, without building a tensorclass per row (a
    lazy stack gives its stored rows; a dense entry is split along its first dim)."""
    if is_lazy(td.get(key[0])):
        return list(td.get(key, as_list=True))
    return list(td.get(key).unbind(0))


def row_values(value: Any, num_rows: int) -> list:
    if isinstance(value, (torch.Tensor, TensorDictBase)) and not isinstance(value, (NonTensorStack, NonTensorData)):
        return list(value.unbind(0))
    return as_list(value, num_rows)


def stack_values(values: list) -> Any:
    """Tensors stacked, TensorDicts lazily stacked; anything else as a NonTensorStack (dicts
    stay dicts)."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values)
    if all(isinstance(v, TensorDictBase) and not isinstance(v, NonTensorData) for v in values):
        return lazy_stack(values)
    return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[len(values)])


def make_text(prompts: list[str]) -> Text:
    stacked = NonTensorStack(*[NonTensorData(p) for p in prompts], batch_size=[len(prompts)])
    return Text(prompt=stacked, batch_size=[len(prompts)])


def make_tokens(rows: list[torch.Tensor]) -> Tokens:
    """Unpadded token rows as a lazy stack of Tokens (read with ``as_list=True``)."""
    return lazy_stack([Tokens(prompt=ids, padded=False) for ids in rows])
