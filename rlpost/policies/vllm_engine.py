"""Making and stopping the ``vllm.LLM`` engines rlpost uses (its settings, CPU core binding,
in-process engines)."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Sequence

import torch

log = logging.getLogger("rlpost")

# rlpost's methods in vLLM's worker process (weight updates): pass as worker_extension_cls
WORKER_EXTENSION = "rlpost.policies.vllm_worker_ext.WeightSyncExtension"
# CPU backend: how long an engine's worker busy-polls for its next step after one ends (vLLM: 1 s)
SPIN_AFTER_WORK_S = 0.05


def make_vllm_engine(
    model_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    enforce_eager: bool = True,
    max_model_len: int = 512,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = 256 * 2**20,
    max_logprobs: int = -1,
    cpu_cores: Sequence[int] | None = None,
    in_process: bool = False,
    **engine_kwargs,
):
    """Create a ``vllm.LLM`` configured the way rlpost needs it.

    Always sets ``logprobs_mode="processed_logprobs"`` (another value is a ValueError), and
    ``max_logprobs=-1`` (tempered scoring reads full prompt distributions). ``dtype`` is float32
    by default so that inference log-probs match the fp32 learner. On the CPU backend:

    - the KV cache is ``kv_cache_memory_bytes`` (256 MiB holds ~250k tokens of the tiny model,
      and keeps one engine under 2 GB resident). vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE``
      variable (whole GiB) overrides it when set in the environment; with
      ``kv_cache_memory_bytes=None`` it is set to 1 GiB unless already set.
    - chunked prefill is off (see the comment below); pass ``enable_chunked_prefill`` to override.
    - rlpost's worker extension is the default ``worker_extension_cls`` (weight updates), and
      through it the worker busy-polls for its next step for at most ``SPIN_AFTER_WORK_S`` after
      one ends instead of vLLM's 1 s, which burns a core beside whatever runs next (the learner
      of a sync step: its tiny-model step took 0.14 s against 0.13 s with the engine quiet).
    - ``cpu_cores``: the cores whose threads run the model (one torch thread each, bound to its
      core; :func:`engine_cpu_cores` picks them). None keeps vLLM's own choice, which on a node
      of N cores binds N-1 threads and leaves one core to the engine's scheduler process: on 2
      cores, one thread.

    The engine runs in child processes: create it under ``if __name__ == "__main__":`` and
    release it with :func:`shutdown_vllm_engine`. ``in_process=True`` runs its core and worker
    here (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for this engine only): no child to start (~15 s of
    vLLM import per process on 2 CPU cores) or to compete for the cores. Trap (CPU): the calling
    thread gets ``cpu_cores`` as affinity and torch thread count and must be the one that
    generates (its OpenMP threads inherit them; another thread's would not).
    ``torch.set_num_threads`` stays usable (vLLM disables it, rlpost restores it), and vLLM
    ``gc.freeze``-s the heap as in an engine process. One in-process engine at a time (vLLM's
    parallel state is module-global and torn down at shutdown); another gets processes (logged).
    """
    from vllm import LLM
    from vllm.platforms import current_platform

    mode = engine_kwargs.pop("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise ValueError(f"rlpost needs logprobs_mode='processed_logprobs', got {mode!r}")
    if current_platform.is_cpu():
        if kv_cache_memory_bytes is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM 0.32 CPU trap: a seeded request whose prompt is prefilled in chunks crashes the
        # engine ("CPU Generator does not use offset") once a batch's prompts exceed
        # max_num_batched_tokens; without chunked prefill prompts are scheduled whole.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        if not engine_kwargs["enable_chunked_prefill"]:
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 4096))
    if kv_cache_memory_bytes is not None:
        engine_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    binding = {}
    if in_process and len(_IN_PROCESS_ENGINES):
        log.info("another vLLM engine runs in this process: this one runs in processes of its own")
        in_process = False
    if in_process:
        binding["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if current_platform.is_cpu():
            _confine_this_thread(cpu_cores)
    elif cpu_cores is not None and current_platform.is_cpu():
        # read by the engine's processes as they start (they inherit this environment)
        binding["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in cpu_cores)
    engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it when it runs here
    try:
        with _vllm_environment(binding):
            llm = LLM(
                str(model_path),
                dtype=dtype,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                seed=seed,
                max_logprobs=max_logprobs,
                logprobs_mode="processed_logprobs",
                **engine_kwargs,
            )
    finally:
        torch.set_num_threads = set_num_threads
    if in_process:
        _IN_PROCESS_ENGINES.add(llm)
    if current_platform.is_cpu() and engine_kwargs.get("worker_extension_cls") == WORKER_EXTENSION and not in_process:
        llm.collective_rpc("rlpost_spin_after_work", timeout=60, args=(SPIN_AFTER_WORK_S,))
    return llm


def _confine_this_thread(cpu_cores: Sequence[int] | None) -> None:
    """In-process CPU engine: confine this thread (and the OpenMP threads it starts) to
    ``cpu_cores`` (None: all the process's cores but one, at least one), as vLLM binds only the
    threads of a worker process of its own."""
    if cpu_cores is None:
        available = sorted(os.sched_getaffinity(0))
        cpu_cores = available[: max(1, len(available) - 1)]
    os.sched_setaffinity(0, cpu_cores)  # pid 0: the calling thread
    torch.set_num_threads(len(cpu_cores))


# engines made with in_process=True, until shut down (make_vllm_engine runs one at a time)
_IN_PROCESS_ENGINES: weakref.WeakSet = weakref.WeakSet()


def engine_cpu_cores(num_threads: int, index: int = 0) -> list[int]:
    """``num_threads`` cores of this process's CPU set for the threads of engine ``index`` on the
    node: engines 0, 1, ... take consecutive runs of cores, wrapping round when the node has
    fewer cores than their threads (they then share cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= num_threads <= len(cores):
        raise ValueError(
            f"rollout.engine.cpu_threads={num_threads}: this process may run on {len(cores)} cores ({cores})"
        )
    return [cores[(index * num_threads + j) % len(cores)] for j in range(num_threads)]


@contextlib.contextmanager
def _vllm_environment(values: dict[str, str]):
    """Set environment variables for an engine's start, then restore what was there.

    Trap: an in-process engine core freezes vLLM's ``envs`` cache at its start, so the cache is
    cleared before (this engine reads ``values``) and rebuilt after (a later one does not)."""
    from vllm import envs

    was_cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        if was_cached or envs._is_envs_cache_enabled():
            envs.disable_envs_cache()
            envs.enable_envs_cache()


def shutdown_vllm_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine core and worker (their processes, or, in this process, their
    state) now instead of at garbage collection."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    _IN_PROCESS_ENGINES.discard(llm)
