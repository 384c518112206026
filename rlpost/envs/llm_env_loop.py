"""The loop of TorchRL's older LLM envs (:mod:`rlpost.envs.llm_env`, :mod:`rlpost.envs.hashing_env`)
on :class:`~rlpost.envs.common.EnvBase`: the transforms' inverse pass (``inv``) before each step,
batch-less resets and the env's own action, reward and done keys; ``append_transform`` returns an
:class:`LLMTransformedEnv`, which runs the same loop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_leaf_nontensor

from rlpost.envs.common import FLAGS, EnvBase
from rlpost.envs.transforms import Compose, Transform, TransformedEnv


def run_inverse(transforms: Iterable[Transform], td: TensorDictBase) -> TensorDictBase:
    """Every transform's ``inv`` hook, last transform first (TorchRL's inverse order)."""
    for transform in reversed(list(transforms)):
        if isinstance(transform, Compose):
            td = run_inverse(transform, td)
        elif getattr(transform, "inv", None) is not None:
            td = transform.inv(td)
    return td


class SingleCompose(Compose):
    """A Compose that answers, while it holds one transform, the attributes of that transform
    (TorchRL's ``env.transform`` is the transform itself when there is one: ``env.transform.repeats``)."""

    def __getattr__(self, name: str) -> Any:
        transforms = self.__dict__.get("_transforms")
        if transforms is not None and len(transforms) == 1 and not name.startswith("_"):
            return getattr(transforms[0], name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class LLMEnvLoop:
    """What LLMEnv and LLMHashingEnv add to EnvBase's loop (see the module docstring)."""

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if isinstance(tensordict, TensorDictBase):
            tensordict = run_inverse(self.transforms, tensordict)
        return super().step(tensordict)

    def maybe_reset(self, next_td: TensorDictBase) -> TensorDictBase:
        if next_td.batch_dims:
            return super().maybe_reset(next_td)
        base = self.base_env
        root = next_td.select(base.input_mode, *self.state_keys, *FLAGS, strict=False)
        if not bool(root.get("done").any()):
            return root.clone(recurse=False)
        owned = {key for transform in self.transforms for key in transform.state_keys}
        return self.reset(root.select(*[key for key in (base.data_key,) if key not in owned], strict=False))

    @property
    def action_keys(self) -> list:
        return self.base_env._action_keys()

    @property
    def reward_keys(self) -> list:
        return self.base_env._reward_keys()

    @property
    def reward_key(self) -> Any:
        keys = self.reward_keys
        return keys[0] if keys else None

    @property
    def reward_spec(self) -> Any:
        """The reward's leaf spec, or the empty Composite of an env that writes no reward."""
        keys = self.reward_keys
        return self.full_reward_spec[keys[0]] if len(keys) == 1 else self.full_reward_spec

    @property
    def done_keys(self) -> list:
        return self.base_env._done_keys()

    def append_transform(self, transform: Transform) -> TransformedEnv:
        """A new TransformedEnv of this env and ``transform`` (this env is left as it was)."""
        return LLMTransformedEnv(self, transform)


class LLMTransformedEnv(LLMEnvLoop, TransformedEnv):
    """The TransformedEnv of an LLMEnv or LLMHashingEnv; ``append_transform`` edits it in place,
    as any TransformedEnv's."""

    def __init__(self, env: EnvBase, transform: Transform | None = None) -> None:
        TransformedEnv.__init__(self, env)
        inner = list(self.transform)
        self.__dict__["transform"] = SingleCompose()
        for existing in inner:
            TransformedEnv.append_transform(self, existing)
        if transform is not None:
            TransformedEnv.append_transform(self, transform)

    def append_transform(self, transform: Transform) -> LLMTransformedEnv:
        return TransformedEnv.append_transform(self, transform)


def stack_row_tds(rows: list[TensorDictBase]) -> TensorDictBase:
    """Row TensorDicts stacked densely when their entries agree in shape, else lazily."""
    return LazyStackedTensorDict.maybe_dense_stack(list(rows))


def restack_nested(td: TensorDictBase) -> TensorDictBase:
    """``td`` with jagged nested tensors turned into a lazy stack of rows (TorchRL's layout for
    rows of different lengths)."""
    if td.batch_dims and any(getattr(v, "is_nested", False) for v in td.values(True, True)):
        return stack_row_tds(td.unbind(0))
    return td


def merge_rows(kept: TensorDictBase, fresh: TensorDictBase, fresh_idx: list[int]) -> TensorDictBase:
    """``kept`` with rows ``fresh_idx`` taken from ``fresh`` (one row each, in order)."""
    keys = list(kept.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))
    missing = set(keys) - set(fresh.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))
    if missing:
        raise ValueError(f"cannot merge reset rows: keys {sorted(map(str, missing))} are missing from the reset output")
    rows = list(kept.unbind(0))
    fresh_rows = fresh.unbind(0)
    for j, i in enumerate(fresh_idx):
        rows[i] = fresh_rows[j].select(*keys)
    return stack_row_tds(rows)


def batch_size_of(batch_size: Any, *, what: str, error: type[Exception] = TypeError) -> torch.Size:
    """``None``/``0``/``()`` -> ``[]``; an int ``n`` -> ``[n]``; 1-D sizes as they are."""
    if batch_size is None or (isinstance(batch_size, int) and batch_size == 0):
        return torch.Size([])
    if isinstance(batch_size, int):
        return torch.Size([batch_size])
    size = torch.Size(batch_size)
    if len(size) > 1:
        raise error(f"batch-size of {what} must be 0 or 1d. Got batch_size={tuple(size)}.")
    return size
