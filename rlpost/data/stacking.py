"""Stack TensorDicts of different sequence lengths (TorchRL's ``as_nested_tensor`` /
``as_padded_tensor``, its data-loading primer's ``stack_method`` choices), and write / read one
tensor per row in any layout (:func:`set_rows`, :func:`get_rows`: the KL transforms and losses)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDict, TensorDictBase, lazy_stack


def as_nested_tensor(list_of_tensordicts: list[TensorDictBase]) -> TensorDictBase:
    """Stack along a new dim 0, each tensor a jagged nested tensor (``out["ids"][i]`` is the
    ``i``-th input's)."""
    first, *rest = list_of_tensordicts
    batch_size = [len(list_of_tensordicts), *first.batch_size]

    def nest(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)

    return first.apply(nest, *rest, batch_size=batch_size)


def as_padded_tensor(list_of_tensordicts: list[TensorDictBase], dim: int = 0, stack_dim: int = 0) -> TensorDictBase:
    """Stack along ``stack_dim``, padding each tensor with zeros on the left along ``dim``.

    Left padding (TorchRL's) keeps every row's last real token, where generation continues, at
    one position. ``dim`` >= 0 counts from the start of each input tensor. Deviation: the batch
    dim is inserted at ``stack_dim`` (TorchRL: at ``dim``; they agree for the defaults).
    """
    if dim < 0:
        raise ValueError(f"as_padded_tensor: dim must be >= 0, got {dim}")
    first, *rest = list_of_tensordicts
    batch_size = list(first.batch_size)
    batch_size.insert(stack_dim, len(list_of_tensordicts))

    def pad(*tensors: torch.Tensor) -> torch.Tensor:
        length = max(t.shape[dim] for t in tensors)
        padded = []
        for t in tensors:
            shape = list(t.shape)
            shape[dim] = length - t.shape[dim]
            padded.append(torch.cat([t.new_zeros(shape), t], dim=dim))
        return torch.stack(padded, dim=stack_dim)

    return first.apply(pad, *rest, batch_size=batch_size)


def is_row_stacked(td: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``td[key]`` lives in a lazy stack along dim 0 (``td`` itself or a container on the
    way to ``key``): then its rows are separate tensors, which may differ in length."""
    path = (key,) if isinstance(key, str) else tuple(key)
    node: Any = td
    for part in path[:-1]:
        if _is_row_stack(node):
            return True
        node = node.get(part, None)
        if node is None:
            return False
    return _is_row_stack(node)


def get_rows(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor] | None:
    """The per-row tensors of ``td[key]`` (None when absent) from a lazy stack, nested tensor,
    list or dense ``[*batch, T]`` tensor (rows over the flattened batch); :func:`set_rows`'s reader."""
    if key not in td.keys(include_nested=True):
        return None
    if is_row_stacked(td, key):
        return [torch.as_tensor(row) for row in td.get(key, as_list=True)]
    value = td.get(key)
    if isinstance(value, (list, tuple)):
        return [torch.as_tensor(row) for row in value]
    if value.is_nested:
        return list(value.unbind(0))
    if td.batch_dims == 0:
        return [value]
    return list(value.reshape(-1, *value.shape[td.batch_dims :]).unbind(0))


def set_rows(td: TensorDictBase, key: NestedKey, rows: list[torch.Tensor]) -> TensorDictBase:
    """Write one tensor per row of ``td`` (batch ``[B]``) at ``key``, lengths free, so that
    ``td.get(key, as_list=True)`` gives the ``B`` tensors back (TorchRL's unpadded layout).

    Into a dense ``td`` a two-part key (``("log_probs", "full")``) makes its container a lazy
    stack of rows (an existing dense one is unbound, other entries kept), as the wrappers write
    with ``pad_output=False``; a one-part key gets a jagged nested tensor (as TorchRL stores).
    """
    if td.batch_dims == 0:
        (row,) = rows
        td.set(key, row)
        return td
    if _is_row_stack(td):
        for sub, row in zip(_inner(td).tensordicts, rows, strict=True):
            sub.set(key, row)
        return td
    path = (key,) if isinstance(key, str) else tuple(key)
    if len(path) == 1 or td.batch_dims != 1:
        td.set(key, torch.nested.as_nested_tensor(list(rows), layout=torch.jagged))
        return td
    container_key = path[:-1] if len(path) > 2 else path[0]
    container = td.get(container_key, None)
    if container is None:
        scalar = torch.Size([])
        td.set(container_key, lazy_stack([TensorDict({path[-1]: row}, batch_size=scalar) for row in rows]))
        return td
    if not _is_row_stack(container):
        container = lazy_stack(list(container.unbind(0)))
        td.set(container_key, container)
    for sub, row in zip(_inner(container).tensordicts, rows, strict=True):
        sub.set(path[-1], row)
    return td


def same_key(a: NestedKey, b: NestedKey) -> bool:
    """Whether two nested keys name one entry (``"a"`` and ``("a",)`` do)."""
    as_tuple = lambda k: (k,) if isinstance(k, str) else tuple(k)  # noqa: E731
    return as_tuple(a) == as_tuple(b)


def batch_shape(td: TensorDictBase) -> torch.Size:
    """``td``'s batch size, ``[1]`` for a TensorDict of batch ``[]`` (the shape of a per-row loss)."""
    return td.batch_size if td.batch_dims > 0 else torch.Size([1])


def _inner(value: Any) -> Any:
    """A tensorclass's TensorDict (containers such as LogProbs are tensorclasses), or ``value``."""
    return getattr(value, "_tensordict", value)


def _is_row_stack(value: Any) -> bool:
    inner = _inner(value)
    return isinstance(inner, LazyStackedTensorDict) and inner.stack_dim == 0
