"""vLLM engines as weight-updatable workers: TorchRL's ``make_vllm_worker``.

:func:`make_vllm_worker` starts an engine with rlpost's weight-update extension
(:data:`~rlpost.policies.vLLMWorker`, mixed into vLLM's worker): a Ray actor (the same
:class:`~rlpost.actors.inference.InferenceActor` an rlpost run starts as ``inference-<i>``, and
an ``AsyncVLLM`` fleet as each replica) or, with ``make_ray_worker=False``, an in-process
:class:`~rlpost.actors.inference.InferenceWorker`. ``vLLMWrapper(worker)`` generates with either,
and :class:`~rlpost.collect.vLLMUpdater` pushes new weights to them.

Deviation from TorchRL: the worker is rlpost's inference worker (generate, score,
``join_bus``, ``update_weights``, ``get_version``), not a bare ``vllm.LLM``; on a CPU-only
machine it sizes the KV cache explicitly (``kv_cache_space_gb``), as vLLM's CPU backend needs.
"""

from __future__ import annotations

from typing import Any

from rlpost.actors.inference import InferenceWorker, start_worker_actor
from rlpost.config import EngineConfig

# EngineConfig fields a caller may pass by name; anything else goes to vllm.LLM as is.
_ENGINE_FIELDS = ("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_space_gb", "max_model_len",
                  "max_num_seqs", "enforce_eager", "seed", "cpu_threads")  # fmt: skip


def engine_devices(num_devices: int | None) -> int:
    """GPUs per engine: ``num_devices``, or, when None, 1 on a machine with a GPU and 0 without."""
    import torch

    return num_devices if num_devices is not None else (1 if torch.cuda.is_available() else 0)


def make_vllm_worker(model_name: str, *, gpu_memory_utilization: float = 0.9, num_devices: int | None = None,
                     num_replicas: int = 1, make_ray_worker: bool = True, enforce_eager: bool = False,
                     dtype: str = "auto", name: str | None = None, num_cpus: float = 1, num_gpus: float | None = None,
                     engine_config: Any = None, index: int = 0, ray_options: dict[str, Any] | None = None,
                     run_name: str = "", lora: Any = None, inflight_updates: bool = True, **kwargs: Any) -> Any:  # fmt: skip
    """Start ``num_replicas`` vLLM engines on ``model_name`` (more than one: a list).

    ``num_devices``: GPUs per engine (tensor parallel; None: 1 on a GPU, 0 on CPU). ``dtype``
    "auto": bfloat16 on a GPU, float32 on CPU. ``name``: the Ray actor's (``-<i>`` per replica when
    several). ``num_gpus``: reserved per actor (may be a fraction; None: ``num_devices``).
    ``engine_config``: an :class:`~rlpost.config.EngineConfig` used as is instead of the engine
    keywords. ``index``: the first replica's worker index (it names its metrics). ``lora``: a
    ``model.lora`` section: the engines serve a LoRA adapter on the base model, updated by each
    publish. ``inflight_updates``: ``weight_sync.inflight_updates``. ``**kwargs``:
    ``max_model_len``, ``max_num_seqs``, ``kv_cache_space_gb``, ``seed``, any ``vllm.LLM`` argument.
    """
    import torch

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    on_gpu = torch.cuda.is_available()
    devices = engine_devices(num_devices)
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
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": devices if num_gpus is None else num_gpus}
        options.update(ray_options or {})
        if name is not None:
            options["name"] = name if num_replicas == 1 else f"{name}-{replica}"
        workers.append(start_worker_actor(model_name, engine_config, dtype=dtype, index=worker_index, options=options,
                                          run_name=run_name, lora=lora, inflight_updates=inflight_updates))  # fmt: skip
    return workers[0] if num_replicas == 1 else workers
