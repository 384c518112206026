"""SerialEnv: several envs run one after the other as one batched env (TorchRL's ``SerialEnv``).

Batch ``[num_workers, *sub_env.batch_size]``: row ``i`` of every input and output is sub-env
``i``'s, and the outputs stack lazily (conversations of different lengths). Attributes SerialEnv
lacks are the first sub-env's (``env.input_mode``); specs are the sub-envs' with ``num_workers``
in front. TorchRL's MLGym test builds one so::

    env = SerialEnv(1, [partial(make_mlgym, task="prisonersDilemma", tokenizer=tokenizer)])
    rollout = env.rollout(3, policy)       # batch [1, *sub-env batch, 3]

Deviations from TorchRL: the sub-envs live in this process and nothing is copied to shared
memory or buffers; TorchRL's process and memory options (``pin_memory``, ``shared_memory``,
``num_threads``, ...) are accepted and have no effect; for envs in worker threads use
:class:`~rlpost.envs.async_pool.AsyncEnvPool`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase, lazy_stack

from rlpost.data.specs import Composite
from rlpost.envs.common import EnvBase

# TorchRL's batched-env options about processes, threads and memory: no effect on a serial env here
_NO_EFFECT = frozenset({
    "pin_memory", "share_individual_td", "shared_memory", "memmap", "policy_proof", "device",
    "allow_step_when_done", "num_threads", "num_sub_threads", "serial_for_single", "non_blocking",
    "mp_start_method", "use_buffers", "metadata_from_workers", "consolidate", "daemon", "shutdown_timeout",
})  # fmt: skip


def _with_leading_dim(spec: Any, num: int) -> Any:
    """``spec`` with ``num`` put in front of its shape, in every entry of a Composite."""
    if spec is None:
        return None
    shape = torch.Size([num, *spec.shape])
    if not isinstance(spec, Composite):
        return spec._with_shape(shape)
    entries = {key: _with_leading_dim(spec[key], num) for key in spec.keys()}
    return Composite(
        entries, shape=shape, device=spec.device, data_cls=spec.data_cls, step_mdp_static=spec.step_mdp_static
    )


class SerialEnv(EnvBase):
    """``num_workers`` envs stepped in turn as one env (see the module docstring).
    ``create_env_fn``: one constructor for all sub-envs or one per sub-env; ``create_env_kwargs``:
    one dict for all or one per sub-env."""

    def __init__(
        self,
        num_workers: int,
        create_env_fn: Callable[..., Any] | Sequence[Callable[..., Any]],
        *,
        create_env_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        if unknown := set(options) - _NO_EFFECT:
            raise TypeError(f"SerialEnv got unexpected keyword arguments {sorted(unknown)}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"SerialEnv num_workers must be an int >= 1, got {num_workers!r}")
        makers = list(create_env_fn) if isinstance(create_env_fn, Sequence) else [create_env_fn] * num_workers
        if len(makers) != num_workers:
            raise ValueError(f"SerialEnv got {len(makers)} env constructors for num_workers={num_workers}")
        if create_env_kwargs is None or isinstance(create_env_kwargs, Mapping):
            kwargs_list = [dict(create_env_kwargs or {}) for _ in range(num_workers)]
        else:
            kwargs_list = [dict(kwargs) for kwargs in create_env_kwargs]
            if len(kwargs_list) != num_workers:
                raise ValueError(f"SerialEnv got {len(kwargs_list)} create_env_kwargs for num_workers={num_workers}")
        self.num_workers = num_workers
        self.create_env_fn, self.create_env_kwargs = makers, kwargs_list
        self.envs = [make(**kwargs) for make, kwargs in zip(makers, kwargs_list)]
        sub_batches = {tuple(env.batch_size) for env in self.envs}
        if len(sub_batches) != 1:
            raise ValueError(f"SerialEnv sub-envs have different batch sizes {sorted(sub_batches)}")
        self.batch_size = torch.Size([num_workers, *sub_batches.pop()])
        self.is_closed = False

    @property
    def base_env(self) -> Any:
        """The first sub-env's base env (what the attributes of an env are read from)."""
        return self.envs[0].base_env

    def __getattr__(self, name: str) -> Any:
        envs = self.__dict__.get("envs")
        if not envs or name.startswith("_"):
            raise AttributeError(name)
        return getattr(envs[0], name)

    # ------------------------------------------------------------------ reset and step

    def _rows(self, tensordict: TensorDictBase, what: str) -> list[TensorDictBase]:
        if tensordict.batch_size[:1] != torch.Size([self.num_workers]):
            raise ValueError(
                f"SerialEnv.{what}: expected a TensorDict of batch [{self.num_workers}, ...] (one row per sub-env), "
                f"got {list(tensordict.batch_size)}"
            )
        return [tensordict[i] for i in range(self.num_workers)]

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        """Reset every sub-env (row ``i`` of ``tensordict`` is sub-env ``i``'s reset input)."""
        if kwargs:
            raise TypeError(f"SerialEnv.reset got unexpected keyword arguments {sorted(kwargs)}")
        rows = [None] * self.num_workers if tensordict is None else self._rows(tensordict, "reset")
        return lazy_stack([env.reset(row) for env, row in zip(self.envs, rows)], 0)

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every sub-env on its row; ``tensordict["next"]`` gets their ``next``."""
        outs = [env.step(row) for env, row in zip(self.envs, self._rows(tensordict, "step"))]
        tensordict.set("next", lazy_stack([out.get("next") for out in outs], 0))
        return tensordict

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """``step(tensordict)``, and the next step's input: each sub-env's, its done rows reset."""
        outs = [env.step_and_maybe_reset(row) for env, row in zip(self.envs, self._rows(tensordict, "step"))]
        tensordict.set("next", lazy_stack([out.get("next") for out, _ in outs], 0))
        return tensordict, lazy_stack([root for _, root in outs], 0)

    def maybe_reset(self, next_td: TensorDictBase) -> TensorDictBase:
        """Each sub-env's next root input from its row of ``next_td`` (its done rows reset)."""
        rows = self._rows(next_td, "maybe_reset")
        return lazy_stack([env.maybe_reset(row) for env, row in zip(self.envs, rows)], 0)

    def _rollout_step(self, td: TensorDictBase, last: bool) -> tuple[TensorDictBase, Callable | None]:
        """:meth:`EnvBase.rollout <rlpost.envs.common.EnvBase.rollout>`'s step, through the
        sub-envs' ``step_and_maybe_reset`` (what every env here has; MLGymWrapper has no
        ``maybe_reset``): the reset comes before the break check, and none after the last step."""
        if last:
            return self.step(td), None
        td, next_root = self.step_and_maybe_reset(td)
        return td, lambda: next_root

    # ------------------------------------------------------------------ the sub-envs' state

    @property
    def transforms(self) -> list:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {f"worker{i}": env.state_dict() for i, env in enumerate(self.envs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, env in enumerate(self.envs):
            env.load_state_dict(state[f"worker{i}"])

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.is_closed = True

    # ------------------------------------------------------------------ specs

    def _transformed_spec(self, part: str) -> Composite:
        """The first sub-env's ``full_<part>_spec`` with ``num_workers`` in front."""
        return _with_leading_dim(getattr(self.envs[0], f"full_{part}_spec"), self.num_workers)

    def __repr__(self) -> str:
        return f"SerialEnv(num_workers={self.num_workers}, env={self.envs[0]!r})"
