"""RayMCAdvantage: an :class:`~rlpost.objectives.MCAdvantage` whose groups and counters live
in one Ray actor (TorchRL's ``torchrl.objectives.llm.RayMCAdvantage``).

Writers in several Ray actors or processes each hold a copy of the transform; every copy forwards
``inv`` to the same actor, so a prompt's trajectories from different writers complete one group.
A :class:`~rlpost.data.RayReplayBuffer` built with ``transform_factory=MCAdvantage`` does the same
with one actor less::

    mc = RayMCAdvantage(grpo_size=4, trajectory_return="sum", actor_name="grpo-groups")
    rb = ReplayBuffer(storage=LazyStackStorage(1024), transform=mc)
    ...
    mc.close()  # kills the actor (its creator's copy only)

The actor, :class:`MCAdvantageHost`, holds a plain MCAdvantage. With ``actor_name``, an actor of
that name in the current Ray namespace is reused (its settings must be this transform's), else
created.

Deliberate deviations from TorchRL:

- Every call into the actor is bounded by ``timeout_s`` (then a TimeoutError names the call),
  the constructor's wait for the actor too; the arguments are checked in the caller first (by
  building an MCAdvantage), so a bad one raises here, not in the actor.
- The transform that created the actor, named or not, owns it: its :meth:`close` kills it. One
  that found a named actor, or a copy sent to another process, only lets go. TorchRL never kills
  a named actor.
- The actor reserves no CPU unless ``remote_config`` says so (TorchRL: one CPU).
- Its keyword arguments are MCAdvantage's, rlpost's included; ``add`` is forwarded too.
- ``repr`` is local (no call into the actor).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensordict import TensorDictBase

from rlpost.objectives.grouping import GroupingTransform
from rlpost.objectives.mc_advantage import MCAdvantage
from rlpost.objectives.mc_advantage_state import MC_ADVANTAGE_STATS

DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 0}

# what identifies how an MCAdvantage groups, compared when a named actor is reused
_SETTINGS: tuple[str, ...] = (
    "grpo_size", "prompt_key", "rewards_key", "advantage_key", "done_key", "trajectory_return", "keep_return_bounds",
    "candidate_group_size", "candidate_selection_min_size", "scale", "eps", "filter_equal_rewards",
)  # fmt: skip


def _settings(transform: Any) -> dict[str, Any]:
    return {name: getattr(transform, name) for name in _SETTINGS}


class MCAdvantageHost:
    """The Ray actor behind :class:`RayMCAdvantage`: one MCAdvantage; each method is one call."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.transform = MCAdvantage(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.transform, method)(*args, **kwargs)

    def read(self, name: str) -> Any:
        return getattr(self.transform, name)

    def write(self, name: str, value: Any) -> None:
        setattr(self.transform, name, value)

    def queue_values(self) -> list[list[TensorDictBase]]:
        return self.transform.queues.values()

    def settings(self) -> dict[str, Any]:
        return _settings(self.transform)


class _Remote:
    """An attribute of the actor's MCAdvantage, read (and, if ``writable``, set) by a call."""

    def __init__(self, writable: bool = True) -> None:
        self.writable = writable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, transform: Any, owner: type | None = None) -> Any:
        if transform is None:
            return self
        return transform._ask(f"reading {self.name}", "read", self.name)

    def __set__(self, transform: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"RayMCAdvantage.{self.name} is read-only")
        transform._ask(f"setting {self.name}", "write", self.name, value)


class _RemoteQueues:
    """``transform.queues`` of a RayMCAdvantage: what can be asked of the actor's queues."""

    def __init__(self, transform: RayMCAdvantage) -> None:
        self._transform = transform

    def clear(self) -> None:
        self._transform._ask("queues.clear", "call", "clear_queues")

    def values(self) -> list[list[TensorDictBase]]:
        return self._transform._ask("queues.values", "queue_values")

    def __len__(self) -> int:
        return self._transform.queued_groups

    def __bool__(self) -> bool:
        return len(self) > 0


