"""The service's actors (:class:`ServiceFleet`): one trainer holding the base model and every
client's adapter, and the inference workers that sample with those adapters.

A training run's fleet (:class:`rlpost.service.fleet.Fleet`) has a buffer, env pools and a
learner that trains one model; the service's has none of those and a trainer of many adapters,
so it is its own small object with the same duties: start everything (or nothing), start one
actor again in its place when it is lost, and stop everything. What to do after a restart (the
adapters put back, the gradients replayed) is :mod:`rlpost.serve.recovery`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlpost.config import ServeConfig

log = logging.getLogger("rlpost")

NAMESPACE = "rlpost-serve"
STARTUP_TIMEOUT_S = 600.0
NAME_RELEASE_TIMEOUT_S = 120.0  # a lost actor's name, held until Ray declares its node dead


class ServiceFleet:
    """The trainer and the inference workers; :meth:`start` waits until every engine serves."""

    def __init__(self, cfg: ServeConfig, base_model: str, name_prefix: str = ""):
        self.cfg, self.base_model, self.prefix = cfg, base_model, name_prefix
        self.trainer: Any = None
        self.inference: list[Any] = []
        self.restarts = {"trainer": 0, "inference": 0}

    @classmethod
    def start(cls, cfg: ServeConfig, base_model: str, *, name_prefix: str = "") -> ServiceFleet:
        """Start the actors for ``base_model`` (a resolved path or hub name) and wait for them.
        A start that fails leaves no actor."""
        import ray

        fleet = cls(cfg, base_model, name_prefix)
        try:
            fleet.trainer = fleet._start_trainer()
            fleet.inference = [fleet._start_inference(i) for i in range(cfg.inference_workers)]
            ready = [fleet.trainer.__ray_ready__.remote()] + [w.get_version.remote() for w in fleet.inference]
            ray.get(ready, timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            fleet.stop()
            raise
        log.info("serve: trainer and %d inference workers ready on %s", len(fleet.inference), Path(base_model).name)
        return fleet

    def _start_trainer(self) -> Any:
        from rlpost.actors.adapters import start_adapter_trainer

        res, cfg = self.cfg.resources, self.cfg
        return start_adapter_trainer(
            self.base_model, name=f"{self.prefix}trainer", resources=res.trainer,
            init_kwargs={"dtype": cfg.dtype, "max_rank": cfg.max_lora_rank, "max_batch_tokens": cfg.max_batch_tokens,
                         "threads": res.trainer.num_threads, "max_resident": cfg.adapters.trainer_resident,
                         "max_parked_in_memory": cfg.adapters.trainer_in_memory, "spill_dir": cfg.adapters.spill_dir},
        )  # fmt: skip

    def _start_inference(self, index: int) -> Any:
        from rlpost.actors.inference import start_worker_actor
        from rlpost.policies.lora import AdapterServing

        res, cfg = self.cfg.resources.inference, self.cfg
        custom = {"resources": res.resources} if res.resources else {}
        return start_worker_actor(
            self.base_model, cfg.engine, dtype=cfg.dtype, index=index,
            adapters=AdapterServing(max_rank=cfg.max_lora_rank, max_loras=cfg.loras_per_batch,
                                    in_memory=cfg.adapters.engine_in_memory, files=cfg.adapters.engine_files),
            options={"name": f"{self.prefix}inference-{index}", "num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                     **custom},
        )  # fmt: skip

    def restart_trainer(self) -> Any:
        """Kill the trainer (lost, or hung past its call's bound) and start a new one in its
        place, waiting until it has loaded the base model. Blocking: call it off the event loop."""
        import ray

        from rlpost.runtime.actors import release_names

        release_names([f"{self.prefix}trainer"], NAME_RELEASE_TIMEOUT_S)
        trainer = self._start_trainer()
        ray.get(trainer.__ray_ready__.remote(), timeout=STARTUP_TIMEOUT_S)
        self.trainer = trainer
        self.restarts["trainer"] += 1
        log.warning("serve: the trainer was lost; a new one serves (restart %d)", self.restarts["trainer"])
        return trainer

    def restart_inference(self, index: int) -> Any:
        """Kill ``inference-<index>`` and start a new one in its place, engine up. Blocking."""
        import ray

        from rlpost.runtime.actors import release_names

        release_names([f"{self.prefix}inference-{index}"], NAME_RELEASE_TIMEOUT_S)
        worker = self._start_inference(index)
        ray.get(worker.get_version.remote(), timeout=STARTUP_TIMEOUT_S)
        self.inference[index] = worker
        self.restarts["inference"] += 1
        log.warning("serve: inference-%d was lost; a new one serves (restart %d)", index, self.restarts["inference"])
        return worker

    def add_inference(self) -> Any:
        """Start the next inference worker (``inference-<len>``) and wait until its engine serves;
        it is in :attr:`inference` from then on. Blocking: call it off the event loop."""
        import ray

        worker = self._start_inference(len(self.inference))
        try:
            ray.get(worker.get_version.remote(), timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            ray.kill(worker)
            raise
        self.inference.append(worker)
        return worker

    def remove_last_inference(self) -> None:
        """Shut the last inference worker's engine down and end it (once nothing is sent to it any
        more: the service's to ensure). Blocking."""
        import ray

        worker = self.inference.pop()
        try:
            ray.get(worker.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 (a stuck or dead engine is killed below anyway)
            pass
        ray.kill(worker)

    def stop(self) -> None:
        """Shut the engines down and kill every actor (best effort, bounded)."""
        import ray

        for worker in self.inference:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            except Exception:  # a dead or stuck worker is killed below anyway
                pass
        for actor in [self.trainer, *self.inference]:
            if actor is None:
                continue
            try:
                ray.kill(actor)
            except Exception:
                pass
