"""Inference workers: one vLLM engine each, versioned weights.

:class:`InferenceWorker` (plain class) owns a ``vllm.LLM`` with
:class:`~rlpost.policies.vllm_worker_ext.WeightSyncExtension`, serves batched generate requests
stamped with its policy version, and applies weight updates: reload in place bucket by bucket as
they arrive from the bus, label the weights with the new version, reset the prefix cache (its KV
came from the old weights). In-flight updates (``inflight_updates``, default on): the model worker
receives an update on its own thread while a generate call keeps stepping; between two steps the
call pauses the scheduler keeping its requests, reloads, labels and resumes. Running requests go
on with the new weights and their old KV (as PipelineRL does); ``Completion.token_versions`` says
which version sampled each token, the call's stamp stays the version it started with. Every other
call takes the engine alone. ``InferenceActor`` (Ray actor ``inference-<i>``, threaded so an update
reaches a running generate) adds metrics and an engine watch. On the CPU backend the engine runs
in the worker's process (``rollout.engine.in_process``), every engine call on one thread whose
cores the model's threads inherit. Env pools generate through
:class:`~rlpost.policies.RemoteVLLMClient`; the learner's vLLMUpdater drives the updates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlpost.config import EngineConfig, LoraConfig, RoleResources
from rlpost.policies import LocalVLLMClient, make_vllm_engine, shutdown_vllm_engine
from rlpost.policies.lora import (
    AdapterServing,
    engine_adapter_kwargs,
    engine_lora_kwargs,
    engine_supports_lora,
    sync_route,
)
from rlpost.policies.vllm_engine import WORKER_EXTENSION, engine_cpu_cores
from rlpost.runtime.liveness import progress, record_error, working

if TYPE_CHECKING:
    from rlpost.config import JobConfig

log = logging.getLogger("rlpost")

# Bound of a call into the engine's worker process that waits on nothing outside it (the reload
# path's status); a call that does (joining the bus: the publisher's store; a weight update) is
# bounded by its own timeout plus this margin, so that its own, clearer error comes first.
ENGINE_RPC_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class InferenceSettings:
    """What an inference worker is given: the model, its engine section and its resources."""

    model_path: str  # ``model.name_or_path``: the weights the engine starts from (version 0)
    engine: EngineConfig  # ``rollout.engine``
    dtype: str  # ``model.dtype``: the engine's dtype, and the dtype the weights are published in
    resources: RoleResources  # ``resources.inference``
    run_name: str = ""  # the run whose metrics the worker reports under
    lora: LoraConfig | None = None  # ``model.lora`` when the engines serve the adapter (lora.sync_route)
    inflight_updates: bool = True  # ``weight_sync.inflight_updates``
    adapters: AdapterServing | None = None  # a service's engines: clients' adapters chosen per request

    @classmethod
    def from_job(cls, cfg: JobConfig) -> InferenceSettings:
        lora = cfg.model.lora if sync_route(cfg) == "adapter" else None
        return cls(cfg.model.name_or_path, cfg.rollout.engine, cfg.model.dtype, cfg.resources.inference,
                   cfg.logging.run_name or "", lora, cfg.weight_sync.inflight_updates)  # fmt: skip


@dataclass
class _PendingUpdate:
    """An update waiting for the running generate call to apply it between two engine steps."""

    timeout_s: float
    receiving: bool = False  # the engine's worker process receives it while the engine steps
    done: bool = False
    info: dict | None = None
    error: BaseException | None = None
    posted: float = field(default_factory=time.monotonic)


def start_inference(settings: InferenceSettings, index: int, *, namespace: str | None = None, **options: Any):
    """Start the actor ``inference-<index>`` (its engine loads in the background: a first call
    waits for it); ``options`` go to ``.options()`` (e.g. a placement-group strategy)."""
    if namespace is not None:
        options["namespace"] = namespace
    resources = {"num_cpus": settings.resources.num_cpus, "num_gpus": settings.resources.num_gpus}
    return start_worker_actor(
        settings.model_path, settings.engine, dtype=settings.dtype, index=index,
        options={**resources, "name": f"inference-{index}", **options}, run_name=settings.run_name,
        lora=settings.lora, inflight_updates=settings.inflight_updates, adapters=settings.adapters,
    )  # fmt: skip


def start_worker_actor(model_path: str, engine: EngineConfig, *, dtype: str, index: int, options: dict[str, Any],
                       run_name: str = "", lora: LoraConfig | None = None, inflight_updates: bool = True,
                       adapters: AdapterServing | None = None):  # fmt: skip
    """Start one threaded :class:`InferenceActor` (an update must reach a running generate call;
    the worker itself lets one call at a time use its engine)."""
    from rlpost.runtime.liveness import remote_class

    options = {"max_concurrency": 8, **options}
    return (
        remote_class(InferenceActor)
        .options(**options)
        .remote(model_path, engine, dtype=dtype, index=index, run_name=run_name, lora=lora,
                inflight_updates=inflight_updates, adapters=adapters)
    )  # fmt: skip


def engine_kwargs(engine: EngineConfig, *, on_gpu: bool) -> dict[str, Any]:
    """vllm.LLM arguments from the config's engine section (CPU: a fixed KV-cache size)."""
    kwargs = dict(
        enforce_eager=engine.enforce_eager,
        max_model_len=engine.max_model_len,
        seed=engine.seed,
        max_num_seqs=engine.max_num_seqs,
        worker_extension_cls=WORKER_EXTENSION,
        in_process=engine.in_process if engine.in_process is not None else not on_gpu,
        **engine.extra,
    )
    if on_gpu:
        kwargs.update(
            kv_cache_memory_bytes=None,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            tensor_parallel_size=engine.tensor_parallel_size,
        )
    else:
        kwargs["kv_cache_memory_bytes"] = int(engine.kv_cache_space_gb * 2**30)
    return kwargs


