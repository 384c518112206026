"""Stack TensorDicts of different sequence lengths (TorchRL's ``as_nested_tensor`` /
``as_padded_tensor``, the ``stack_method`` choices of its data-loading primer).

Who uses them: data loaders that batch tokenized prompts, and envs whose reset stacks rows.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


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
