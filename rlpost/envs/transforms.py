"""Env transforms: the hook protocol, :class:`Compose`, :class:`TransformedEnv` and
:class:`StepCounter` (TorchRL's ``torchrl.envs.transforms``).

A transform adds one capability (data loading, a reward, a tool) through hooks that
:class:`~rlpost.envs.common.EnvBase` calls (its module docstring draws the loop):
``reset_preprocess(td)``, ``on_reset(td, out)``, ``on_step(td, next)``; TorchRL's
``_reset_env_preprocess`` / ``_reset`` / ``_step``. Deliberate deviation: no
``_call``/``_inv_call`` (observations and actions are not rewritten on the way in or out; the
older LLM envs' ``inv`` pass is :mod:`rlpost.envs.llm_env_loop`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from rlpost.data.stacking import as_nested_tensor, as_padded_tensor  # noqa: F401  (TorchRL's place for them)
from rlpost.envs.common import EnvBase, close_each, load_each, sum_errors, through_specs, union_state_keys
from rlpost.envs.errors import EnvInputError
from rlpost.envs.td_rows import NestedKey, as_key, has_key

if TYPE_CHECKING:
    from rlpost.data.specs import Composite

# per row of ``next``: the named parts of this step's reward ([B, 1] float64 each), for the metrics
REWARD_PARTS_KEY = "reward_parts"


class Transform:
    """Base class of env transforms; every hook defaults to "no change". ``parent``: the env
    it was appended to; ``state_keys``: keys it writes at reset that the env carries from step to
    step (e.g. the dataset row a reward reads later)."""

    state_keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.parent: EnvBase | None = None

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        """Before the base reset: fill or edit the reset input (``td`` has batch ``[k]``)."""
        return td

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        """After the base reset: edit its output ``reset_td`` (``td`` is the reset input)."""
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        """After the base step: edit ``next_td`` (reward, done, next prompt) from ``td``, the
        step input carrying the policy's output."""
        return next_td

    # TorchRL's spec hooks: a transform that writes a key adds its spec to the Composite in place.
    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        return observation_spec

    def transform_action_spec(self, action_spec: Composite) -> Composite:
        return action_spec

    def transform_state_spec(self, state_spec: Composite) -> Composite:
        return state_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        return reward_spec

    def transform_done_spec(self, done_spec: Composite) -> Composite:
        return done_spec

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue as if uninterrupted (empty for stateless transforms)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state {sorted(state)}")

    def _env(self) -> EnvBase:
        if self.parent is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to an env (use env.append_transform)")
        return self.parent

    def _chat_env(self) -> EnvBase:
        """The env, which must hold a conversation (a ChatEnv, possibly transformed)."""
        env = self._env()
        if not callable(getattr(env, "last_responses", None)):
            base = getattr(env, "base_env", env)
            raise EnvInputError(
                f"{type(self).__name__} reads the policy's messages (history, text or tokens of a ChatEnv); "
                f"{type(base).__name__} holds no conversation: append it to a ChatEnv"
            )
        return env

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _through_each(part: str) -> Callable[[Compose, Composite], Composite]:
    """A Compose's ``transform_<part>_spec``: the spec through each of its transforms in order."""
    return lambda self, spec: through_specs(self._transforms, part, spec)


class Compose(Transform):
    """Transforms run in order as one (TorchRL's ``Compose``); a TransformedEnv keeps its
    transforms in one (``compose[i]``, ``len``, iteration)."""

    def __init__(self, *transforms: Transform) -> None:
        super().__init__()
        self._transforms: list[Transform] = []
        for transform in transforms:
            self.append(transform)

    def append(self, transform: Transform) -> None:
        self.insert(len(self._transforms), transform)

    def insert(self, index: int, transform: Transform) -> None:
        if not isinstance(transform, Transform):
            raise ValueError(f"Compose holds Transforms, got {type(transform).__name__}")
        self._transforms.insert(index, transform)

    def __getitem__(self, index: int) -> Transform:
        return self._transforms[index]

    def __len__(self) -> int:
        return len(self._transforms)

    def __iter__(self):
        return iter(self._transforms)

    @property
    def parent(self):
        return self.__dict__.get("_parent")

    @parent.setter
    def parent(self, env) -> None:
        self.__dict__["_parent"] = env
        for transform in getattr(self, "_transforms", ()):
            transform.parent = env

    state_keys = property(lambda self: union_state_keys(self._transforms))
    errors = property(lambda self: sum_errors(self._transforms))

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        for transform in self._transforms:
            td = transform.reset_preprocess(td)
        return td

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        for transform in self._transforms:
            reset_td = transform.on_reset(td, reset_td)
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        for transform in self._transforms:
            next_td = transform.on_step(td, next_td)
        return next_td

    transform_observation_spec = _through_each("observation")
    transform_action_spec = _through_each("action")
    transform_state_spec = _through_each("state")
    transform_reward_spec = _through_each("reward")
    transform_done_spec = _through_each("done")

    def state_dict(self) -> dict[str, Any]:
        return {"transforms": [transform.state_dict() for transform in self._transforms]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_each(self._transforms, state.get("transforms", []) if state else [], "Compose")

    def close(self) -> None:
        close_each(self._transforms)

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self._transforms))})"


