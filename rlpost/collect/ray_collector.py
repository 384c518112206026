"""RayLLMCollector: an :class:`~rlpost.collect.LLMCollector` in a Ray actor (TorchRL's).

The object stays in the caller's process and forwards each call to the actor
(``self._collector``, TorchRL's attribute), which builds the env and the policy where it runs::

    rb = RayReplayBuffer(storage=partial(LazyStackStorage, 64), transform_factory=partial(MCAdvantage, grpo_size=4))
    collector = RayLLMCollector(env=make_env, policy=policy, dialog_turns_per_batch=8,
                                replay_buffer=rb, track_policy_version=True)
    collector.start()                   # collects into rb on the actor until shut down
    ... rb.sample() ...; sender.update_weights(); collector.increment_version()
    collector.async_shutdown()

Iterating it collects one batch per step on the actor (ahead by one with ``sync_iter=False``).
Deviations from TorchRL: every call is bounded by ``timeout_s`` (TimeoutError naming the call; a
dead actor raises Ray's ``RayActorError``); properties are plain reads of the collector's state
(TorchRL's ``total_dialog_turns`` calls a remote property and fails).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from rlpost.collect.llm_collector import LLMCollector
from rlpost.runtime.placement import PLACEMENT_TIMEOUT_S, asks_of, wait_until_placed

# it mostly waits on its env and the inference workers: no CPU of its own
DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0}


class RayLLMCollector(LLMCollector):
    """An LLMCollector in a Ray actor; see the module docstring.

    Args:
        env: an env constructor (built in the actor) or an env (pickled to it).

    Keyword Args:
        the collector's arguments: as :class:`~rlpost.collect.LLMCollector` (the replay buffer
            is usually a :class:`~rlpost.data.RayReplayBuffer`, which the actor writes directly).
        ray_init_config: ``ray.init`` arguments when Ray is not initialized yet.
        remote_config: Ray actor options (default: no CPU, no GPU); num_cpus, num_gpus: shorthands.
        sync_iter: iterate in lock-step, or let the actor collect ahead by one batch.
        timeout_s, placement_timeout_s: rlpost's bounds of each call and of the actor's placement
            (:mod:`rlpost.runtime.placement`).
    """

    def __init__(
        self,
        env: Any,
        *,
        policy: Callable | None = None,
        policy_factory: Callable[[], Callable] | None = None,
        dialog_turns_per_batch: int | None = None,
        total_dialog_turns: int = -1,
        yield_only_last_steps: bool | None = None,
        yield_completed_trajectories: bool | None = None,
        postproc: Callable | None = None,
        async_envs: bool | None = None,
        replay_buffer: Any = None,
        reset_at_each_iter: bool = False,
        flatten_data: bool | None = None,
        weight_updater: Any = None,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        track_policy_version: Any = False,
        whole_episodes: Any = False,
        sync_iter: bool = True,
        verbose: bool = False,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        timeout_s: float = 600.0,
        placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        options = dict(DEFAULT_REMOTE_CONFIG if remote_config is None else remote_config)
        if num_cpus is not None:
            options["num_cpus"] = num_cpus
        if num_gpus is not None:
            options["num_gpus"] = num_gpus
        if not sync_iter:  # the next batch is collected while the caller asks about the last one
            options.setdefault("max_concurrency", 2)
        self.sync_iter, self.timeout_s = sync_iter, timeout_s
        self._collector = LLMCollector.as_remote(options).remote(
            env,
            policy=policy,
            policy_factory=policy_factory,
            dialog_turns_per_batch=dialog_turns_per_batch,
            total_dialog_turns=total_dialog_turns,
            yield_only_last_steps=yield_only_last_steps,
            yield_completed_trajectories=yield_completed_trajectories,
            postproc=postproc,
            async_envs=async_envs,
            replay_buffer=replay_buffer,
            reset_at_each_iter=reset_at_each_iter,
            flatten_data=flatten_data,
            weight_updater=weight_updater,
            track_policy_version=track_policy_version,
            whole_episodes=whole_episodes,
            verbose=verbose,
        )
        try:
            wait_until_placed({"its collector actor": (self._collector, asks_of(options))}, placement_timeout_s,
                              "RayLLMCollector")  # fmt: skip
        except BaseException:
            ray.kill(self._collector)
            raise

    def _get(self, call: str, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"RayLLMCollector: {call} did not return within {self.timeout_s:.0f} s") from None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._get(method, getattr(self._collector, method).remote(*args, **kwargs))

    # ------------------------------------------------------------------ iteration

    def next(self) -> Any:
        """The actor collects one batch (written to the replay buffer: returns None)."""
        return self._call("next")

    def __iter__(self) -> Iterator[Any]:
        ahead = None if self.sync_iter else self._collector.next.remote()
        while True:
            try:
                if ahead is None:
                    yield self.next()
                else:
                    result = self._get("next", ahead)
                    ahead = self._collector.next.remote()
                    yield result
            except StopIteration:
                return

    # ------------------------------------------------------------------ lifecycle

    def is_initialized(self) -> bool:
        return self._call("is_initialized")

    def start(self) -> None:
        self._call("start")

    def is_running(self) -> bool:
        return self._call("is_running")

    def collection_failure(self) -> str | None:
        """What ended the actor's background collection (None while it runs or after a clean end)."""
        return self._get("collection_failure", self._collector.__ray_call__.remote(_collection_failure))

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        self._call("async_shutdown", timeout=timeout, close_env=close_env)

    def shutdown(self) -> None:
        """Stop collecting, close the env and end the actor."""
        import ray

        try:
            self._call("async_shutdown", timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            pass  # already gone
        finally:  # ended even when its collection did not stop in time (the TimeoutError then says so)
            ray.kill(self._collector, no_restart=True)

    # ------------------------------------------------------------------ weights and versions

    def update_policy_weights_(self, policy_weights: Any = None, **kwargs: Any) -> None:
        self._call("update_policy_weights_", policy_weights, **kwargs)

    def increment_version(self) -> None:
        self._call("increment_version")

    @property
    def policy_version(self) -> int | str | None:
        return self._call("get_policy_version")

    def get_policy_version(self) -> int | str | None:
        return self._call("get_policy_version")

    def set_weight_updater(self, weight_updater: Any) -> bool:
        return self._call("set_weight_updater", weight_updater)

    def set_postproc(self, postproc: Callable) -> None:
        self._call("set_postproc", postproc)

    @property
    def dialog_turns_per_batch(self) -> int:
        return self._get("dialog_turns_per_batch", self._collector.__ray_call__.remote(_read, "dialog_turns_per_batch"))

    @property
    def total_dialog_turns(self) -> int:
        return self._get("total_dialog_turns", self._collector.__ray_call__.remote(_read, "total_dialog_turns"))

    def __repr__(self) -> str:
        return f"RayLLMCollector(actor={self._collector}, sync_iter={self.sync_iter})"


def _read(collector: LLMCollector, name: str) -> Any:
    return getattr(collector, name)


def _collection_failure(collector: LLMCollector) -> str | None:
    error = collector.collection_error
    return None if error is None else f"{type(error).__name__}: {error}"
