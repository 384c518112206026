"""The learner's Ray actor: :class:`LearnerActor` (the plain
:class:`~rlpost.actors.learner.core.Learner` plus a process's memory and threads, metrics, the
group's rendezvous and the weight bus), :func:`start_learner` and :func:`start_learner_group`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlpost.actors import learner_name, sharding, start_actor
from rlpost.actors.learner.core import Learner
from rlpost.actors.learner.memory import release_freed_memory, return_freed_memory_to_os, set_torch_threads
from rlpost.actors.learner.settings import LearnerSettings
from rlpost.data.samples import Group

# forming a learner group waits this long beyond the group's timeout: every rank loads the model first
_MODEL_LOAD_GRACE_S = 600.0


class LearnerActor(Learner):
    """The Ray actor ``learner``. Alone it builds its model at once; as a group's rank, in
    :meth:`join_group` (after rank 0's :meth:`open_rendezvous`: the process group must exist first).
    """

    def __init__(self, cfg: LearnerSettings, rank: int = 0, world_size: int = 1):
        from rlpost.record.metrics import RoleMetrics

        if release_freed_memory(cfg.resources, world_size):
            return_freed_memory_to_os()  # before the model's first allocation
        set_torch_threads(cfg.resources.num_threads)
        self.cfg, self.rank, self.world_size, self.publisher = cfg, rank, world_size, None
        self._store = None  # rank 0 of a group: the group's TCPStore, kept alive with the actor
        self.metrics = RoleMetrics("learner", cfg.run_name, learner_name(rank))
        if world_size == 1:
            Learner.__init__(self, cfg)

    def open_rendezvous(self, backend: str | None = None, timeout_s: float = 300.0) -> sharding.GroupSpec:
        """Rank 0: host the group's store; returns the spec every rank joins with."""
        if self.rank != 0:
            raise RuntimeError(f"{learner_name(self.rank)}: only rank 0 opens the learner group's rendezvous")
        self._store, spec = sharding.open_rendezvous(self.world_size, backend=backend, timeout_s=timeout_s)
        return spec

    def join_group(self, spec: sharding.GroupSpec) -> int:
        """Join the learner group and build this rank's sharded Learner (returns, with the rank,
        once every rank joined and sharded)."""
        sharding.join_group(spec, self.rank, store=self._store)
        Learner.__init__(self, self.cfg, sharded=True)
        return self.rank

    def memory(self) -> dict[str, float]:
        """What this rank holds: ``state_bytes`` (parameters, AdamW state, gradients: its shards
        in a group), ``peak_rss_bytes`` and, on a GPU, ``peak_gpu_bytes``."""
        import resource

        out = {
            "state_bytes": float(sharding.local_state_bytes(self.model, self.optimizer)),
            "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        }
        if torch.cuda.is_available():
            out["peak_gpu_bytes"] = float(torch.cuda.max_memory_allocated())
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's float32 weights on the CPU (a collective in a group: every rank calls it)."""
        return {name: sharding.full_tensor(t.detach()).float().cpu() for name, t in self.model.state_dict().items()}

    def connect_workers(self, workers: list, host: str, backend: str, bucket_mb: float, timeout_s: float,
                        shared_memory: bool = True) -> int:  # fmt: skip
        """Form the weight bus with these inference workers: a :class:`~rlpost.collect.vLLMUpdater`
        here becomes the publisher; returns the version the workers serve."""
        from rlpost.collect.weight_update import vLLMUpdater

        if self.publisher is not None:
            self.publisher.close()
        updater = vLLMUpdater(workers, master_address=host, backend=backend, device=self.device, bucket_mb=bucket_mb,
                              timeout_s=timeout_s, shared_memory=shared_memory)  # fmt: skip
        updater.init()
        self.publisher = updater
        if self.cfg.model.lora is not None:
            self.choose_sync_mode(updater.workers_serve_lora())
        return updater.version

    def set_workers(self, workers: list) -> int:
        """After a worker was restarted: the bus's next generation with ``workers``; returns it."""
        return self.publisher.set_workers(workers)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        metrics = super().train_step(groups)
        keys = ("loss", "kl_to_ref", "clip_fraction", "step_time_s", "policy_version", "staleness_mean")
        self.metrics.record(**{k: metrics[k] for k in keys if k in metrics})
        return metrics

    def publish(self, wait: bool = True) -> dict[str, float]:
        stats = super().publish(wait)
        self.metrics.record(weight_sync_s=stats["weight_sync_s"])
        return stats

    def policy_version(self) -> int:
        """:attr:`Learner.version` as a call (an actor's callers cannot read its properties)."""
        return self.version

    def num_threads(self) -> int:
        """torch threads this actor trains with (``resources.learner.num_threads``)."""
        return torch.get_num_threads()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        sharding.leave_group()


def start_learner(settings: LearnerSettings, *, name: str = "learner", namespace: str | None = None, **options):
    """Start the named learner actor (``options`` go to ``.options()``)."""
    return start_actor(LearnerActor, settings, name=name, resources=settings.resources, namespace=namespace,
                       **options)  # fmt: skip


def start_learner_group(settings: LearnerSettings, num_workers: int, *, namespace: str | None = None,
                        timeout_s: float | None = None, backend: str | None = None,
                        options_for: Callable[[int], dict] | None = None) -> list:  # fmt: skip
    """Start ``num_workers`` learner ranks (``learner``, ``learner-1``, ...) that shard one model
    with FSDP2 (:mod:`rlpost.actors.sharding`); their handles in rank order once every rank joined
    and sharded. ``options_for(rank)``: each rank's ``.options()``. ``timeout_s`` (default
    ``resources.learner.timeout_s``) bounds forming the group (+ the model load) and every
    collective; if forming fails, every rank started is killed and the error raised.
    """
    import ray

    from rlpost.actors.calls import Pending, wait_all

    options_for = options_for or (lambda rank: {})
    timeout_s = settings.resources.timeout_s if timeout_s is None else timeout_s
    if num_workers < 1:
        raise ValueError(f"resources.learner.num_workers must be >= 1, got {num_workers}")
    if num_workers == 1:
        return [start_learner(settings, namespace=namespace, **options_for(0))]
    handles = [
        start_actor(LearnerActor, settings, rank, num_workers, name=learner_name(rank), resources=settings.resources,
                    namespace=namespace, **options_for(rank))
        for rank in range(num_workers)
    ]  # fmt: skip
    try:
        spec = Pending("learner", "open_rendezvous", handles[0].open_rendezvous.remote(backend, timeout_s))
        spec = spec.result(timeout_s, stoppable=True)  # a stop signal ends a start that loads models
        joins = [Pending(learner_name(r), "join_group", h.join_group.remote(spec)) for r, h in enumerate(handles)]
        wait_all(joins, timeout_s + _MODEL_LOAD_GRACE_S, stoppable=True)
    except BaseException:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        raise
    return handles
