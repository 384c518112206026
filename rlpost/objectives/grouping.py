"""What the grouping write transforms (:class:`~rlpost.objectives.MCAdvantage`,
:class:`~rlpost.objectives.TopKRewardSelector`) share: splitting a write into complete
trajectories, reading an entry, turning a group identity into a dict key, and the queues of
incomplete groups.

:class:`GroupQueues` holds its groups in a plain dict, or in a ``multiprocessing`` manager's dict
once :meth:`GroupQueues.shared` has moved them there, so that writers in several processes fill
the same groups; the transform using it supplies the lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase, is_non_tensor, is_tensor_collection

_MISSING = object()


def split_trajectories(tensordict: TensorDictBase, done_key: Any, who: str) -> list[TensorDictBase]:
    """The complete trajectories of a write: a 1-D TensorDict of steps laid end to end (each
    trajectory ending with ``done``), 2-D ``[B, T]`` (each row such steps) or more (flattened to
    2-D). ``who`` names the transform in errors: ``ValueError`` without a batch dimension,
    ``RuntimeError`` for steps after the last ``done`` (an unfinished trajectory)."""
    if tensordict.ndim == 0:
        raise ValueError(
            f"{who}.inv needs steps along a batch dimension (got batch size []); a buffer's add() adds that "
            "dimension itself"
        )
    if tensordict.ndim > 2:
        tensordict = tensordict.flatten(0, -2)
    rows = tensordict.unbind(0) if tensordict.ndim == 2 else (tensordict,)
    pieces = []
    for steps in rows:
        num_steps = steps.shape[0]
        if num_steps == 0:
            continue
        done = torch.as_tensor(get_entry(steps, done_key, "done_key")).reshape(num_steps, -1).any(-1)
        ends = done.nonzero().flatten().tolist()
        if not ends or ends[-1] != num_steps - 1:
            raise RuntimeError(
                f"{who} expects complete trajectories: the last of {num_steps} steps written has {done_key!r} "
                "False (write trajectories once they are done)"
            )
        start = 0
        for end in ends:
            pieces.append(steps[start : end + 1])
            start = end + 1
    return pieces


def get_entry(sample: Any, key: Any, argument: str) -> Any:
    """``sample[key]``, with non-tensor TensorDict entries unwrapped to their python value.
    ``argument`` names the option that chose ``key``, for the KeyError."""
    try:
        value = sample.get(key, _MISSING) if is_tensor_collection(sample) else sample[key]
    except KeyError:
        value = _MISSING
    if value is _MISSING:
        raise KeyError(f"MCAdvantage: sample has no key {key!r} ({argument})")
    if is_non_tensor(value):
        return value.tolist()
    return value


def group_identity(prompt: Any, key: Any) -> Hashable:
    """A group identity: a tensor by value, a list as a tuple, any other value as it is."""
    if isinstance(prompt, torch.Tensor):
        return prompt.item() if prompt.numel() == 1 else tuple(prompt.flatten().tolist())
    if isinstance(prompt, list):
        prompt = tuple(prompt)
    try:
        hash(prompt)
    except TypeError:
        raise ValueError(f"prompt key {key!r} holds an unhashable {type(prompt).__name__}") from None
    return prompt


class GroupQueues:
    """Group identity -> the members (trajectories, records) waiting in its incomplete group,
    in arrival order.

    Reads return copies: a member list is replaced on each :meth:`append`, never changed in
    place, which is what a manager's dict (whose values are pickled copies) needs.
    """

    def __init__(self, store: Any = None) -> None:
        self._store = {} if store is None else store

    def shared(self, manager: Any) -> GroupQueues:
        """These groups, moved into a dict of ``manager`` (a ``multiprocessing.Manager()``)."""
        return GroupQueues(manager.dict(dict(self._store)))

    def append(self, group: Hashable, member: Any) -> list[Any]:
        """Add ``member`` to ``group``'s queue; return the queue (a copy)."""
        members = [*self._store.get(group, ()), member]
        self._store[group] = members
        return members

    def pop(self, group: Hashable) -> list[Any]:
        return list(self._store.pop(group))

    def clear(self) -> None:
        self._store.clear()

    def keys(self) -> list[Hashable]:
        return list(self._store.keys())

    def values(self) -> list[list[Any]]:
        return [list(members) for members in self._store.values()]

    def items(self) -> list[tuple[Hashable, list[Any]]]:
        return [(group, list(members)) for group, members in self._store.items()]

    def __getitem__(self, group: Hashable) -> list[Any]:
        return list(self._store[group])

    def __delitem__(self, group: Hashable) -> None:
        del self._store[group]

    def __contains__(self, group: Hashable) -> bool:
        return group in self._store

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._store)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"GroupQueues({dict(self.items())!r})"


class GroupingTransform:
    """The read side shared by :class:`~rlpost.objectives.MCAdvantage` and
    :class:`~rlpost.objectives.RayMCAdvantage` (TorchRL's): a grouping transform acts on write."""

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The read path: data sampled from a buffer passes unchanged."""
        return tensordict

    def __call__(self, data: Any) -> Any:
        """A TensorDict: :meth:`forward` (unchanged). Anything else: :meth:`add`."""
        if isinstance(data, TensorDictBase):
            return self.forward(data)
        return self.add(data)
