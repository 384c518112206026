"""LLMCollector: run an env with an LLM policy and yield batches of dialog turns (TorchRL's).

The loop, per batch (``dialog_turns_per_batch`` turns; one turn is one env row's step)::

    td = env.reset()                      (first batch, or every batch with reset_at_each_iter)
    repeat:  td = policy(td)              the LLM answers every row
             step, td = env.step_and_maybe_reset(td)
             keep `step` (it holds the turn and its "next"); rows that are done restart
    yield the kept steps stacked along a last dim ([B, T]; [B*T] with flatten_data)

With ``yield_completed_trajectories=True`` the collector yields one finished trajectory at a
time (its ``T`` steps, batch ``[T]``), and with ``yield_only_last_steps=True`` only each
trajectory's last step (batch ``[1]``). Every step carries ``("collector", "traj_ids")``: the id of the trajectory the row
is in (a row gets a new id after it is done). With ``replay_buffer=`` (or ``queue=``) the
batches are written there (``extend``/``put``) and the iterator yields None.

Weights and versions: ``weight_updater`` (an object, or a constructor) pushes a trainer's
weights to where the policy runs when :meth:`update_policy_weights_` is called;
``track_policy_version=True`` (or a :class:`~rlpost.envs.llm_transforms.PolicyVersion`) adds a
PolicyVersion transform to the env, so each step records the version that produced it, and
:meth:`increment_version` bumps it.

With an :class:`~rlpost.envs.AsyncEnvPool` (``async_envs=True``, or detected) and
``yield_completed_trajectories``, the policy answers the rows whose step came back while the
others still run, and trajectories come out as they finish.

:meth:`start` collects into the replay buffer on a thread of its own until ``total_dialog_turns``
or :meth:`async_shutdown`; :meth:`is_running` says whether it still does. A collection that fails
on that thread is logged with its traceback and kept in :attr:`collection_error`.
:class:`~rlpost.collect.RayLLMCollector` runs the collector in a Ray actor.

Deliberate deviations from TorchRL: the collector is a plain iterable, not a
``SyncDataCollector``; ``as_remote`` returns a Ray actor class of the collector; a background
collection that fails is logged and kept (TorchRL's thread dies silently).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase, lazy_stack

logger = logging.getLogger(__name__)

TRAJ_IDS = ("collector", "traj_ids")


class _QueueAsBuffer:
    """A queue (anything with ``put``) seen as a buffer: ``extend(batch)`` puts the batch."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def extend(self, data: TensorDictBase) -> None:
        self.queue.put(data)


