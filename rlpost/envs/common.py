"""The run loop of an env and its transforms: :class:`EnvBase` (TorchRL's ``torchrl.envs.common``).

A base env (:class:`~rlpost.envs.chat.ChatEnv`) builds the first prompt (``_reset``) and the next
(``_step``); transforms (:mod:`rlpost.envs.transforms`) add data loading, rewards and tools through
hooks. :class:`EnvBase` runs both, for a base env alone and for a TransformedEnv::

    reset(td):  td = t.reset_preprocess(td)   for t in transforms    # e.g. load the query
                out = base._reset(td)
                out = t.on_reset(td, out)      for t in transforms
    step(td):   next = base._step(td)                                  # full -> next prompt
                copy the state keys (query, dataset row, ...) from td into next
                next = t.on_step(td, next)     for t in transforms    # e.g. reward, tool turn
                next["done"] |= terminated | truncated;  td["next"] = next

As in TorchRL, ``base_env.append_transform(t)`` returns a new TransformedEnv (``base_env`` is left
as it was), ``TransformedEnv.append_transform(t)`` appends in place, a TransformedEnv answers the
attributes it lacks from its base env (``env.tokenizer``, ``env.last_responses``...) and its specs
are the base env's passed through each transform's ``transform_<part>_spec``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase, lazy_stack

from rlpost.envs.errors import EnvInputError

if TYPE_CHECKING:
    from rlpost.data.specs import Composite

FLAGS = ("done", "terminated", "truncated")


class EnvBase:
    """What every env here does with its transforms: reset, step, rollout, state and specs.
    Subclasses provide ``base_env`` (whose ``_reset`` / ``_step`` build the prompts) and
    ``transforms``."""

    base_env: Any
    transforms: Any = ()

    # ------------------------------------------------------------------ reset and step

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        """The first prompt of each conversation of ``tensordict`` (batch ``[k]``, default the
        env's batch), which holds the query (or a DataLoadingPrimer fills it); the output keeps
        every input key."""
        if kwargs:
            raise TypeError(f"{type(self).__name__}.reset got unexpected keyword arguments {sorted(kwargs)}")
        base = self.base_env
        td = base._reset_input(tensordict)
        for transform in self.transforms:
            td = transform.reset_preprocess(td)
        out = base._reset(td, given=tensordict is not None)
        for transform in self.transforms:
            out = transform.on_reset(td, out)
        return out

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Make the policy's output the next prompt: ``tensordict["next"]`` gets it, the state
        keys, ``reward``, ``step_count`` and the done flags; returns ``tensordict``."""
        if not isinstance(tensordict, TensorDictBase):
            raise EnvInputError(f"{type(self).__name__}.step expects a TensorDict, got {type(tensordict).__name__}")
        next_td = self.base_env._step(tensordict)
        for key in self.state_keys:
            if key in tensordict.keys() and key not in next_td.keys():
                next_td.set(key, tensordict.get(key))
        for transform in self.transforms:
            next_td = transform.on_step(tensordict, next_td)
        next_td.set("done", next_td.get("done") | next_td.get("terminated") | next_td.get("truncated"))
        tensordict.set("next", next_td)
        return tensordict

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """``step(tensordict)``, and the next step's root input (:meth:`maybe_reset`)."""
        tensordict = self.step(tensordict)
        return tensordict, self.maybe_reset(tensordict.get("next"))

    def maybe_reset(self, next_td: TensorDictBase) -> TensorDictBase:
        """The next step's root input from a step's ``next``: its prompt, state keys and flags,
        with the rows that are done replaced by a reset of those rows."""
        base = self.base_env
        next_root = next_td.select(base.input_mode, *self.state_keys, *FLAGS, strict=False)
        done_idx = next_root.get("done").view(-1).nonzero().flatten().tolist()
        if not done_idx:
            return next_root.clone(recurse=False)
        # The reset input keeps the query only when no transform supplies it (a plain ChatEnv
        # restarts the same conversation; a DataLoadingPrimer draws the next prompts).
        owned = {key for transform in self.transforms for key in transform.state_keys}
        reset_keys = [key for key in (base.data_key, "system_prompt") if key not in owned]
        reset_out = self.reset(next_root[done_idx].select(*reset_keys, strict=False))
        return base._merge_rows(next_root, reset_out.select(*next_root.keys(), strict=False), done_idx)

    def rollout(
        self,
        max_steps: int,
        policy: Callable[[TensorDictBase], TensorDictBase] | None = None,
        callback: Callable[[Any, TensorDictBase], Any] | None = None,
        *,
        auto_reset: bool = True,
        break_when_any_done: bool | None = None,
        break_when_all_done: bool | None = None,
        tensordict: TensorDictBase | None = None,
    ) -> TensorDictBase:
        """Run ``policy`` for up to ``max_steps`` steps, stacked lazily along a new last batch
        dim (``[*batch_size, T]``), the rows' stack outermost as in TorchRL's rollout of lazily
        stacked rows (``out.get(key, as_list=True)``: one ``[T, ...]`` entry per row).

        As TorchRL: reset first (``auto_reset``; else ``tensordict`` is the first input), stop
        after a step where any env is done (the default) or all are (``break_when_all_done``);
        with neither, the done envs are reset and go on; ``callback(env, td)`` after each step.
        Deviation: a policy is required (an LLM env has no random action).
        """
        if policy is None:
            raise EnvInputError(
                f"{type(self).__name__}.rollout needs a policy (an LLM wrapper or any callable td -> td): "
                "a chat env has no random action"
            )
        if max_steps < 1:
            raise ValueError(f"rollout max_steps must be >= 1, got {max_steps}")
        if break_when_any_done is None:
            break_when_any_done = not break_when_all_done
        if auto_reset:
            td = self.reset(tensordict)
        elif tensordict is None:
            raise EnvInputError("rollout(auto_reset=False) needs the first step's input as tensordict=")
        else:
            td = tensordict
        steps = []
        for step in range(max_steps):
            td, next_root = self._rollout_step(policy(td), last=step == max_steps - 1)
            steps.append(td)
            if callback is not None:
                callback(self, td)
            done = td.get(("next", "done"))
            if next_root is None or (break_when_any_done and done.any()) or (break_when_all_done and done.all()):
                break
            td = next_root()
        return _stack_steps(steps, dim=len(self.batch_size))

    def _rollout_step(self, td: TensorDictBase, last: bool) -> tuple[TensorDictBase, Callable | None]:
        """One step of :meth:`rollout` and what makes the next step's input (None: stop). Here
        the reset comes after the break check and also after the last step, as TorchRL's."""
        td = self.step(td)
        return td, lambda: self.maybe_reset(td.get("next"))

    # ------------------------------------------------------------------ transforms and state

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Keys carried from each step's input to its ``next`` (and into partial resets)."""
        return union_state_keys(self.transforms, self.base_env.base_state_keys)

    @property
    def reward_errors(self) -> Counter:
        """Failed reward computations so far, by error type, summed over the transforms."""
        return sum_errors(self.transforms)

    def state_dict(self) -> dict[str, Any]:
        """The transforms' state (e.g. the prompt stream's position), for resume."""
        return {"transforms": [t.state_dict() for t in self.transforms]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_each(self.transforms, state["transforms"], "env")

    def set_seed(self, seed: int | None, static_seed: bool = False) -> int | None:
        """TorchRL compatibility; a no-op: the prompt order is seeded by the DataLoadingPrimer and
        sampling by the policy."""
        return seed

    def close(self) -> None:
        """Release what the transforms hold (sandboxes, worker threads)."""
        close_each(self.transforms)

    # ------------------------------------------------------------------ specs

    def _transformed_spec(self, part: str) -> Composite:
        return through_specs(self.transforms, part, getattr(self.base_env, f"_{part}_spec")())

    full_observation_spec = property(lambda self: self._transformed_spec("observation"))
    full_action_spec = property(lambda self: self._transformed_spec("action"))
    full_state_spec = property(lambda self: self._transformed_spec("state"))
    full_reward_spec = property(lambda self: self._transformed_spec("reward"))
    full_done_spec = property(lambda self: self._transformed_spec("done"))
    observation_spec = property(lambda self: self.full_observation_spec)
    state_spec = property(lambda self: self.full_state_spec)
    done_spec = property(lambda self: self.full_done_spec)

    @property
    def action_spec(self) -> Any:
        """The action's leaf spec when there is one action key (TorchRL's rule)."""
        keys = self.action_keys
        return self.full_action_spec[keys[0]] if len(keys) == 1 else self.full_action_spec

    @property
    def reward_spec(self) -> Any:
        return self.full_reward_spec["reward"]

    @property
    def action_keys(self) -> list:
        """The policy's ``full`` in the env's mode (read as a whole, as TorchRL's KL transforms do)."""
        return [(self.base_env.input_mode, "full")]

    @property
    def action_key(self) -> Any:
        return self.action_keys[0]

    @property
    def reward_keys(self) -> list:
        return ["reward"]

    @property
    def reward_key(self) -> str:
        return "reward"

    @property
    def done_keys(self) -> list:
        return list(FLAGS)


def _stack_steps(steps: list[TensorDictBase], dim: int) -> TensorDictBase:
    """The steps stacked lazily along a new batch dim ``dim``; for ``dim > 0`` row by row, the
    rows' stack outermost."""
    if dim == 0:
        return lazy_stack(steps, dim=0)
    num_rows = steps[0].batch_size[0]
    return lazy_stack([lazy_stack([step[i] for step in steps], dim - 1) for i in range(num_rows)], 0)


# What an env and a Compose both do with their list of transforms


def union_state_keys(transforms: Iterable[Any], keys: Iterable[str] = ()) -> tuple[str, ...]:
    """``keys``, then each transform's ``state_keys`` not among them yet, in order."""
    keys = list(keys)
    for transform in transforms:
        keys += [key for key in transform.state_keys if key not in keys]
    return tuple(keys)


def sum_errors(transforms: Iterable[Any]) -> Counter:
    """The transforms' ``errors`` counters (failed reward computations by type), summed."""
    total: Counter = Counter()
    for transform in transforms:
        total.update(getattr(transform, "errors", Counter()))
    return total


def load_each(transforms: Sequence[Any], states: Sequence[dict[str, Any]], owner: str) -> None:
    if len(states) != len(transforms):
        raise ValueError(f"state has {len(states)} transform states, this {owner} has {len(transforms)} transforms")
    for transform, transform_state in zip(transforms, states):
        transform.load_state_dict(transform_state)


def close_each(transforms: Iterable[Any]) -> None:
    for transform in transforms:
        close = getattr(transform, "close", None)
        if close is not None:
            close()


def through_specs(transforms: Iterable[Any], part: str, spec: Composite) -> Composite:
    """``spec`` passed through each transform's ``transform_<part>_spec`` in order, as TorchRL's
    TransformedEnv does."""
    for transform in transforms:
        spec = getattr(transform, f"transform_{part}_spec")(spec)
    return spec
