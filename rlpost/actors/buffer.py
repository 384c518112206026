"""The ``buffer`` actor: a :class:`rlpost.transport.buffer.LocalBuffer` in a Ray actor, and its one
client, :class:`~rlpost.transport.buffer.RayBuffer` (what :func:`start_buffer` returns).

Threaded (``max_concurrency`` > 1), so a producer blocked in ``put`` by backpressure does not
stop the learner's ``take`` from freeing space. Ray does not restart it (``max_restarts=0``): the
supervisor starts a new one and the env pools put again what they kept, which an empty restart
cannot do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlpost.config import RoleResources
from rlpost.runtime.liveness import remote_class
from rlpost.runtime.placement import PLACEMENT_TIMEOUT_S, asks_of, wait_until_placed
from rlpost.transport.buffer import BufferMetrics, LocalBuffer, RayBuffer

if TYPE_CHECKING:
    from rlpost.config import JobConfig


@dataclass(frozen=True)
class BufferSettings:
    """What the buffer actor is given: its size, its staleness cap and its resources."""

    capacity: int
    max_staleness: int | None  # None: never drop a group for its age
    resources: RoleResources = field(default_factory=lambda: RoleResources(num_cpus=0.0))
    run_name: str = ""  # the run whose metrics it reports under

    @classmethod
    def from_job(cls, cfg: JobConfig) -> BufferSettings:
        return cls(buffer_capacity(cfg), staleness_cap(cfg), cfg.resources.buffer, cfg.logging.run_name or "")


def buffer_capacity(cfg: JobConfig) -> int:
    """Groups the buffer holds: one step in sync mode; in async mode ``max_staleness`` steps.
    A bigger buffer only ages groups past the cap (room for 3 steps with ``max_staleness: 1``: a
    600-step demo dropped 44% of its groups as stale); backpressure paces the producers instead."""
    steps_ahead = 1 if cfg.trainer.mode == "sync" else max(1, cfg.trainer.max_staleness)
    return cfg.trainer.prompts_per_step * steps_ahead


def staleness_cap(cfg: JobConfig) -> int:
    """Policy versions a group may lag behind the learner: 0 in sync mode."""
    return 0 if cfg.trainer.mode == "sync" else cfg.trainer.max_staleness


class RunBuffer(LocalBuffer):
    """The LocalBuffer the run's buffer actor holds. Trap: it imports the groups' type as it
    starts; otherwise the first put's unpickling imports it (``rlpost.data`` loads tensordict),
    which cost the first step of a tiny async run 1.5 s."""

    def __init__(self, **kwargs: Any):
        import rlpost.data.samples  # noqa: F401

        super().__init__(**kwargs)


def start_buffer(
    settings: BufferSettings, *, name: str = "buffer", namespace: str | None = None, max_concurrency: int = 16,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S, **options: Any,
) -> RayBuffer:  # fmt: skip
    """Start the named buffer actor, wait at most ``placement_timeout_s`` for its placement, and
    return its client."""
    import ray

    actor_options = {
        "name": name, "namespace": namespace, "max_concurrency": max_concurrency, "max_restarts": 0,
        "num_cpus": settings.resources.num_cpus, "num_gpus": settings.resources.num_gpus,
        "resources": dict(settings.resources.resources),
    } | options  # fmt: skip
    init = {"capacity": settings.capacity, "max_staleness": settings.max_staleness,
            "report": BufferMetrics(settings.run_name)}  # fmt: skip
    handle = remote_class(RunBuffer).options(**actor_options).remote(**init)
    try:
        wait_until_placed({name: (handle, asks_of(actor_options))}, placement_timeout_s, "the buffer")
    except BaseException:
        ray.kill(handle)
        raise
    return RayBuffer(handle, name)
