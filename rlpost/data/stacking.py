"""Stack TensorDicts of different sequence lengths (TorchRL's ``as_nested_tensor`` /
``as_padded_tensor``, the ``stack_method`` choices of its data-loading primer).

Who uses them: data loaders that batch tokenized prompts, and envs whose reset stacks rows.
:func:`set_rows` writes per-row outputs of different lengths (unpadded log-probs, KL) so that
``td.get(key, as_list=True)`` reads them back one tensor per row, and :func:`get_rows` reads one
tensor per row from any layout; the KL transforms and the history losses use them.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDict, TensorDictBase, lazy_stack


def as_nested_tensor(list_of_tensordicts: list[TensorDictBase]) -> TensorDictBase:
    """Stack along a new dim 0, each tensor becoming a jagged nested tensor.

    Entries of different lengths stay unpadded: ``out["ids"][i]`` is the ``i``-th input's tensor.
    The result's batch size is ``[len(list_of_tensordicts), *first.batch_size]``.
    """
    first, *rest = list_of_tensordicts
    batch_size = [len(list_of_tensordicts), *first.batch_size]

    def nest(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)

    return first.apply(nest, *rest, batch_size=batch_size)


def as_padded_tensor(list_of_tensordicts: list[TensorDictBase], dim: int = 0, stack_dim: int = 0) -> TensorDictBase:
    """Stack along ``stack_dim``, padding each tensor with zeros on the left along ``dim``.

    Left padding (TorchRL's choice) keeps the last real token of every row at the same position,
    which is where generation continues from. ``dim`` counts from the start of each input tensor
    and must be >= 0. The result's batch size inserts ``len(list_of_tensordicts)`` at
    ``stack_dim`` (TorchRL inserts it at ``dim``; the two agree for the defaults).
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
    """The per-row tensors of ``td[key]`` (None when absent), whatever the layout: rows kept
    apart in a lazy stack (:func:`is_row_stacked`), a nested tensor, a list, or a dense
    ``[*batch, T]`` tensor (its rows over the flattened batch). A 0-d ``td`` has one row. The
    reading side of :func:`set_rows`."""
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

    Into a lazy stack each row goes to its own TensorDict. Into a dense ``td`` a two-part key
    (``("log_probs", "full")``) becomes a lazy stack of one TensorDict per row under its
    container (an existing dense container is unbound into one first, its other entries kept),
    as the wrappers write with ``pad_output=False``. A one-part key of a dense ``td`` has no
    container to hold separate rows: it gets a jagged nested tensor (TorchRL stores a nested
    tensor there too), whose ``[i]`` is row ``i``. A 0-d ``td`` takes its one row as it is.
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
