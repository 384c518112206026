"""The run's roles, one module each (the learner a package: rlpost.actors.learner): buffer,
inference, learner, reference, reward, env_pool.

Each role holds ``<Role>Settings`` (the job config sections it reads, and nothing else:
``<Role>Settings.from_job(cfg)``), a plain class (usable without Ray) taking them, a thin Ray actor
forwarding to it, and ``start_<role>(settings, ...)``, the one way its actor is started (by the
supervisor and the tests alike).
"""

from __future__ import annotations

from typing import Any

REWARD_ACTOR = "reward"  # the reward model's actor (reward_model), which the env pools find by name


def learner_name(rank: int) -> str:
    """The actor name of a learner rank: ``learner`` (rank 0, the operators' handle), ``learner-<r>``."""
    return "learner" if rank == 0 else f"learner-{rank}"


def start_actor(actor_class: type, *args: Any, name: str, resources: Any, namespace: str | None = None,
                init_kwargs: dict[str, Any] | None = None, **options: Any) -> Any:  # fmt: skip
    """Start ``actor_class(*args, **init_kwargs)`` as the Ray actor ``name`` with the CPUs and
    GPUs of ``resources`` (``options`` go to ``.options()`` and win), answering the watchdog's
    heartbeat (:func:`rlpost.runtime.liveness.remote_class`)."""
    from rlpost.runtime.liveness import remote_class

    chosen = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus} | options
    remote = remote_class(actor_class).options(name=name, namespace=namespace, **chosen)
    return remote.remote(*args, **(init_kwargs or {}))