class LLMCollector:
    """Collects dialog turns from ``env`` with ``policy`` (see the module docstring).

    Args:
        env: an env, or a callable that builds one.

    Keyword Args:
        policy: a callable td -> td (an LLM wrapper); or ``policy_factory``, a callable that
            builds it (exclusive).
        dialog_turns_per_batch: turns per yielded batch (env rows x steps).
        total_dialog_turns: turns over the collector's life; -1 for no end.
        yield_completed_trajectories: yield finished trajectories one at a time.
        yield_only_last_steps: yield only the last step of each finished trajectory.
        postproc: applied to each batch before it is yielded or written.
        async_envs: the env is an AsyncEnvPool (detected when it is one).
        replay_buffer: write batches with ``replay_buffer.extend`` instead of yielding them.
        queue: write batches with ``queue.put`` (exclusive with ``replay_buffer``).
        reset_at_each_iter: reset the env at the start of every batch.
        flatten_data: ``[B*T]`` batches instead of ``[B, T]``; default True with a buffer.
        weight_updater: pushes weights for :meth:`update_policy_weights_`; an object with
            ``push_weights(weights)``, or a class/constructor building one.
        track_policy_version: True, or a PolicyVersion transform to use.
        verbose: log progress.
    """

    def __init__(
        self,
        env: Any,
        *,
        policy: Callable[[TensorDictBase], TensorDictBase] | None = None,
        policy_factory: Callable[[], Callable[[TensorDictBase], TensorDictBase]] | None = None,
        dialog_turns_per_batch: int,
        yield_only_last_steps: bool | None = None,
        yield_completed_trajectories: bool | None = None,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        total_dialog_turns: int = -1,
        async_envs: bool | None = None,
        replay_buffer: Any = None,
        reset_at_each_iter: bool = False,
        flatten_data: bool | None = None,
        weight_updater: Any = None,
        queue: Any = None,
        track_policy_version: Any = False,
        verbose: bool = False,
    ) -> None:
        if queue is not None and replay_buffer is not None:
            raise RuntimeError("Handling both a buffer and a queue is not possible at the moment.")
        if queue is not None:
            replay_buffer = _QueueAsBuffer(queue)
        if (policy is None) == (policy_factory is None):
            raise TypeError("LLMCollector needs exactly one of policy= and policy_factory=")
        if dialog_turns_per_batch < 1:
            raise ValueError(f"dialog_turns_per_batch must be >= 1, got {dialog_turns_per_batch}")
        if yield_only_last_steps is None:
            yield_only_last_steps = False
        if yield_completed_trajectories is None:
            yield_completed_trajectories = yield_only_last_steps
        elif yield_only_last_steps and not yield_completed_trajectories:
            raise TypeError("yield_only_last_steps=True requires yield_completed_trajectories=True (or None)")
        if yield_only_last_steps and flatten_data is not None:
            raise TypeError("`yield_only_last_steps` cannot be `True` when `flatten_data` is passed.")
        if yield_only_last_steps and reset_at_each_iter:
            raise TypeError("`yield_only_last_steps` cannot be `True` when `reset_at_each_iter=True`.")
        self.env = env() if callable(env) and not hasattr(env, "reset") else env
        from rlpost.envs.async_pool import AsyncEnvPool

        self.async_envs = bool(async_envs) or isinstance(self.env, AsyncEnvPool)
        if self.async_envs and not isinstance(self.env, AsyncEnvPool):
            raise RuntimeError("async_envs requires the environment to be an AsyncEnvPool instance.")
        if self.async_envs and track_policy_version is True:
            raise RuntimeError(
                "AsyncEnvPool is not supported for policy version tracking. Please add the PolicyVersion transform to "
                "the environment manually, and pass that transform to the collector."
            )
        if yield_completed_trajectories and len(self.env.batch_size) != 1:
            raise ValueError(
                "`yield_only_last_steps` only works with envs that have a single batch dimension. Got "
                f"env.batch_size={self.env.batch_size}."
            )
        self.policy = policy if policy is not None else policy_factory()
        if hasattr(self.policy, "register_collector"):
            self.policy.register_collector(self)
        self.requested_frames_per_batch = int(dialog_turns_per_batch)
        self.total_frames = int(total_dialog_turns)
        self.yield_completed_trajectories = yield_completed_trajectories
        self.yield_only_last_steps = yield_only_last_steps
        self.postproc, self.replay_buffer = postproc, replay_buffer
        self.reset_at_each_iter, self.verbose = reset_at_each_iter, verbose
        self.flatten_data = replay_buffer is not None if flatten_data is None else flatten_data
        self.weight_updater = None
        if weight_updater is not None:
            self.set_weight_updater(weight_updater)
        self.policy_version_tracker = self._add_version_tracker(track_policy_version)
        self.env.collector = self  # transforms such as RetrieveKL("from_collector") find the policy here
        self._shuttle: TensorDictBase | None = None
        self._next_traj_id = 0
        self._frames = 0
        self._yield_queues: list[deque] = []
        self._trajectory_queue: deque = deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.collection_error: BaseException | None = None  # what ended a start()ed collection

    def _add_version_tracker(self, track: Any) -> Any:
        from rlpost.envs.llm_transforms import PolicyVersion

        if track is False or track is None:
            return None
        tracker = PolicyVersion() if track is True else track
        if not isinstance(tracker, PolicyVersion):
            raise TypeError(f"track_policy_version must be a bool or a PolicyVersion, got {type(track).__name__}")
        if not self.async_envs:  # a pool's sub-envs carry the transform themselves
            self.env = self.env.append_transform(tracker)
        return tracker

    # ------------------------------------------------------------------ properties (TorchRL's names)

    @property
    def dialog_turns_per_batch(self) -> int:
        return self.requested_frames_per_batch

    @property
    def total_dialog_turns(self) -> int:
        return self.total_frames

    @property
    def policy_version(self) -> int | str | None:
        """The tracked policy version (None without tracking)."""
        return None if self.policy_version_tracker is None else self.policy_version_tracker.version

    def get_policy_version(self) -> int | str | None:
        """:attr:`policy_version` as a method (Ray actors cannot read properties)."""
        return self.policy_version

    def increment_version(self) -> None:
        """Bump the tracked version (after a weight update)."""
        if self.policy_version_tracker is None:
            return
        self.policy_version_tracker.increment_version()

    def get_policy_model(self) -> Any:
        """The model (or engine) behind the policy, for weight updaters."""
        return getattr(self.policy, "model", None)

    def is_initialized(self) -> bool:
        return self.env is not None and self.policy is not None

    def set_weight_updater(self, weight_updater: Any) -> bool:
        """Use ``weight_updater``: an object with ``push_weights``, or a class / constructor
        (any other callable), called once with no argument to build it."""
        if isinstance(weight_updater, type) or not hasattr(weight_updater, "push_weights"):
            if not callable(weight_updater):
                raise TypeError(
                    f"weight_updater must have push_weights or be a constructor, got {type(weight_updater).__name__}"
                )
            weight_updater = weight_updater()
            if isinstance(weight_updater, type) or not hasattr(weight_updater, "push_weights"):
                raise TypeError(
                    f"the weight_updater constructor returned {type(weight_updater).__name__}, which has no push_weights"
                )
        if hasattr(weight_updater, "register_collector"):
            weight_updater.register_collector(self)
        self.weight_updater = weight_updater
        return True

    def set_postproc(self, postproc: Callable[[TensorDictBase], TensorDictBase]) -> None:
        if self.postproc is not None:
            raise RuntimeError("Postproc already set")
        self.postproc = postproc

    def update_policy_weights_(self, policy_weights: Any = None, **kwargs: Any) -> None:
        """Push ``policy_weights`` with the weight updater, then bump the tracked version."""
        if self.weight_updater is None:
            raise RuntimeError(
                "update_policy_weights_ needs a weight_updater (pass weight_updater= or set_weight_updater)"
            )
        self.weight_updater.push_weights(policy_weights, **kwargs)
        self.increment_version()

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        while self.total_frames < 0 or self._frames < self.total_frames:
            batch = self.rollout()
            self._frames += batch.numel()
            if self.postproc is not None:
                batch = self.postproc(batch)
            if self.replay_buffer is not None:
                self.replay_buffer.extend(batch)
                yield None
            else:
                yield batch

    def next(self) -> TensorDictBase | None:
        """One batch (TorchRL's ``collector.next()``)."""
        return next(iter(self))

    @property
    def rollout(self) -> Callable[[], TensorDictBase]:
        if not self.yield_completed_trajectories:
            return self._rollout_all
        return self._rollout_trajectories_async if self.async_envs else self._rollout_trajectories

    def _start(self) -> TensorDictBase:
        td = self.env.reset()
        num_envs = td.batch_size[0]
        td.set(TRAJ_IDS, torch.arange(self._next_traj_id, self._next_traj_id + num_envs))
        self._next_traj_id += num_envs
        return td

    def _step(self, td: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """One turn of every row: the step (with ``next``) and the next step's input."""
        td = self.policy(td)
        step, next_input = self.env.step_and_maybe_reset(td)
        next_input.set(TRAJ_IDS, self._next_traj_ids(step))
        return step, next_input

    def _next_traj_ids(self, step: TensorDictBase) -> torch.Tensor:
        """The trajectory ids of a step's rows for the next step: a new id where it was done."""
        traj_ids = step.get(TRAJ_IDS).clone()
        done = step.get(("next", "done")).reshape(-1)
        for row in done.nonzero().flatten().tolist():
            traj_ids[row] = self._next_traj_id
            self._next_traj_id += 1
        return traj_ids

    def _rollout_all(self) -> TensorDictBase:
        if self.reset_at_each_iter or self._shuttle is None:
            self._shuttle = self._start()
        steps, collected = [], 0
        while collected < self.dialog_turns_per_batch:
            if self.verbose:
                logger.info("LLMCollector: %d of %d turns collected", collected, self.dialog_turns_per_batch)
            step, self._shuttle = self._step(self._shuttle)
            steps.append(step.clone(recurse=False))
            collected += step.numel()
        batch = lazy_stack(steps, -1)
        return batch.view(-1) if self.flatten_data else batch

    def _rollout_trajectories(self) -> TensorDictBase:
        if self._shuttle is None:
            self._shuttle = self._start()
            self._yield_queues = [deque() for _ in range(self.env.batch_size[0])]
        while not self._trajectory_queue:
            step, self._shuttle = self._step(self._shuttle)
            done = step.get(("next", "done")).reshape(-1).tolist()
            for row, (data, queue) in enumerate(zip(step.unbind(0), self._yield_queues)):
                queue.append(data)
                if done[row]:
                    steps = [queue[-1]] if self.yield_only_last_steps else list(queue)
                    self._trajectory_queue.append(lazy_stack(steps, -1))
                    queue.clear()
        return self._pop_trajectory()

    def _rollout_trajectories_async(self) -> TensorDictBase:
        """Completed trajectories from an AsyncEnvPool: the policy answers the rows that are back
        while the others still step."""
        key = self.env._env_idx_key
        if self._shuttle is None:
            self._shuttle = self._start()
            self._yield_queues = [deque() for _ in range(self.env.batch_size[0])]
            self.env.async_step_and_maybe_reset_send(self.policy(self._shuttle))
        while not self._trajectory_queue:
            step, next_input = self.env.async_step_and_maybe_reset_recv()
            next_input.set(TRAJ_IDS, self._next_traj_ids(step))
            done = step.get(("next", "done")).reshape(-1).tolist()
            for row, (index, data) in enumerate(zip(step.get(key).tolist(), step.unbind(0))):
                queue = self._yield_queues[index]
                queue.append(data)
                if done[row]:
                    self._trajectory_queue.append(
                        lazy_stack([queue[-1]] if self.yield_only_last_steps else list(queue), -1)
                    )
                    queue.clear()
            self._shuttle = next_input
            self.env.async_step_and_maybe_reset_send(self.policy(next_input))
        return self._pop_trajectory()

    def _pop_trajectory(self) -> TensorDictBase:
        trajectory = self._trajectory_queue.popleft()
        if self.verbose:
            logger.info("LLMCollector: yielding a completed trajectory of shape %s", tuple(trajectory.shape))
        return trajectory

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Collect into the replay buffer on a background thread (TorchRL's ``start``) until
        ``total_dialog_turns`` are collected or :meth:`async_shutdown` is called; a no-op while
        it runs."""
        if self.replay_buffer is None:
            raise RuntimeError("Replay buffer must be defined for execution.")
        if self.is_running():
            return
        self._stop.clear()
        self.collection_error = None
        self._thread = threading.Thread(target=self._run_in_background, name="llm-collector", daemon=True)
        self._thread.start()

    def _run_in_background(self) -> None:
        try:
            for _ in self:
                if self._stop.is_set():
                    return
        except BaseException as err:  # kept for whoever asks, and logged: a thread's error is otherwise lost
            self.collection_error = err
            logger.exception("LLMCollector: the background collection failed")

    def is_running(self) -> bool:
        """Whether the collection :meth:`start` began still runs."""
        return self._thread is not None and self._thread.is_alive()

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Stop the collection :meth:`start` began after its current batch (waiting up to
        ``timeout`` seconds for it), then :meth:`shutdown`."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if close_env:
            self.shutdown()

    def shutdown(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()

    @classmethod
    def as_remote(cls, remote_config: dict[str, Any] | None = None, **remote_options: Any) -> Any:
        """The collector as a Ray actor class: ``LLMCollector.as_remote({"num_cpus": 1})`` (TorchRL's
        form) or ``LLMCollector.as_remote(num_cpus=1)``, then ``.remote(env, ...)``."""
        import ray

        options = {**(remote_config or {}), **remote_options}
        return ray.remote(**options)(cls) if options else ray.remote(cls)

    def __repr__(self) -> str:
        return (
            f"LLMCollector(dialog_turns_per_batch={self.dialog_turns_per_batch}, total_dialog_turns={self.total_dialog_turns}, "
            f"yield_completed_trajectories={self.yield_completed_trajectories})"
        )
