"""AsyncEnvPool: several envs stepped concurrently, results taken as they finish (TorchRL's).

Each of ``len(env_makers)`` sub-envs (batch ``[1]``, e.g. a ChatEnv whose tools or reward take a
while, or unbatched: batch ``()``) is one row of the pool (batch ``[N]``); every row carries its sub-env's index under
``"env_index"``. ``async_step_and_maybe_reset_send(td)`` starts a step of the rows of ``td`` on a
thread each; ``async_step_and_maybe_reset_recv(min_get)`` returns as soon as ``min_get`` of
them are done (step and next root, rows in completion order); ``step(td)`` steps every row and
waits for all. An LLM collector with ``async_envs=True`` thus generates for the rows that are
ready while slow rows still run. The pool's specs (``full_action_spec``, ``full_observation_spec``,
``full_done_spec``, ...) are the sub-envs' with the pool's batch ``[N]`` in place of theirs;
``action_keys`` and the other key lists are the sub-envs'.

``stack`` says how rows are put together, as in TorchRL: ``"lazy"`` (a lazy stack, each row
kept as its sub-env returned it), ``"maybe_dense"`` (dense where the rows agree, lazy where they
do not) or ``"dense"`` (``torch.stack``: fails on rows of different shapes).

Deviations from TorchRL: one backend, threads (rlpost's envs release the GIL in their slow
parts: tool sandboxes, reward worker processes, HTTP); the pool's batch is ``[N]`` whether the
sub-envs have batch ``[1]`` or ``()`` (TorchRL's is ``[N, 1]`` for sub-envs of batch ``[1]``: here
row ``i`` is sub-env ``i``, which the collectors' ``env_index`` bookkeeping relies on); every wait
is bounded by ``timeout_s``; ``stack`` defaults to ``"lazy"`` (TorchRL: ``"dense"``), because
conversations of different lengths do not stack densely.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack, maybe_dense_stack

from rlpost.data.specs import Composite

_STACKS = {"lazy": lazy_stack, "maybe_dense": maybe_dense_stack, "dense": torch.stack}
# the sub-envs' specs the pool answers with its own batch size in place of theirs
_SPECS = frozenset({
    "full_observation_spec", "full_action_spec", "full_state_spec", "full_reward_spec", "full_done_spec",
    "observation_spec", "action_spec", "state_spec", "reward_spec", "done_spec",
})  # fmt: skip


class AsyncEnvPool:
    """A pool of sub-envs stepped on threads (see the module docstring).

    Args:
        env_makers: one callable per sub-env, or one callable and ``num_envs``.

    Keyword Args:
        num_envs: the number of sub-envs when ``env_makers`` is a single callable.
        backend: "threading" (the only one).
        stack: "lazy" (default), "maybe_dense" or "dense": how rows are stacked.
        timeout_s: bound of every wait for a sub-env.
    """

    _env_idx_key = "env_index"

    def __init__(
        self,
        env_makers: Callable[[], Any] | Sequence[Callable[[], Any]],
        *,
        num_envs: int | None = None,
        backend: str = "threading",
        stack: str = "lazy",
        timeout_s: float = 600.0,
    ) -> None:
        if backend != "threading":
            raise ValueError(f"AsyncEnvPool supports backend='threading' only, got {backend!r}")
        if stack not in _STACKS:
            raise ValueError(f"AsyncEnvPool stack must be one of {sorted(_STACKS)}, got {stack!r}")
        self.stack = stack
        if callable(env_makers):
            env_makers = [env_makers] * (num_envs or 1)
        self.envs = [make() for make in env_makers]
        sub_batches = {tuple(env.batch_size) for env in self.envs}
        if not sub_batches <= {(1,), ()} or len(sub_batches) != 1:
            raise ValueError(
                f"AsyncEnvPool sub-envs have batches {sorted(sub_batches)}; all must have batch [1], or all batch ()"
            )
        self._sub_dims = len(sub_batches.pop())  # 1: a row is td[i : i + 1]; 0: td[i]
        self.batch_size = torch.Size([len(self.envs)])
        self.timeout_s = timeout_s
        self._executor = cf.ThreadPoolExecutor(max_workers=len(self.envs), thread_name_prefix="async-env")
        self._pending: dict[cf.Future, int] = {}

    def __getattr__(self, name: str) -> Any:
        # attributes of the sub-envs (input_mode, tokenizer, ...): the first one's
        envs = self.__dict__.get("envs")
        if not envs or name.startswith("_"):
            raise AttributeError(name)
        if name in _SPECS:
            return _pool_spec(getattr(envs[0], name), len(envs), self._sub_dims)
        return getattr(envs[0], name)

    # ------------------------------------------------------------------ synchronous API

    def reset(self, tensordict: TensorDictBase | None = None) -> TensorDictBase:
        """Reset every sub-env (row ``i`` of ``tensordict`` goes to sub-env ``i``)."""
        rows = [None if tensordict is None else self._row(tensordict, i) for i in range(len(self.envs))]
        futures = [self._executor.submit(env.reset, row) for env, row in zip(self.envs, rows)]
        outs = [self._result(future, i, "reset") for i, future in enumerate(futures)]
        return self._stack([out[0] for out in outs], list(range(len(self.envs))))

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every row of ``tensordict`` (its ``env_index`` says which sub-env, else row ``i``
        is sub-env ``i``) and wait for all; the rows come back in ``tensordict``'s order, each
        with its ``"next"``."""
        indices = self._indices(tensordict)
        futures = [
            self._executor.submit(self.envs[index].step, self._row(tensordict, row).exclude(self._env_idx_key))
            for row, index in enumerate(indices)
        ]
        outs = [self._result(future, index, "step") for future, index in zip(futures, indices)]
        return self._stack([out[0] for out in outs], indices)

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """Step every row of ``tensordict`` and wait for all of them."""
        self.async_step_and_maybe_reset_send(tensordict)
        return self.async_step_and_maybe_reset_recv(min_get=tensordict.batch_size[0])

    # ------------------------------------------------------------------ asynchronous API

    def async_step_and_maybe_reset_send(self, tensordict: TensorDictBase) -> None:
        """Start a step of each row of ``tensordict`` (its ``env_index`` says which sub-env)."""
        indices = self._indices(tensordict)
        busy = set(self._pending.values()) & set(indices)
        if busy:
            raise RuntimeError(f"AsyncEnvPool: sub-envs {sorted(busy)} are still stepping; receive their results first")
        for row, index in enumerate(indices):
            data = self._row(tensordict, row).exclude(self._env_idx_key)
            self._pending[self._executor.submit(self.envs[index].step_and_maybe_reset, data)] = index

    def async_step_and_maybe_reset_recv(self, min_get: int = 1) -> tuple[TensorDictBase, TensorDictBase]:
        """The steps (and next roots) of at least ``min_get`` rows, in completion order."""
        if not self._pending:
            raise RuntimeError("AsyncEnvPool: no step is running (call async_step_and_maybe_reset_send first)")
        min_get = min(min_get, len(self._pending))
        done: list[cf.Future] = []
        while len(done) < min_get:
            finished, _ = cf.wait(
                [f for f in self._pending if f not in done], timeout=self.timeout_s, return_when=cf.FIRST_COMPLETED
            )
            if not finished:
                stuck = sorted(self._pending[f] for f in self._pending if f not in done)
                raise TimeoutError(f"AsyncEnvPool: sub-envs {stuck} did not finish a step within {self.timeout_s} s")
            done += list(finished)
        indices = [self._pending.pop(future) for future in done]
        results = [self._result(future, index, "step") for future, index in zip(done, indices)]
        return self._stack([r[0] for r in results], indices), self._stack([r[1] for r in results], indices)

    # ------------------------------------------------------------------ helpers

    def _row(self, tensordict: TensorDictBase, row: int) -> TensorDictBase:
        """Row ``row`` of ``tensordict`` with a sub-env's batch: ``[1]`` or ``()``."""
        return tensordict[row : row + 1] if self._sub_dims else tensordict[row]

    def _indices(self, tensordict: TensorDictBase) -> list[int]:
        if self._env_idx_key in tensordict.keys():
            return [int(i) for i in tensordict.get(self._env_idx_key).reshape(-1).tolist()]
        if tensordict.batch_size[0] != len(self.envs):
            raise ValueError(
                f"AsyncEnvPool: a batch of {tensordict.batch_size[0]} rows needs {self._env_idx_key!r} to say which "
                f"of the {len(self.envs)} sub-envs each row belongs to"
            )
        return list(range(len(self.envs)))

    def _result(self, future: cf.Future, index: int, what: str) -> tuple[TensorDictBase, ...]:
        try:
            out = future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise TimeoutError(
                f"AsyncEnvPool: sub-env {index} did not finish a {what} within {self.timeout_s} s"
            ) from None
        return out if isinstance(out, tuple) else (out,)

    def _stack(self, outs: list[TensorDictBase], indices: list[int]) -> TensorDictBase:
        rows = []
        for out, index in zip(outs, indices):
            row = out[0] if self._sub_dims else out
            row.set(self._env_idx_key, torch.tensor(index))
            rows.append(row)
        return _STACKS[self.stack](rows) if rows else TensorDict(batch_size=[0])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for env in self.envs:
            close = getattr(env, "close", None)
            if close is not None:
                close()

    def __repr__(self) -> str:
        return f"AsyncEnvPool(num_envs={len(self.envs)}, pending={len(self._pending)})"


def _pool_spec(spec: Any, num_envs: int, sub_dims: int) -> Any:
    """``spec`` of a sub-env with the pool's batch ``[num_envs]`` in place of the sub-env's
    ``sub_dims`` leading batch dims, in every entry of a Composite."""
    shape = torch.Size([num_envs, *spec.shape[sub_dims:]])
    if not isinstance(spec, Composite):
        return spec._with_shape(shape)
    entries = {
        key: None if entry is None else _pool_spec(entry, num_envs, sub_dims) for key, entry in spec._specs.items()
    }
    return Composite(
        entries, shape=shape, device=spec.device, data_cls=spec.data_cls, step_mdp_static=spec.step_mdp_static
    )