class TransformedEnv(EnvBase):
    """A base env with a :class:`Compose` of transforms, ``env.transform`` (TorchRL's
    ``TransformedEnv``); ``append_transform`` and ``insert_transform`` edit it in place. Given a
    TransformedEnv as ``env``, its base env and transforms are taken over (it is left as it was).
    """

    def __init__(self, env: EnvBase, transform: Transform | None = None) -> None:
        if not isinstance(env, EnvBase):
            raise ValueError(f"TransformedEnv expects an env, got {type(env).__name__}")
        inner = list(env.transforms) if isinstance(env, TransformedEnv) else []
        self.__dict__["base_env"] = env.base_env
        self.__dict__["transform"] = Compose()
        for existing in inner:
            self.append_transform(existing)
        if transform is not None:
            self.append_transform(transform)

    @property
    def transforms(self) -> list[Transform]:
        return list(self.transform)

    def append_transform(self, transform: Transform) -> TransformedEnv:
        """Append ``transform`` (in place) and return this env, for chaining."""
        if not isinstance(transform, Transform):
            raise ValueError(f"append_transform expects a Transform, got {type(transform).__name__}")
        transform.parent = self
        self.transform.append(transform)
        return self

    def insert_transform(self, index: int, transform: Transform) -> TransformedEnv:
        """Insert ``transform`` at ``index`` (in place) and return this env."""
        if not isinstance(transform, Transform):
            raise ValueError(f"insert_transform expects a Transform, got {type(transform).__name__}")
        transform.parent = self
        self.transform.insert(index, transform)
        return self

    @property
    def batch_size(self) -> torch.Size:
        return self.base_env.batch_size

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this env does not have: ask the base env.
        base = self.__dict__.get("base_env")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(base, name)

    def __repr__(self) -> str:
        return f"TransformedEnv(env={self.base_env!r}, transform={self.transform!r})"


class StepCounter(Transform):
    """Count each episode's steps (int64 ``[*B, 1]``) and truncate it after ``max_steps``
    (TorchRL's ``StepCounter``); on a ChatEnv, which counts its steps itself, the count is the same.

    Deliberate deviation from TorchRL: rlpost's env loop sets ``done`` wherever ``truncated``
    is set after every step, so ``update_done=False`` cannot leave ``done`` unset.
    """

    def __init__(
        self,
        max_steps: int | None = None,
        truncated_key: NestedKey = "truncated",
        step_count_key: NestedKey = "step_count",
        update_done: bool = True,
    ) -> None:
        super().__init__()
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"StepCounter max_steps must be a positive int or None, got {max_steps!r}")
        self.max_steps = max_steps
        self.truncated_key, self.step_count_key = as_key(truncated_key), as_key(step_count_key)
        self.update_done = update_done

    @property
    def state_keys(self) -> tuple:
        return (self.step_count_key,)

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        reset_td.set(self.step_count_key, torch.zeros(*reset_td.batch_size, 1, dtype=torch.int64))
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        shape = (*next_td.batch_size, 1)
        count = (
            td.get(self.step_count_key) if has_key(td, self.step_count_key) else torch.zeros(shape, dtype=torch.int64)
        )
        count = count.reshape(shape).to(torch.int64) + 1
        next_td.set(self.step_count_key, count)
        if self.max_steps is not None:
            reached = count >= self.max_steps
            current = torch.zeros_like(reached)
            if has_key(next_td, self.truncated_key):
                current = next_td.get(self.truncated_key)
            next_td.set(self.truncated_key, current.reshape(shape) | reached)
            if self.update_done:
                next_td.set("done", next_td.get("done").reshape(shape) | reached)
        return next_td

    def __repr__(self) -> str:
        return f"StepCounter(max_steps={self.max_steps})"


def set_reward_part(next_td: TensorDictBase, name: str, values: list[float]) -> None:
    """Record ``values`` (one per row) as the part ``name`` of this step's reward, which the
    metrics report as ``reward_part/<name>``; the reward itself is ``next_td["reward"]``."""
    next_td.set((REWARD_PARTS_KEY, name), torch.tensor(values, dtype=torch.float64).view(-1, 1))
