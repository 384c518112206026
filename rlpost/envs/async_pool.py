"""AsyncEnvPool: several envs stepped concurrently, results taken as they finish (TorchRL's).

Each of ``len(env_makers)`` sub-envs (batch ``[1]``, or ``()``) is one row of the pool (batch
``[N]``), carrying its index under ``"env_index"``. TorchRL's asynchronous API is three
send/recv pairs: ``async_step_*``, ``async_step_and_maybe_reset_*`` and ``async_reset_*``. A send
starts one thread per row; a sub-env sent something not yet received is busy (a second send to
it raises ``RuntimeError``); a recv waits for ``min_get`` results of its kind, also takes those
already done and stacks them in ``env_index`` order (TorchRL's sort). ``reset``, ``step`` and
``step_and_maybe_reset`` do every row and wait for all. An LLM collector with
``async_envs=True`` thus generates for the ready rows while slow ones still run. The specs are the
sub-envs' with the pool's batch ``[N]``.

Deviations from TorchRL: one backend, threads (``backend="multiprocessing"`` raises
``ValueError``: rlpost's envs release the GIL in their slow parts, tool sandboxes, reward worker
processes and HTTP, and hold those processes and clients, which do not move to a child process);
the pool's batch is ``[N]`` whether the sub-envs have batch ``[1]`` or ``()`` (TorchRL's is
``[N, 1]`` for sub-envs of batch ``[1]``: here row ``i`` is sub-env ``i``, which the collectors'
``env_index`` bookkeeping relies on), so a per-env recv returns the row (batch ``()``) and
``env_index`` is an int64 tensor (TorchRL: a NonTensorStack); every wait for a sub-env is bounded
by ``timeout_s`` (``TimeoutError``); a per-env send to a busy sub-env raises too (TorchRL's
replaces the pending result), and ``step`` / ``reset`` refuse busy sub-envs only (TorchRL's refuse
while any step is pending); ``async_step_and_maybe_reset_recv`` asked for more results than are
pending returns those pending (TorchRL raises, as ``async_step_recv`` and ``async_reset_recv`` do
here); ``stack`` defaults to ``"lazy"`` (TorchRL: ``"dense"``): conversations of different
lengths do not stack densely.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
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
# what a send asks of a sub-env: the kind of the send/recv pair -> the sub-env's method
_STEP, _STEP_RESET, _RESET = "step", "step_and_maybe_reset", "reset"
_NOUNS = {_STEP: "step", _STEP_RESET: "step", _RESET: "reset"}
_SENDS = {_STEP: "async_step_send", _STEP_RESET: "async_step_and_maybe_reset_send", _RESET: "async_reset_send"}


class AsyncEnvPool:
    """A pool of sub-envs stepped on threads (see the module docstring). ``env_makers``: one
    callable per sub-env, or one and ``num_envs``; ``stack``: "lazy" (default), "maybe_dense" or
    "dense" (``torch.stack``); ``min_get``: that of a recv that gives none (1, as TorchRL)."""

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
            raise ValueError(
                f"AsyncEnvPool supports backend='threading' only, got {backend!r}: rlpost runs sub-envs on threads on "
                "purpose (their slow parts release the GIL, and they hold worker processes and clients that do not "
                "move to a child process)"
            )
        if stack not in _STACKS:
            raise ValueError(f"AsyncEnvPool stack must be one of {sorted(_STACKS)}, got {stack!r}")
        self.backend = backend
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
        self.num_envs = len(self.envs)
        self.batch_size = torch.Size([self.num_envs])
        self.min_get = 1
        self.timeout_s = timeout_s
        self._executor = cf.ThreadPoolExecutor(max_workers=self.num_envs, thread_name_prefix="async-env")
        self._lock = threading.Lock()  # guards the bookkeeping below (sends and recvs may come from several threads)
        self._pending: dict[cf.Future, tuple[str, int]] = {}  # batch sends: future -> (kind, sub-env)
        self._per_env: dict[tuple[str, int], cf.Future] = {}  # per-env sends (env_index=int)
        self._busy: set[int] = set()  # sub-envs sent something whose result was not received yet

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
        indices = list(range(self.num_envs))
        rows = [None if tensordict is None else self._row(tensordict, i) for i in indices]
        return self._run_all(_RESET, indices, rows)[0]

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every row of ``tensordict`` (sub-envs chosen as in :meth:`async_step_send`) and
        wait for all; the rows come back in ``tensordict``'s order."""
        indices = self._indices(tensordict, None)
        return self._run_all(_STEP, indices, [self._row(tensordict, row) for row in range(len(indices))])[0]

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """Step every row of ``tensordict`` and wait for all of them: the steps and the next
        roots, in ``tensordict``'s order."""
        indices = self._indices(tensordict, None)
        return self._run_all(_STEP_RESET, indices, [self._row(tensordict, row) for row in range(len(indices))])

    # ------------------------------------------------------------------ asynchronous API

    def async_step_send(self, tensordict: TensorDictBase, env_index: int | Sequence[int] | None = None) -> None:
        """Start a step of each row of ``tensordict`` (batch ``()``: one row) on sub-envs
        ``env_index`` (a list: one per row; an int: a per-env send, received with
        ``async_step_recv(env_index=i)``), else ``tensordict["env_index"]``, else row ``i`` on
        sub-env ``i``. ``RuntimeError`` when one of them is busy."""
        self._send(_STEP, tensordict, env_index)

    def async_step_recv(
        self,
        min_get: int | None = None,
        env_index: int | None = None,
        *,
        max_get: int | None = None,
        timeout: float | None = None,
    ) -> TensorDictBase:
        """The steps of at least ``min_get`` rows (default ``self.min_get``) in ``env_index``
        order, with every other one done (at most ``max_get``; with ``timeout``, those done within
        ``timeout`` s of the first); ``env_index=i``: sub-env ``i``'s per-env step, its row.
        Raises ``RuntimeError`` when fewer than ``min_get`` steps are pending."""
        return self._recv(_STEP, min_get, env_index, max_get, timeout)[0]

    def async_step_and_maybe_reset_send(
        self, tensordict: TensorDictBase, env_index: int | Sequence[int] | None = None
    ) -> None:
        """Start a step of each row of ``tensordict``, the sub-envs chosen as in
        :meth:`async_step_send`; each gives the step and the next root."""
        self._send(_STEP_RESET, tensordict, env_index)

    def async_step_and_maybe_reset_recv(
        self,
        min_get: int | None = None,
        env_index: int | None = None,
        *,
        max_get: int | None = None,
        timeout: float | None = None,
    ) -> tuple[TensorDictBase, TensorDictBase]:
        """The steps and next roots of at least ``min_get`` rows, as :meth:`async_step_recv`
        (rlpost: ``min_get`` above the pending count waits for all that are pending)."""
        return self._recv(_STEP_RESET, min_get, env_index, max_get, timeout)

    def async_reset_send(
        self, tensordict: TensorDictBase | None = None, env_index: int | Sequence[int] | None = None
    ) -> None:
        """Start a reset of each row of ``tensordict``, the sub-envs chosen as in
        :meth:`async_step_send`; with ``tensordict=None`` the sub-envs ``env_index`` (default
        all) reset with no input."""
        self._send(_RESET, tensordict, env_index)

    def async_reset_recv(
        self,
        min_get: int | None = None,
        env_index: int | None = None,
        *,
        max_get: int | None = None,
        timeout: float | None = None,
    ) -> TensorDictBase:
        """The resets of at least ``min_get`` rows, as :meth:`async_step_recv`."""
        return self._recv(_RESET, min_get, env_index, max_get, timeout)[0]

    # ------------------------------------------------------------------ sends and receives

    def _send(self, kind: str, tensordict: TensorDictBase | None, env_index: int | Sequence[int] | None) -> None:
        per_env = isinstance(env_index, int)
        if tensordict is None:
            if kind != _RESET:
                raise ValueError(f"AsyncEnvPool.{_SENDS[kind]} needs a tensordict")
            indices = [env_index] if per_env else list(range(self.num_envs)) if env_index is None else list(env_index)
            self._check_indices(indices)
            rows = [None] * len(indices)
        else:
            if tensordict.batch_dims == 0:  # one row (its env_index, or env_index=, says which sub-env)
                tensordict = tensordict.unsqueeze(0)
            indices = self._indices(tensordict, [env_index] if per_env else env_index)
            rows = [self._row(tensordict, row) for row in range(len(indices))]
        with self._lock:
            busy = self._busy.intersection(indices)
            if busy:
                raise RuntimeError(
                    f"AsyncEnvPool: some envs are still processing a step: sub-envs {sorted(busy)} (busy: "
                    f"{sorted(self._busy)}, queried: {indices}); receive their results first"
                )
            self._busy.update(indices)
            for index, row in zip(indices, rows):
                future = self._submit(kind, index, row)
                if per_env:
                    self._per_env[kind, index] = future
                else:
                    self._pending[future] = (kind, index)

    def _recv(
        self, kind: str, min_get: int | None, env_index: int | None, max_get: int | None, timeout: float | None
    ) -> tuple[TensorDictBase, ...]:
        if env_index is not None:
            return self._recv_one(kind, int(env_index))
        min_get = self.min_get if min_get is None else min_get
        if min_get < 1:
            raise ValueError(f"AsyncEnvPool: min_get must be positive, got {min_get}")
        if max_get is not None and max_get < min_get:
            raise ValueError(f"AsyncEnvPool: max_get ({max_get}) must be at least min_get ({min_get})")
        if timeout is not None and timeout < 0:
            raise ValueError(f"AsyncEnvPool: timeout must be non-negative, got {timeout}")
        with self._lock:
            futures = {future: index for future, (k, index) in self._pending.items() if k == kind}
        if not futures:
            raise RuntimeError(f"AsyncEnvPool: no {_NOUNS[kind]} is running (call {_SENDS[kind]} first)")
        if min_get > len(futures):
            if kind != _STEP_RESET:
                raise RuntimeError(
                    f"AsyncEnvPool: cannot await {min_get} {_NOUNS[kind]}s when only {len(futures)} are running"
                )
            min_get = len(futures)
        chosen = self._gather(futures, min_get, len(futures) if max_get is None else max_get, timeout)
        with self._lock:
            chosen = [future for future in chosen if future in self._pending]  # not taken by another thread's recv
            for future in chosen:
                del self._pending[future]
                self._busy.discard(futures[future])
        if not chosen:
            raise RuntimeError(f"AsyncEnvPool: another thread received these {_NOUNS[kind]}s first")
        indices = [futures[future] for future in chosen]
        results = [self._result(future, index, kind) for future, index in zip(chosen, indices)]
        order = sorted(range(len(chosen)), key=indices.__getitem__)  # TorchRL's: by env_index
        return tuple(
            self._stack([results[i][part] for i in order], [indices[i] for i in order])
            for part in range(len(results[0]))
        )

    def _recv_one(self, kind: str, index: int) -> tuple[TensorDictBase, ...]:
        with self._lock:
            future = self._per_env.get((kind, index))
        if future is None:
            raise RuntimeError(
                f"AsyncEnvPool: sub-env {index} has no {_NOUNS[kind]} of its own running (send one with "
                f"{_SENDS[kind]}(td, env_index={index}))"
            )
        try:
            result = self._result(future, index, kind)
        finally:
            if future.done():
                with self._lock:
                    del self._per_env[kind, index]
                    self._busy.discard(index)
        return tuple(self._tag(part, index) for part in result)

    def _gather(self, futures: dict[cf.Future, int], min_get: int, limit: int, timeout: float | None) -> list:
        """Wait until ``min_get`` of ``futures`` are done, then take the others done (within
        ``timeout`` s of the first result), ``limit`` at most; lowest ``env_index`` first when
        more are done than may be taken."""
        waiting, chosen, deadline = set(futures), [], None
        while waiting and len(chosen) < limit:
            if len(chosen) < min_get:
                wait_s = self.timeout_s
            elif deadline is not None and deadline > time.monotonic():
                wait_s = deadline - time.monotonic()
            else:
                wait_s = 0.0
            done, waiting = cf.wait(waiting, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            if not done:
                if len(chosen) < min_get:
                    stuck = sorted(futures[future] for future in waiting)
                    raise TimeoutError(
                        f"AsyncEnvPool: sub-envs {stuck} did not finish within {self.timeout_s} s (timeout_s)"
                    )
                break
            if deadline is None and timeout is not None:
                deadline = time.monotonic() + timeout
            ranked = sorted(done, key=futures.__getitem__)
            chosen += ranked[: limit - len(chosen)]
        return chosen

    def _run_all(self, kind: str, indices: list[int], rows: list) -> tuple[TensorDictBase, ...]:
        """Run ``kind`` on each sub-env of ``indices`` with its row and wait for all; the rows'
        results in ``indices``' order."""
        self._check_indices(indices)
        with self._lock:
            busy = self._busy.intersection(indices)
            if busy:
                raise RuntimeError(
                    f"AsyncEnvPool: some envs are still processing a step: sub-envs {sorted(busy)}; "
                    "receive their results first"
                )
            self._busy.update(indices)
            futures = [self._submit(kind, index, row) for index, row in zip(indices, rows)]
        try:
            results = [self._result(future, index, kind) for future, index in zip(futures, indices)]
        finally:
            with self._lock:
                self._busy.difference_update(index for future, index in zip(futures, indices) if future.done())
            for future, index in zip(futures, indices):  # timed out: busy until it ends
                if not future.done():
                    future.add_done_callback(lambda _, index=index: self._release(index))
        return tuple(self._stack([r[part] for r in results], indices) for part in range(len(results[0])))

    def _release(self, index: int) -> None:
        with self._lock:
            self._busy.discard(index)

    def _submit(self, kind: str, index: int, row: TensorDictBase | None) -> cf.Future:
        env = self.envs[index]
        if row is not None:
            row = row.exclude(self._env_idx_key)
        if kind == _RESET:
            return self._executor.submit(env.reset, row)
        return self._executor.submit(getattr(env, kind), row)

    # ------------------------------------------------------------------ helpers

    def _row(self, tensordict: TensorDictBase, row: int) -> TensorDictBase:
        """Row ``row`` of ``tensordict`` with a sub-env's batch: ``[1]`` or ``()``."""
        return tensordict[row : row + 1] if self._sub_dims else tensordict[row]

    def _indices(self, tensordict: TensorDictBase, env_index: Sequence[int] | None) -> list[int]:
        """The sub-env of each row: the ``env_index`` given, else the tensordict's
        ``env_index``, else row ``i`` is sub-env ``i``."""
        if env_index is not None:
            indices = [int(i) for i in env_index]
        elif self._env_idx_key in tensordict.keys():
            indices = [int(i) for i in torch.as_tensor(tensordict.get(self._env_idx_key)).reshape(-1).tolist()]
        elif tensordict.batch_size[0] != self.num_envs:
            raise ValueError(
                f"AsyncEnvPool: a batch of {tensordict.batch_size[0]} rows needs {self._env_idx_key!r} to say which "
                f"of the {self.num_envs} sub-envs each row belongs to"
            )
        else:
            indices = list(range(self.num_envs))
        if len(indices) != tensordict.batch_size[0]:
            raise ValueError(f"AsyncEnvPool: {len(indices)} env indices for a batch of {tensordict.batch_size[0]} rows")
        self._check_indices(indices)
        return indices

    def _check_indices(self, indices: list[int]) -> None:
        bad = [i for i in indices if not 0 <= i < self.num_envs]
        if bad:
            raise ValueError(f"AsyncEnvPool: env indices {bad} out of range for {self.num_envs} sub-envs")
        if len(set(indices)) != len(indices):
            raise ValueError(f"AsyncEnvPool: env indices {indices} name a sub-env twice")

    def _result(self, future: cf.Future, index: int, what: str) -> tuple[TensorDictBase, ...]:
        try:
            out = future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise TimeoutError(
                f"AsyncEnvPool: sub-env {index} did not finish a {what} within {self.timeout_s} s"
            ) from None
        return out if isinstance(out, tuple) else (out,)

    def _tag(self, out: TensorDictBase, index: int) -> TensorDictBase:
        """The pool's row of a sub-env's output: batch ``()`` and its ``env_index``."""
        row = out[0] if self._sub_dims else out
        row.set(self._env_idx_key, torch.tensor(index))
        return row

    def _stack(self, outs: list[TensorDictBase], indices: list[int]) -> TensorDictBase:
        rows = [self._tag(out, index) for out, index in zip(outs, indices)]
        return _STACKS[self.stack](rows) if rows else TensorDict(batch_size=[0])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for env in self.envs:
            close = getattr(env, "close", None)
            if close is not None:
                close()

    def __repr__(self) -> str:
        return f"AsyncEnvPool(num_envs={self.num_envs}, pending={len(self._pending) + len(self._per_env)})"


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
