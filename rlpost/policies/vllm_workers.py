"""vLLM engines as weight-updatable workers (TorchRL's ``make_vllm_worker`` / ``vLLMWorker``).

- :data:`vLLMWorker` is the class mixed into each vLLM worker process (vLLM's
  ``worker_extension_cls``): it joins rlpost's weight bus, receives versioned buckets and reloads
  them in place. Pass ``worker_extension_cls=VLLM_WORKER_EXTENSION`` to a ``vllm.LLM`` to add it.
- :func:`make_vllm_worker` starts an engine with that extension: a Ray actor (the same
  ``InferenceActor`` an rlpost run starts as ``inference-<i>``) or, with
  ``make_ray_worker=False``, an in-process :class:`~rlpost.actors.inference.InferenceWorker`.
  ``vLLMWrapper(worker)`` generates with either, and
  :class:`~rlpost.collect.vLLMUpdater` pushes new weights to them.

Deviation from TorchRL: the worker is rlpost's inference worker (generate, score,
``join_bus``, ``update_weights``, ``get_version``), not a bare ``vllm.LLM``; on a CPU-only
machine it sizes the KV cache explicitly (``kv_cache_space_gb``), as vLLM's CPU backend needs.
"""

from __future__ import annotations

from typing import Any

from rlpost.policies.vllm_worker_ext import WeightSyncExtension
from rlpost.policies.vllm_wrapper import WORKER_EXTENSION as VLLM_WORKER_EXTENSION  # noqa: F401 (re-exported)

vLLMWorker = WeightSyncExtension

# EngineConfig fields a caller may pass by name; anything else goes to vllm.LLM as is.
_ENGINE_FIELDS = ("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_space_gb", "max_model_len",
                  "max_num_seqs", "enforce_eager", "seed", "cpu_threads")  # fmt: skip


def make_vllm_worker(
    model_name: str,
    *,
    gpu_memory_utilization: float = 0.9,
    num_devices: int | None = None,
    num_replicas: int = 1,
    make_ray_worker: bool = True,
    enforce_eager: bool = False,
    dtype: str = "auto",
    name: str | None = None,
    num_cpus: float = 1,
    num_gpus: float | None = None,
    engine_config: Any = None,
    index: int = 0,
    ray_options: dict[str, Any] | None = None,
    run_name: str = "",
    lora: Any = None,
    inflight_updates: bool = True,
    **kwargs: Any,
) -> Any:
    """Start ``num_replicas`` vLLM engines on ``model_name`` with the weight-update extension.

    rlpost's runs start their ``inference-<i>`` actors with this function too.

    Keyword Args:
        gpu_memory_utilization, enforce_eager: vLLM's (on a GPU).
        num_devices: GPUs per engine (tensor parallel); None: 1 on a GPU, 0 on CPU.
        num_replicas: engines to start; more than one returns a list.
        make_ray_worker: a Ray actor (True) or an in-process worker.
        dtype: "auto" (bfloat16 on a GPU, float32 on CPU) or a torch dtype name.
        name: the Ray actor's name (``-<i>`` appended per replica when there are several).
        num_cpus: CPUs reserved for each Ray actor.
        num_gpus: GPUs reserved for each Ray actor (may be a fraction); None: ``num_devices``.
        engine_config: an :class:`~rlpost.config.EngineConfig` (a job config's
            ``rollout.engine``) used as is instead of the engine keywords.
        index: the first replica's worker index (it names the worker's metrics).
        ray_options: more Ray actor options (e.g. ``scheduling_strategy``).
        run_name: the run whose metrics the worker reports under.
        lora: a ``model.lora`` section (:class:`~rlpost.config.LoraConfig`): the engines serve a
            LoRA adapter on the base model, updated by each publish.
        inflight_updates: apply an update that arrives during a generate call between two of
            its engine steps (``weight_sync.inflight_updates``; :class:`~rlpost.actors.inference.InferenceWorker`).
        **kwargs: ``max_model_len``, ``max_num_seqs``, ``kv_cache_space_gb``, ``seed`` and any
            other ``vllm.LLM`` argument.
    """
    import torch

    from rlpost.actors.inference import InferenceActor, InferenceWorker
    from rlpost.config import EngineConfig

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    on_gpu = torch.cuda.is_available()
    devices = num_devices if num_devices is not None else (1 if on_gpu else 0)
    if engine_config is None:
        settings = {key: kwargs.pop(key) for key in _ENGINE_FIELDS if key in kwargs}
        engine_config = EngineConfig(
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            tensor_parallel_size=max(1, devices), extra=kwargs, **settings,
        )  # fmt: skip
    elif kwargs:
        raise TypeError(f"make_vllm_worker takes engine_config= or engine keywords, not both: {sorted(kwargs)}")
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    workers = []
    for replica in range(num_replicas):
        worker_index = index + replica
        if not make_ray_worker:
            workers.append(InferenceWorker(model_name, engine_config, dtype=dtype, index=worker_index, lora=lora,
                                           inflight_updates=inflight_updates))  # fmt: skip
            continue
        import ray

        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": devices if num_gpus is None else num_gpus}
        # threaded: an update reaches a running generate call (in-flight, InferenceWorker); the
        # worker itself lets one call at a time use its engine
        options["max_concurrency"] = 8
        options.update(ray_options or {})
        if name is not None:
            options["name"] = name if num_replicas == 1 else f"{name}-{replica}"
        actor = ray.remote(InferenceActor).options(**options)
        workers.append(
            actor.remote(
                model_name,
                engine_config,
                dtype=dtype,
                index=worker_index,
                run_name=run_name,
                lora=lora,
                inflight_updates=inflight_updates,
            )  # fmt: skip
        )
    return workers[0] if num_replicas == 1 else workers


def is_remote_worker(obj: Any) -> bool:
    """A Ray actor handle of an inference worker (what make_vllm_worker returns)."""
    return type(obj).__name__ == "ActorHandle" and hasattr(obj, "update_weights")


def is_local_worker(obj: Any) -> bool:
    from rlpost.actors.inference import InferenceWorker

    return isinstance(obj, InferenceWorker)
