"""The service's actors (:class:`ServiceFleet`): one trainer holding the base model and every
client's adapter, and the inference workers that sample with those adapters.

A training run's fleet (:class:`rlpost.service.fleet.Fleet`) has a buffer, env pools and a
learner that trains one model; the service's has none of those and a trainer of many adapters,
so it is its own small object with the same two duties: start everything (or nothing) and stop
everything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlpost.config import ServeConfig

log = logging.getLogger("rlpost")

NAMESPACE = "rlpost-serve"
STARTUP_TIMEOUT_S = 600.0


class ServiceFleet:
    """The trainer and the inference workers; :meth:`start` waits until every engine serves."""

    def __init__(self, trainer: Any, inference: list[Any]):
        self.trainer, self.inference = trainer, inference

    @classmethod
    def start(cls, cfg: ServeConfig, base_model: str, *, name_prefix: str = "") -> ServiceFleet:
        """Start the actors for ``base_model`` (a resolved path or hub name) and wait for them.
        A start that fails leaves no actor."""
        import ray

        from rlpost.actors.adapters import start_adapter_trainer
        from rlpost.actors.inference import start_worker_actor
        from rlpost.policies.lora import AdapterServing

        res = cfg.resources
        trainer = start_adapter_trainer(
            base_model, name=f"{name_prefix}trainer", resources=res.trainer,
            init_kwargs={"dtype": cfg.dtype, "max_rank": cfg.max_lora_rank, "max_batch_tokens": cfg.max_batch_tokens,
                         "threads": res.trainer.num_threads},
        )  # fmt: skip
        serving = AdapterServing(max_rank=cfg.max_lora_rank, max_loras=cfg.loras_per_batch)
        inference = [
            start_worker_actor(
                base_model,
                cfg.engine,
                dtype=cfg.dtype,
                index=i,
                adapters=serving,
                options={
                    "name": f"{name_prefix}inference-{i}",
                    "num_cpus": res.inference.num_cpus,
                    "num_gpus": res.inference.num_gpus,
                    **({"resources": res.inference.resources} if res.inference.resources else {}),
                },
            )  # fmt: skip
            for i in range(cfg.inference_workers)
        ]
        fleet = cls(trainer, inference)
        try:
            ready = [trainer.__ray_ready__.remote()] + [worker.get_version.remote() for worker in inference]
            ray.get(ready, timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            fleet.stop()
            raise
        log.info("serve: trainer and %d inference workers ready on %s", len(inference), Path(base_model).name)
        return fleet

    def stop(self) -> None:
        """Shut the engines down and kill every actor (best effort, bounded)."""
        import ray

        for worker in self.inference:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            except Exception:  # a dead or stuck worker is killed below anyway
                pass
        for actor in [self.trainer, *self.inference]:
            try:
                ray.kill(actor)
            except Exception:
                pass

    def sizes(self) -> dict[str, int]:
        return {"trainer": 1, "inference": len(self.inference)}
