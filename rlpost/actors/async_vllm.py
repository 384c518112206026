"""AsyncVLLM: a fleet of vLLM replicas as Ray actors behind one object (TorchRL's).

Each replica is rlpost's inference worker (:class:`~rlpost.actors.inference.InferenceActor`):
one vLLM engine with versioned, in-flight weight updates. The fleet gives:

- ``vLLMWrapper(fleet, ...)``: generation through :class:`~rlpost.policies.RemoteVLLMClient`
  (each call whole to the least-busy replica, so a GRPO group comes from one set of weights); it
  keeps working pickled into another actor.
- ``fleet.generate(prompts, SamplingParams(...))``: vLLM ``RequestOutput``\\ s, prompts spread
  over the replicas (TorchRL's call form).
- weight updates: :class:`~rlpost.collect.weight_sync.VLLMWeightSyncScheme`,
  :class:`~rlpost.collect.vLLMUpdater` on :attr:`actors`, :class:`vLLMUpdaterV2
  <rlpost.collect.weight_sync.vLLMUpdaterV2>`, or ``init_weight_update_group()`` then
  ``update_weights(named_tensors)``; a replica resets its prefix cache whenever its weights
  change, before its next request, so no completion reuses KV from older weights.

A dead replica is restarted by Ray (``max_restarts``) on its starting model, serving the initial
weights (its completions carry its own version) until the sender re-forms the group at its next
update; its in-flight requests go to another replica or wait for the restart. ``rlpost train``'s
inference workers are such a fleet (:meth:`AsyncVLLM.from_replica_starter`), whose supervisor
restarts replicas with :meth:`AsyncVLLM.start_replica`.

Deviations from TorchRL: replicas are rlpost's inference workers, not vLLM's ``AsyncLLMEngine``
(they work on the CPU backend and take rlpost's weight bus); ``AsyncVLLM(engine_args)`` also takes
a dict of ``vllm.LLM`` arguments; ``compile`` leaves vLLM's compilation setting alone; prefix
caching left unset stays vLLM's default, on (TorchRL turns it off: safe here, replicas reset it
on weight changes); ``update_weights`` calls no fleet-wide ``reset_prefix_cache``; least-busy
load balancing, not prefix-aware; ``enable_fp32_output``, data and pipeline parallelism are
refused with a message.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlpost.collect.weight_sync import RLvLLMEngine, VLLMWeightSyncScheme
from rlpost.runtime.placement import PLACEMENT_TIMEOUT_S, asks_of, placed, wait_until_placed

log = logging.getLogger("rlpost")

STARTUP_TIMEOUT_S = 600.0  # a replica's start (its engine loads the model)
MAX_RESTARTS = 3  # Ray restarts of one replica before it is given up


class AsyncVLLM(RLvLLMEngine):
    """vLLM replicas as Ray actors behind one object; see the module docstring.

    ``engine_args``: vLLM's ``AsyncEngineArgs`` (or ``EngineArgs``), or a dict of ``vllm.LLM``
    arguments with the model under ``"model"`` (rlpost's ``kv_cache_space_gb``, ``cpu_threads``
    allowed); kept as :attr:`engine_args` (a dict as a namespace, ``enable_prefix_caching`` None
    when unset). ``actor_class`` must be None. ``enable_prefix_caching``: None keeps
    ``engine_args``'s; a value is written into ``engine_args`` (as TorchRL does). Keyword-only
    (rlpost's): ``request_timeout_s`` bounds one generate call on a replica; ``placement_timeout_s``
    the wait for the cluster to place the replicas (past it the start fails naming what they ask
    for; else they would pend for ever); ``verbose=False`` keeps only vLLM's warnings and errors.
    """

    def __init__(self, engine_args: Any, num_replicas: int = 1, actor_class: Any = None,
                 enable_prefix_caching: bool | None = None, *, max_restarts: int = MAX_RESTARTS,
                 request_timeout_s: float = 600.0, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S, verbose: bool = True):  # fmt: skip
        if actor_class is not None:
            raise ValueError("AsyncVLLM's replicas are rlpost's inference workers: actor_class must be None")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if isinstance(engine_args, dict):
            engine_args = types.SimpleNamespace(**{"enable_prefix_caching": None, **engine_args})
            self.engine_kwargs = _engine_kwargs(vars(engine_args))
            if self.engine_kwargs["enable_prefix_caching"] is None:  # vLLM's default, as for AsyncEngineArgs
                del self.engine_kwargs["enable_prefix_caching"]
        else:
            self.engine_kwargs = _engine_kwargs(engine_args)
        if enable_prefix_caching is not None:
            engine_args.enable_prefix_caching = enable_prefix_caching
            self.engine_kwargs["enable_prefix_caching"] = enable_prefix_caching
        self.engine_args = engine_args
        self.model_name = str(self.engine_kwargs.pop("model"))
        self.num_replicas = num_replicas
        self.max_restarts, self.request_timeout_s, self.startup_timeout_s = max_restarts, request_timeout_s, startup_timeout_s  # fmt: skip
        self.placement_timeout_s = placement_timeout_s
        self._asks: dict[int, dict[str, float]] = {}  # replica index -> what it asks the cluster for
        self.verbose = verbose
        self._replicas: dict[int, Any] = {}  # replica index -> its actor (a resized fleet may have gaps)
        self._client = None
        self._service_id = uuid.uuid4().hex[:8]
        self._master_port: int | None = None
        self._start_replica: Callable[[int], Any] = self._start_vllm_replica
        self._weight_sender: Any = None  # init_weight_update_group's VLLMWeightSender

    @classmethod
    def from_replica_starter(cls, start_replica: Callable[[int], Any], num_replicas: int, model_name: str, *,
                             tensor_parallel_size: int = 1, request_timeout_s: float = 600.0,
                             startup_timeout_s: float = STARTUP_TIMEOUT_S) -> AsyncVLLM:  # fmt: skip
        """A fleet whose replica ``i`` is the actor ``start_replica(i)`` returns (rlpost's, for
        ``rlpost train``'s workers). Nothing starts until :meth:`start_replica` or a first use;
        Ray does not restart these replicas: their owner calls :meth:`start_replica` again."""
        fleet = cls({"model": model_name, "tensor_parallel_size": tensor_parallel_size}, num_replicas,
                    max_restarts=0, request_timeout_s=request_timeout_s, startup_timeout_s=startup_timeout_s)  # fmt: skip
        fleet._start_replica = start_replica
        return fleet

    # ------------------------------------------------------------------ starting

    def _start_vllm_replica(self, index: int) -> Any:
        """Replica ``index`` from the fleet's vLLM arguments (an actor named after the fleet)."""
        from rlpost.actors.vllm_workers import engine_devices, make_vllm_worker

        kwargs = dict(self.engine_kwargs)
        dtype = kwargs.pop("dtype", "auto")
        devices = kwargs.pop("tensor_parallel_size", None)
        num_cpus = kwargs.pop("num_cpus", 1)
        name = f"async-vllm-{self._service_id}" + (f"-{index}" if self.num_replicas > 1 else "")
        self._asks[index] = asks_of({"num_cpus": num_cpus, "num_gpus": engine_devices(devices)})
        return make_vllm_worker(
            self.model_name, num_devices=devices, dtype=_dtype_name(dtype), name=name, index=index,
            num_cpus=num_cpus, ray_options=self._replica_options(), **kwargs,
        )  # fmt: skip

    @property
    def actors(self) -> list:
        """The started replicas' actor handles, by replica index."""
        return [self._replicas[i] for i in sorted(self._replicas)]

    @property
    def _launched(self) -> bool:
        """Whether replicas were started (TorchRL's attribute, which its code and tests read)."""
        return bool(self._replicas)

    def start_replica(self, index: int) -> Any:
        """Start replica ``index`` (killing one already started) and return its handle without
        waiting for its engine to load; the fleet's client serves from it from now on."""
        import ray

        if not 0 <= index < self.num_replicas:
            raise IndexError(f"AsyncVLLM: no replica {index}: the fleet has replicas 0..{self.num_replicas - 1} "
                             "(resize() changes that)")  # fmt: skip
        if index in self._replicas:
            ray.kill(self._replicas[index], no_restart=True)
        self._replicas[index] = self._start_replica(index)
        self._serve_from_started()
        return self._replicas[index]

    def stop_replica(self, index: int) -> None:
        """End replica ``index`` (its engine's shutdown, then the actor); the fleet's client stops
        sending it requests first. No-op for a replica not started."""
        import ray

        actor = self._replicas.pop(index, None)
        if actor is None:
            return
        self._serve_from_started()
        try:
            if placed(actor):  # one still waiting for its resources has no engine to stop
                ray.get(actor.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 (already dead or stuck: killed below either way)
            pass
        ray.kill(actor, no_restart=True)

    def resize(self, num_replicas: int) -> None:
        """Let the fleet have ``num_replicas`` replicas: higher indices are stopped; new ones
        start only with :meth:`start_replica` (their owner decides when). Beyond TorchRL's."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        for index in [i for i in self._replicas if i >= num_replicas]:
            self.stop_replica(index)
        self.num_replicas = num_replicas

    def _serve_from_started(self) -> None:
        if self._client is not None and self._replicas:
            self._client.set_handles(self.actors)

    def _launch(self) -> None:
        """Start the replicas and wait until every one has loaded its model."""
        import ray

        if self.actors:
            return
        for index in range(self.num_replicas):
            self.start_replica(index)
        start = time.monotonic()
        try:
            replicas = {f"replica {i}": (self._replicas[i], self._asks.get(i, {})) for i in sorted(self._replicas)}
            wait_until_placed(replicas, self.placement_timeout_s, f"AsyncVLLM ({self.model_name})")
            ray.get([actor.get_version.remote() for actor in self.actors], timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise TimeoutError(
                f"AsyncVLLM: {self.num_replicas} replica(s) of {self.model_name} did not start within "
                f"{self.startup_timeout_s:.0f} s (startup_timeout_s)"
            ) from None
        except Exception:
            self.shutdown()
            raise
        log.info("AsyncVLLM: %d replica(s) of %s ready in %.1f s", len(self.actors), self.model_name,
                 time.monotonic() - start)  # fmt: skip

    def _replica_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"max_restarts": self.max_restarts}
        if not self.verbose:
            options["runtime_env"] = {"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}}
        return options

    @classmethod
    def launch(cls, engine_args: Any, num_replicas: int = 1, *, verbose: bool = True,
               placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> AsyncVLLM:  # fmt: skip
        """Start ``num_replicas`` engines on ``engine_args`` and return the fleet."""
        fleet = cls(engine_args, num_replicas, verbose=verbose, placement_timeout_s=placement_timeout_s)
        fleet._launch()
        return fleet

    @classmethod
    def from_pretrained(cls, model_name: str, num_devices: int | None = None, num_replicas: int = 1,
                        verbose: bool = True, compile: bool = True, enable_fp32_output: bool = False,
                        **kwargs: Any) -> AsyncVLLM:  # fmt: skip
        """The fleet on ``model_name`` (:func:`make_async_vllm_engine`)."""
        return make_async_vllm_engine(model_name=model_name, num_devices=num_devices, num_replicas=num_replicas,
                                      verbose=verbose, compile=compile, enable_fp32_output=enable_fp32_output,
                                      **kwargs)  # fmt: skip

    # ------------------------------------------------------------------ generating

    def get_engine_client(self):
        """The load-balancing client :class:`~rlpost.policies.vLLMWrapper` generates with (the
        replicas start on the first call when they are not started yet)."""
        if self._client is None:
            from transformers import AutoTokenizer

            from rlpost.policies import RemoteVLLMClient

            if not self.actors:
                self._launch()
            tokenizer = AutoTokenizer.from_pretrained(self.model_name)
            self._client = RemoteVLLMClient(list(self.actors), tokenizer=tokenizer, restartable=self.max_restarts > 0,
                                            request_timeout_s=self.request_timeout_s,
                                            worker_wait_s=self.startup_timeout_s)  # fmt: skip
        return self._client

    def get_tokenizer(self):
        return self.get_engine_client().get_tokenizer()

    def generate(self, prompts: Any = None, sampling_params: Any = None, *, prompt_token_ids: Any = None,
                 use_tqdm: bool = True, lora_request: Any = None, prompt_adapter_request: Any = None,
                 guided_options_request: Any = None, timeout_seconds: float | None = None,
                 actor_index: int | None = None) -> Any:  # fmt: skip
        """vLLM's ``LLM.generate`` on the fleet: one ``RequestOutput`` per prompt (spread over the
        replicas, in prompt order; a lone prompt gives one). ``prompt_token_ids`` (one list of ids,
        or a list of them) replaces ``prompts``; ``actor_index`` sends everything to one replica;
        ``use_tqdm`` has no effect."""
        import ray

        if lora_request is not None:
            raise ValueError("AsyncVLLM serves the weights its sender sends: lora_request is not supported")
        if prompt_adapter_request is not None or guided_options_request is not None:
            raise ValueError("AsyncVLLM.generate: prompt_adapter_request and guided_options_request are not supported "
                             "(vLLM dropped them); put guided decoding in sampling_params")  # fmt: skip
        single, items = _prompt_list(prompts, prompt_token_ids)
        client = self.get_engine_client()
        timeout = timeout_seconds if timeout_seconds is not None else self.request_timeout_s
        replicas = [actor_index] if actor_index is not None else list(range(len(self.actors)))
        shares = {i: items[k :: len(replicas)] for k, i in enumerate(replicas)}
        refs = {
            i: self.actors[i].generate_outputs.remote(share, sampling_params) for i, share in shares.items() if share
        }
        outputs: dict[int, list] = {}
        for i, ref in refs.items():
            try:
                outputs[i] = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayActorError:  # the replica died: another one (or its restart) serves it
                outputs[i] = client.call("generate_outputs", shares[i], sampling_params)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"AsyncVLLM: replica {i} did not generate within {timeout:.0f} s") from None
        ordered = [None] * len(items)
        for k, i in enumerate(replicas):
            ordered[k :: len(replicas)] = outputs.get(i, [])
        return ordered[0] if single else ordered

    def get_random_actor_index(self) -> int:
        import random

        return random.randrange(len(self.actors))

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:  # fmt: skip
        """``method`` on every model worker of every replica; returns one Ray future per replica."""
        return [actor.collective_rpc.remote(method, timeout, args, kwargs) for actor in self.actors]

    def reset_prefix_cache(self) -> None:
        """Drop every replica's cached KV prefixes (no-op with prefix caching off); blocks held by
        running requests stay, with one warning. Weight updates need no call of this."""
        import ray

        if self.engine_kwargs.get("enable_prefix_caching") is False:
            return
        indices = sorted(self._replicas)
        refs = [self._replicas[i].reset_prefix_cache.remote() for i in indices]
        try:
            results = ray.get(refs, timeout=self.request_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"AsyncVLLM.reset_prefix_cache: the replicas did not answer within {self.request_timeout_s:.0f} s"
            ) from None
        refused = [i for i, done in zip(indices, results) if done is False]
        if refused:
            log.warning("AsyncVLLM.reset_prefix_cache: replica(s) %s could not drop every cached block (running "
                        "requests hold some); those prefixes go when the requests end", refused)  # fmt: skip

    # ------------------------------------------------------------------ weight sync (RLvLLMEngine)

    def get_tp_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size") or 1)

    def get_num_replicas(self) -> int:
        return self.num_replicas

    def get_master_address(self) -> str:
        """Where the weight group's store listens, as the replicas dial it: this node's address on
        a Ray cluster (replicas may run on other nodes), else 127.0.0.1. Deviation: TorchRL's
        returns "localhost", which replicas on other nodes cannot reach."""
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

    def get_master_port(self) -> int:
        """A free port for the weight group's store, the same on every call."""
        if self._master_port is None:
            import socket

            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                self._master_port = sock.getsockname()[1]
        return self._master_port

    def get_model_metadata(self) -> dict:
        """TorchRL's returns {} (the trainer's model gives it: ``get_model_metadata(model)``)."""
        return {}

    def init_weight_update_group(self, *, timeout_s: float = 120.0) -> None:
        """Form the weight group of this process and every started replica (a
        :class:`~rlpost.collect.weight_sync.VLLMWeightSyncScheme` sender: a restarted replica
        rejoins at the next update). ``timeout_s`` (rlpost's) bounds each step."""
        if not self.actors:
            raise RuntimeError("AsyncVLLM service must be launched before initializing weight update group")
        if self._weight_sender is not None:
            self._weight_sender.shutdown()
        scheme = VLLMWeightSyncScheme(self.get_master_address(), self.get_master_port(), self.get_tp_size(),
                                      len(self.actors), strategy="state_dict", timeout_s=timeout_s)  # fmt: skip
        self._weight_sender = scheme.create_sender()
        self._weight_sender.init_all_workers_group(vllm_engine=self)

    def update_weights(self, weights: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> int | None:
        """Send ``weights`` (``(name, tensor)`` pairs, as TorchRL takes them; or a state_dict, a
        module, a TensorDict) to every replica; returns the new version once each serves them
        (None, with a warning, for no weights)."""
        import torch

        if self._weight_sender is None:
            raise RuntimeError("AsyncVLLM has no weight group. Call init_weight_update_group first.")
        if not isinstance(weights, torch.nn.Module) and not hasattr(weights, "flatten_keys"):
            weights = dict(weights)  # (name, tensor) pairs or a state_dict
            if not weights:
                log.warning("AsyncVLLM.update_weights: no weights given; nothing sent")
                return None
        return self._weight_sender.update_weights(weights)

    def get_versions(self) -> list[int]:
        """The weights version each replica serves."""
        import ray

        return [int(v) for v in ray.get([a.get_version.remote() for a in self.actors], timeout=self.request_timeout_s)]

    # ------------------------------------------------------------------ ending

    def shutdown(self) -> None:
        """End every replica (their engines stop with them)."""
        self._client = None
        if self._weight_sender is not None:
            self._weight_sender.shutdown()
            self._weight_sender = None
        for index in list(self._replicas):
            self.stop_replica(index)

    def __repr__(self) -> str:
        return f"AsyncVLLM(model={self.model_name!r}, num_replicas={self.num_replicas}, started={bool(self.actors)})"


def make_async_vllm_engine(*, model_name: str, num_devices: int | None = None, num_replicas: int = 1,
                           verbose: bool = True, compile: bool = True, enable_fp32_output: bool = False,
                           tensor_parallel_size: int | None = None, data_parallel_size: int | None = None,
                           pipeline_parallel_size: int | None = None, **kwargs: Any) -> AsyncVLLM:  # fmt: skip
    """Start an :class:`AsyncVLLM` fleet, each replica on ``num_devices`` GPUs (tensor parallel;
    none on CPU). ``**kwargs``: ``vllm.LLM`` arguments, ``kv_cache_space_gb``, ``num_cpus`` per
    replica (default 1) and ``placement_timeout_s``."""
    del compile  # vLLM's own compilation setting is kept
    if enable_fp32_output:
        raise ValueError(
            "enable_fp32_output: rlpost does not patch vLLM's models; pass dtype='float32' for float32 log-probs"
        )
    if (data_parallel_size or 1) > 1 or (pipeline_parallel_size or 1) > 1:
        raise ValueError("AsyncVLLM scales with num_replicas: data_parallel_size and pipeline_parallel_size must be 1")
    if tensor_parallel_size is not None and num_devices is not None and tensor_parallel_size != num_devices:
        raise ValueError(f"tensor_parallel_size must be set to {num_devices}")
    devices = tensor_parallel_size if tensor_parallel_size is not None else num_devices
    if devices is not None:
        kwargs["tensor_parallel_size"] = devices
    placement_timeout_s = kwargs.pop("placement_timeout_s", PLACEMENT_TIMEOUT_S)
    return AsyncVLLM.launch({"model": model_name, **kwargs}, num_replicas, verbose=verbose,
                            placement_timeout_s=placement_timeout_s)  # fmt: skip


def _engine_kwargs(engine_args: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments from vLLM's (Async)EngineArgs (the fields set to other than their
    default) or a dict."""
    if isinstance(engine_args, dict):
        kwargs = dict(engine_args)
    elif dataclasses.is_dataclass(engine_args):
        kwargs = {}
        for field in dataclasses.fields(engine_args):
            value = getattr(engine_args, field.name)
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            if field.name == "model" or value != default:
                kwargs[field.name] = value
        kwargs.pop("worker_extension_cls", None)  # the replicas use rlpost's
    else:
        raise TypeError(
            f"AsyncVLLM takes vLLM's AsyncEngineArgs or a dict of engine arguments, got {type(engine_args).__name__}"
        )
    if not kwargs.get("model"):
        raise ValueError("AsyncVLLM: the engine arguments name no model (model=...)")
    return kwargs


def _dtype_name(dtype: Any) -> str:
    """A torch dtype or its name as the name ``make_vllm_worker`` takes ("auto" stays)."""
    return str(dtype).removeprefix("torch.")


def _prompt_list(prompts: Any, prompt_token_ids: Any) -> tuple[bool, list]:
    """(whether one prompt was given, the prompts as vLLM takes them)."""
    if prompt_token_ids is not None:
        if prompts is not None:
            raise ValueError("AsyncVLLM.generate takes prompts or prompt_token_ids, not both")
        single = bool(prompt_token_ids) and isinstance(prompt_token_ids[0], int)
        ids = [prompt_token_ids] if single else prompt_token_ids
        return single, [{"prompt_token_ids": list(map(int, row))} for row in ids]
    if prompts is None:
        raise ValueError("AsyncVLLM.generate needs prompts or prompt_token_ids")
    if isinstance(prompts, (str, dict)):
        return True, [prompts]
    return False, list(prompts)