class InferenceWorker:
    """A vLLM engine behind generate / score / weight-update calls; see the module docstring.

    With ``lora`` the engine serves a LoRA adapter on the base model: each update's adapter is
    written to a folder and loaded as the engine's adapter. Version 0 is the base model. An
    engine that cannot serve LoRA for this model starts without it (``serves_lora()`` False: the
    learner sends merged weights).

    With ``adapters`` (a service's engine) it serves clients' adapters instead, one named per
    :meth:`sample` call: :meth:`add_adapter` writes one to a folder the engine loads on first use.
    """

    def __init__(self, model_path: str, engine: EngineConfig, *, dtype: str = "float32", index: int = 0,
                 lora: LoraConfig | None = None, inflight_updates: bool = True,
                 adapters: AdapterServing | None = None):  # fmt: skip
        import torch

        self.index = index
        self.version = 0
        self.model_path = model_path
        kwargs = engine_kwargs(engine, on_gpu=torch.cuda.is_available())
        if lora is not None and not engine_supports_lora(
            model_path, trust_remote_code=bool(kwargs.get("trust_remote_code"))
        ):
            log.warning("inference-%d: vLLM cannot serve a LoRA adapter on %s; this worker loads the merged "
                        "weights the learner sends instead", index, model_path)  # fmt: skip
            lora = None
        self.lora = lora
        if lora is not None:
            kwargs.update(engine_lora_kwargs(lora))
        if adapters is not None:
            kwargs.update(engine_adapter_kwargs(adapters))
        if engine.cpu_threads is not None and not torch.cuda.is_available():
            kwargs["cpu_cores"] = engine_cpu_cores(engine.cpu_threads, index)
        # an engine in this process is driven from one thread of its own (_on_engine_thread)
        self._engine_thread = ThreadPoolExecutor(1, f"inference-{index}-engine") if kwargs["in_process"] else None
        self._engine_thread_id = (
            self._engine_thread.submit(threading.get_ident).result() if self._engine_thread else None
        )
        self.llm = self._on_engine_thread(make_vllm_engine, model_path, dtype=dtype, **kwargs)
        self.client = LocalVLLMClient(self.llm, run_engine=self._on_engine_thread)
        serves_adapters = self.lora is not None or adapters is not None
        self._adapter_root = tempfile.mkdtemp(prefix=f"rlpost-lora-inference-{index}-") if serves_adapters else None
        self._client_adapters: dict[str, Any] = {}  # name -> LoRARequest, least recently used first
        self._adapter_files = adapters.files if adapters is not None else 0  # the most kept (the rest dropped)
        self._adapter_loads = 0  # the engine's adapter ids: one per update (vLLM ids start at 1)
        # load each bucket of a full update as it arrives (False: after the whole update, a baseline)
        self.overlap_reload = True
        self.direct_reload = engine.direct_reload  # CPU: into the kernels, not through reload_weights
        # switch weights between engine steps of a running generate call (module docstring)
        self.inflight_updates = inflight_updates
        self._turn = threading.Condition()  # who uses the engine: one generate call or one other call
        self._generating = False
        self._busy = False
        self._requests = 0  # generate and score calls running or waiting for the engine (drain)
        self._busy_s = 0.0  # seconds the engine spent on generate and score calls (the load policy's measure)
        self._pending: _PendingUpdate | None = None
        self._stale_prefix_cache = False  # an in-flight update left KV of older weights in the cache
        self.llm.llm_engine.set_weight_version(str(self.version))
        self._warm_up()

    def _warm_up(self) -> None:
        """Pay the first step's one-time costs at start-up: vLLM compiles its log-prob kernel on the
        first log-prob request (2.2 s of a 4 s first generate, 0.5B shape, 2 CPU cores); the direct
        reload checks the CPU kernels. (Seeded samples differ from an unwarmed engine's; runs stay
        reproducible, since every engine does it.)"""
        start = time.perf_counter()

        def warm_up() -> None:
            vocab = self.client.vocab_size
            prompt = [token % vocab for token in range(1, 5)]
            self.client.generate([prompt], {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
            self.llm.reset_prefix_cache()

        with self._engine_turn():
            self._on_engine_thread(warm_up)
        path = self.reload_path() if self.lora is None else "as LoRA adapters"
        log.info("inference-%d: warmed up in %.1f s; weight updates load: %s", self.index,
                 time.perf_counter() - start, path)  # fmt: skip

    def _on_engine_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the thread driving an in-process engine (its model's threads
        have that thread's cores); called directly when the engine has processes of its own."""
        if self._engine_thread is None or threading.get_ident() == self._engine_thread_id:
            return fn(*args, **kwargs)
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def _worker_rpc(self, method: str, *args: Any, timeout_s: float = ENGINE_RPC_TIMEOUT_S) -> Any:
        """``method`` of rlpost's extension in the engine's worker (the first worker's answer),
        bounded: past ``timeout_s`` vLLM raises TimeoutError naming the method."""

        def call() -> Any:
            return self.llm.collective_rpc(method, args=args, timeout=timeout_s)[0]

        return self._on_engine_thread(call)

    @contextlib.contextmanager
    def _engine_turn(self, generating: bool = False) -> Iterator[None]:
        """Use the engine alone: wait for the running call to finish. A generate call
        (``generating``) lets updates in between its steps."""
        with self._turn:
            self._turn.wait_for(lambda: not self._generating and not self._busy and self._pending is None)
            if generating:
                self._generating = True
            else:
                self._busy = True
        try:
            yield
        finally:
            with self._turn:
                self._generating = self._busy = False
                self._turn.notify_all()

    @contextlib.contextmanager
    def _request(self) -> Iterator[None]:
        """Count a generate or score call from its arrival to its answer (:meth:`drain`)."""
        with self._turn:
            self._requests += 1
        try:
            yield
        finally:
            with self._turn:
                self._requests -= 1
                self._turn.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no generate or score call runs or waits; whether idle.
        A worker leaving a resized fleet finishes its completions rather than dropping them."""
        with self._turn:
            return self._turn.wait_for(lambda: self._requests == 0, timeout=timeout_s)

    def busy_s(self) -> float:
        """Seconds the engine has spent on generate and score calls since the worker started:
        the load policy reads how busy the engines are from its growth (rlpost.service.autoscale)."""
        return self._busy_s

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._busy_s += time.perf_counter() - start

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]):
        """Completions per prompt plus the version of the weights the call started with (the
        oldest of its tokens; ``Completion.token_versions`` has each token's)."""
        with self._request(), self._engine_turn(generating=True), self._timed(), working("generate"):
            version = self.version
            self._reset_stale_prefix_cache()
            completions = self.client.generate(prompt_token_ids, sampling, between_steps=self._after_step)
            self._reset_stale_prefix_cache()
        return completions, version

    def _after_step(self) -> None:
        """After each engine step of a generate call: report progress (the watchdog's measure)
        and move a pending in-flight update on (:meth:`_between_steps`)."""
        progress()
        if self.inflight_updates and self.lora is None:
            self._between_steps()

    def score(self, token_ids: list[list[int]], temperature: float) -> list[list[float]]:
        with self._request(), self._engine_turn(), self._timed(), working("score"):
            self._reset_stale_prefix_cache()
            return self.client.score(token_ids, temperature=temperature)

    def join_bus(self, spec: dict, rank: int) -> int:
        with self._engine_turn():
            bound = float(spec["timeout_s"]) + ENGINE_RPC_TIMEOUT_S  # the store connection's own timeout first
            return self._worker_rpc("rlpost_join_bus", spec, rank, timeout_s=bound)

    def _reset_stale_prefix_cache(self) -> None:
        if self._stale_prefix_cache and self._on_engine_thread(self.llm.reset_prefix_cache):
            self._stale_prefix_cache = False

    def serves_lora(self) -> bool:
        """Whether updates are LoRA adapters this engine serves (else whole weights)."""
        return self.lora is not None

    def reload_path(self) -> str:
        """How a whole-weight update loads: "direct" (into the CPU kernels,
        ``rollout.engine.direct_reload``) or "reload_weights" (vLLM's; after a colon, why not direct)."""
        if not self.direct_reload:
            return "reload_weights"
        with self._engine_turn():
            reason = self._worker_rpc("rlpost_direct_reload_status")
        return "direct" if reason is None else f"reload_weights: {reason}"

    def use_direct_reload(self, enabled: bool) -> str:
        """Load later updates with the direct reload or with vLLM's reload_weights (the
        benchmarks and tests compare the two); returns :meth:`reload_path`."""
        self.direct_reload = bool(enabled)
        return self.reload_path()

    def update_weights(self, timeout_s: float) -> dict:
        """Receive the next published weights (up to ``timeout_s``) and switch to them: between
        two steps of a running generate call (``info["in_flight"]``), or alone."""
        with self._turn:
            if self._generating and self.inflight_updates and self.lora is None:
                pending = self._pending = _PendingUpdate(timeout_s)
                # the call's next step takes it (the receive itself is bounded by timeout_s)
                served = self._turn.wait_for(lambda: pending.done or not self._generating, timeout_s + 120)
                if pending.done:
                    if pending.error is not None:
                        raise pending.error
                    return pending.info
                self._pending = None  # the call ended first (or hangs): apply it alone, below
                if not served:
                    raise TimeoutError(f"inference-{self.index}: the running generate call took no update "
                                       f"within {timeout_s + 120:.0f}s")  # fmt: skip
                begun = pending.receiving  # its bytes may be arriving already: finish that receive
            else:
                begun = False
            # no generate call may start while an update waits (they wait for _pending too)
            self._turn.wait_for(lambda: not self._generating and not self._busy)
            self._busy = True
        try:
            return self._on_engine_thread(self._apply_update, timeout_s, begun)
        finally:
            with self._turn:
                self._busy = False
                self._turn.notify_all()

    def _apply_update(self, timeout_s: float, begun: bool) -> dict:
        """Receive (or finish receiving, when ``begun``) the next update and switch to it, alone."""
        if self.lora is not None:
            return self._update_adapter(timeout_s)
        info = self._finish_receive(timeout_s) if begun else self._receive_weights(timeout_s)
        self.llm.reset_prefix_cache()
        return {**info, "in_flight": False}

    def _receive_weights(self, timeout_s: float) -> dict:
        args = (timeout_s, self.overlap_reload, self.direct_reload)
        return self._now_serving(
            self._worker_rpc("rlpost_receive_weights", *args, timeout_s=timeout_s + ENGINE_RPC_TIMEOUT_S)
        )

    def _finish_receive(self, timeout_s: float) -> dict:
        """Reload the update the worker process has been receiving (``rlpost_begin_receive``)."""
        # the receive and the worker's wait for it are each bounded by timeout_s
        bound = 2 * timeout_s + 2 * ENGINE_RPC_TIMEOUT_S
        return self._now_serving(self._worker_rpc("rlpost_finish_receive", self.direct_reload, timeout_s=bound))

    def _now_serving(self, info: dict) -> dict:
        self.version = int(info["version"])
        self.llm.llm_engine.set_weight_version(str(self.version))
        return info

    def _between_steps(self) -> None:
        """Move a pending in-flight update on (module docstring; ``pause_scheduler("keep")``). A
        failed update fails the generate call too (its requests would go on with half-loaded weights)."""
        pending = self._pending  # read without the lock: a step must stay cheap
        if pending is None:
            return
        try:
            if not pending.receiving:
                self._worker_rpc("rlpost_begin_receive", pending.timeout_s)
                pending.receiving = True
                return
            if self._worker_rpc("rlpost_receive_state") == "receiving":
                return
            pending.info = self._switch_weights(pending)
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            if pending.info is not None or pending.error is not None:
                with self._turn:
                    if self._pending is pending:
                        self._pending = None
                    pending.done = True
                    self._turn.notify_all()

    def _switch_weights(self, pending: _PendingUpdate) -> dict:
        """Between two engine steps: pause the scheduler, load the received update, resume."""
        core = self.llm.llm_engine.engine_core
        pausable = hasattr(core, "call_utility")  # an engine core in its own process runs ahead
        if pausable:
            core.call_utility("pause_scheduler", "keep", False)
        paused = time.monotonic()
        try:
            info = self._finish_receive(pending.timeout_s)
        finally:
            if pausable:
                core.call_utility("resume_scheduler")
        self._stale_prefix_cache = True
        now = time.monotonic()
        return {**info, "in_flight": True, "waited_s": now - pending.posted, "paused_s": now - paused}

    def _update_adapter(self, timeout_s: float) -> dict:
        """Receive the next adapter into a new folder, load it, then drop the previous one."""
        from vllm.lora.request import LoRARequest

        from rlpost.policies.lora import adapter_config_dict

        self._adapter_loads += 1
        folder = os.path.join(self._adapter_root, f"load-{self._adapter_loads}")
        config = adapter_config_dict(self.lora, self.model_path)
        args = (timeout_s, folder, config)
        info = self._worker_rpc("rlpost_receive_adapter", *args, timeout_s=timeout_s + ENGINE_RPC_TIMEOUT_S)
        start = time.perf_counter()
        request = LoRARequest(f"rlpost-policy-v{int(info['version'])}", self._adapter_loads, folder)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"inference-{self.index}: vLLM did not load the adapter of version {info['version']}")
        previous, self.client.lora_request = self.client.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.version = int(info["version"])
        self.llm.llm_engine.set_weight_version(str(self.version))
        return {**info, "load_s": info["load_s"] + time.perf_counter() - start, "in_flight": False}

    def add_adapter(self, name: str, config: dict, tensors: dict) -> bool:
        """Make the adapter ``name`` (``adapter_config.json``'s content and its tensors) available
        to :meth:`sample`; an adapter's name stands for fixed weights, so a known name is kept."""
        from vllm.lora.request import LoRARequest

        from rlpost.policies.lora import write_adapter

        if self._adapter_root is None:
            raise RuntimeError(f"inference-{self.index}: this engine was started without adapter serving")
        if name in self._client_adapters:
            self._client_adapters[name] = self._client_adapters.pop(name)
            return False
        self._adapter_loads += 1
        folder = write_adapter(os.path.join(self._adapter_root, f"client-{self._adapter_loads}"), tensors, config)
        self._client_adapters[name] = LoRARequest(name, self._adapter_loads, str(folder))
        while len(self._client_adapters) > self._adapter_files:  # the least recently used goes
            oldest = self._client_adapters.pop(next(iter(self._client_adapters)))
            with self._engine_turn():
                self._on_engine_thread(self.llm.llm_engine.remove_lora, oldest.lora_int_id)
            shutil.rmtree(oldest.lora_path, ignore_errors=True)
        return True

    def sample(self, prompt: list[int], num_samples: int, params: dict[str, Any], adapter: str | None = None,
               prompt_logprobs: int | None = None) -> dict[str, Any]:  # fmt: skip
        """``num_samples`` completions of ``prompt`` under the adapter ``adapter`` (None: the base
        model), with each sampled token's log-prob (:meth:`LocalVLLMClient.sample`)."""
        request = None
        if adapter is not None:
            if adapter not in self._client_adapters:
                raise KeyError(f"inference-{self.index}: no adapter {adapter!r} (add_adapter first)")
            request = self._client_adapters.pop(adapter)
            self._client_adapters[adapter] = request
        with self._request(), self._engine_turn(), working("sample"):
            return self.client.sample(
                prompt, num_samples, params, lora_request=request, prompt_logprobs=prompt_logprobs
            )

    def generate_outputs(self, prompts: Any, sampling_params: Any = None) -> list:
        """vLLM's own ``LLM.generate(prompts, sampling_params)``: its ``RequestOutput`` list, for
        callers that want vLLM's objects (:meth:`AsyncVLLM.generate <rlpost.actors.async_vllm.AsyncVLLM.generate>`)."""
        with self._engine_turn():
            self._reset_stale_prefix_cache()
            return self._on_engine_thread(
                self.llm.generate, prompts, sampling_params, use_tqdm=False, lora_request=self.client.lora_request
            )

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:  # fmt: skip
        """vLLM's ``collective_rpc``: ``method`` on every model worker of the engine."""
        with self._engine_turn():
            return self._on_engine_thread(self.llm.collective_rpc, method, timeout=timeout, args=args, kwargs=kwargs)

    def reset_prefix_cache(self) -> bool:
        with self._engine_turn():
            return bool(self._on_engine_thread(self.llm.reset_prefix_cache))

    def get_version(self) -> int:
        return self.version

    def get_model_path(self) -> str:
        """The model the engine was started on (its tokenizer's place, for remote wrappers)."""
        return self.model_path

    def shutdown(self) -> None:
        self._on_engine_thread(shutdown_vllm_engine, self.llm)
        if self._engine_thread is not None:
            self._engine_thread.shutdown(wait=False)
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)


def engine_processes_died(llm: Any) -> bool:
    """Whether ``llm``'s engine runs in processes of its own and one died (every later call
    raises EngineDeadError). False for an in-process engine and for None (no engine yet)."""
    resources = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def _is_engine_death(exc: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


class InferenceActor(InferenceWorker):
    """The Ray actor ``inference-<i>``: the plain worker, reporting metrics.

    Trap: when the engine's own process dies (OOM killer, engine-core crash) the actor would live
    on failing every call, so it exits (at once when a call meets the dead engine, else within
    ENGINE_WATCH_S) and the supervisor starts a new worker as for any crash.
    """

    ENGINE_WATCH_S = 1.0

    def __init__(self, *args, run_name: str = "", **kwargs):
        from rlpost.record.metrics import RoleMetrics

        self._stopping = False  # shutdown() was called: vLLM's own shutdown marks the engine dead
        super().__init__(*args, **kwargs)
        self.metrics = RoleMetrics("inference", run_name, f"inference-{self.index}")
        if getattr(getattr(self.llm.llm_engine, "engine_core", None), "resources", None) is not None:
            threading.Thread(target=self._watch_engine, name=f"inference-{self.index}-watch", daemon=True).start()

    def _watch_engine(self) -> None:
        while not engine_processes_died(self.llm):
            time.sleep(self.ENGINE_WATCH_S)
        self._exit_engine_dead("vLLM found its engine core process dead")

    def shutdown(self) -> None:
        self._stopping = True
        super().shutdown()

    def _on_engine_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._on_engine_thread(fn, *args, **kwargs)
        except Exception as exc:
            if _is_engine_death(exc) or engine_processes_died(getattr(self, "llm", None)):
                self._exit_engine_dead(f"{type(exc).__name__}: {exc}")
            raise

    def _exit_engine_dead(self, why: str) -> None:
        if self._stopping:
            return
        log.error("inference-%d: its engine's process died (%s); exiting, so that the run starts a new worker",
                  self.index, why)  # fmt: skip
        record_error(RuntimeError(f"its engine's process died ({why})"), "engine")
        logging.shutdown()
        os._exit(1)

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]):
        completions, version = super().generate(prompt_token_ids, sampling)
        self.metrics.record(
            samples_generated=sum(len(c) for c in completions),
            tokens_generated=sum(len(x.token_ids) for c in completions for x in c),
            policy_version=version,
        )
        return completions, version

    def update_weights(self, timeout_s: float) -> dict:
        info = super().update_weights(timeout_s)
        self.metrics.record(policy_version=self.version, weight_load_s=info["receive_s"] + info["load_s"])
        return info