class RayMCAdvantage(GroupingTransform):
    """An MCAdvantage in a Ray actor (module docstring). The positional arguments and
    ``**mc_options`` are :class:`~rlpost.objectives.MCAdvantage`'s; ``ray_init_config``: ``ray.init``
    arguments when Ray is not initialized; ``remote_config``: the actor's Ray options.
    ``ValueError``: bad MCAdvantage arguments, or a reused named actor with other settings.
    """

    completed_trajectories = _Remote()
    completed_decisions = _Remote()
    trajectory_return_sum = _Remote()
    trajectory_return_max = _Remote()
    successful_trajectories = _Remote()
    completed_groups = _Remote()
    written_groups = _Remote()
    dropped_groups = _Remote()
    num_dropped_equal = _Remote()
    rescued_groups = _Remote()
    selected_trajectories = _Remote()
    unselected_trajectories = _Remote()
    queued_groups = _Remote(writable=False)
    queued_trajectories = _Remote(writable=False)
    max_queued_trajectories_per_group = _Remote(writable=False)
    num_pending = _Remote(writable=False)
    num_pending_groups = _Remote(writable=False)
    num_emitted_groups = _Remote(writable=False)

    def __init__(
        self,
        grpo_size: int,
        prompt_key: Any = None,
        rewards_key: Any = None,
        advantage_key: Any = "advantage",
        done_key: Any = ("next", "done"),
        verbose: bool = False,
        *,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        actor_name: str | None = None,
        timeout_s: float = 300.0,
        **mc_options: Any,
    ) -> None:
        import ray

        args = (grpo_size, prompt_key, rewards_key, advantage_key, done_key, verbose)
        local = MCAdvantage(*args, **mc_options)  # checks the arguments here, in the caller
        for name in (*_SETTINGS, "verbose", "candidate_selector", "in_keys", "out_keys"):
            setattr(self, name, getattr(local, name))
        self.actor_name = actor_name
        self.timeout_s = timeout_s
        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        options = dict(DEFAULT_REMOTE_CONFIG if remote_config is None else remote_config)
        host = ray.remote(MCAdvantageHost)
        if actor_name is None:
            self._actor, self._owner = host.options(**options).remote(args, mc_options), True
        else:
            self._actor, self._owner = _named_actor(ray, host, actor_name, options, args, mc_options)
        theirs = self._ask("starting the actor", "settings")
        if theirs != _settings(self):
            raise ValueError(
                f"RayMCAdvantage: the actor named {actor_name!r} groups with {theirs}, not {_settings(self)}"
            )

    # ------------------------------------------------------------------ calls into the actor

    def _ask(self, what: str, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``actor.method(*args, **kwargs)``, bounded by ``timeout_s`` (the transform's by default)."""
        import ray

        if self._actor is None:
            raise RuntimeError(f"RayMCAdvantage: {what} after close()")
        bound = self.timeout_s if timeout_s is None else timeout_s
        ref = getattr(self._actor, method).remote(*args, **kwargs)
        try:
            return ray.get(ref, timeout=bound)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"RayMCAdvantage: {what} did not return within {bound:g} s") from None

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``transform.method(*args, **kwargs)`` on the actor's MCAdvantage, within ``timeout_s``."""
        return self._ask(method, "call", method, *args, timeout_s=timeout_s, **kwargs)

    def inv(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """MCAdvantage's write path, in the actor (accelerator data travels on the CPU)."""
        device = getattr(tensordict, "device", None)
        away = device is not None and device.type != "cpu"
        result = self.call("inv", tensordict.to("cpu") if away else tensordict)
        return result.to(device) if away and result is not None else result

    def add(self, samples: Iterable[Any]) -> list[list[Any]]:
        """MCAdvantage's flat records way in, in the actor."""
        return self.call("add", list(samples))

    def reset_stats(self) -> None:
        """Zero the actor's counters (its queues are kept)."""
        self.call("reset_stats")

    def clear_queues(self) -> None:
        """Forget the actor's incomplete groups (its counters are kept)."""
        self.call("clear_queues")

    def get_stats(self) -> dict[str, float | int]:
        """The actor's counters and queue sizes, read in one call."""
        return self.call("get_stats")

    @property
    def queues(self) -> _RemoteQueues:
        """The actor's queues: ``values()``, ``clear()``, ``len`` and truth."""
        return _RemoteQueues(self)

    @property
    def is_shared(self) -> bool:
        """Always: the state is the actor's."""
        return True

    def share_memory_(self) -> RayMCAdvantage:
        """Nothing to do: the state is already shared (in the actor)."""
        return self

    def close(self) -> None:
        """Kill the actor if this transform created it; in any case stop using it."""
        import ray

        actor, self._actor = self._actor, None
        if actor is not None and self._owner:
            ray.kill(actor)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_owner"] = False  # a copy forwards calls; only the creator's close() kills the actor
        return state

    def __repr__(self) -> str:
        name = f", actor_name={self.actor_name!r}" if self.actor_name is not None else ""
        closed = ", closed" if self._actor is None else ""
        return (
            f"RayMCAdvantage(grpo_size={self.grpo_size}, prompt_key={self.prompt_key!r}, "
            f"trajectory_return={self.trajectory_return!r}{name}{closed})"
        )


def _named_actor(
    ray: Any, host: Any, name: str, options: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, bool]:
    """The actor called ``name`` and whether this call created it."""
    try:
        return ray.get_actor(name), False
    except ValueError:
        pass
    try:
        return host.options(name=name, **options).remote(args, kwargs), True
    except ValueError:  # another process created it between the two calls
        return ray.get_actor(name), False


assert set(MC_ADVANTAGE_STATS) <= set(vars(RayMCAdvantage)), "every MCAdvantage counter is readable on RayMCAdvantage"
