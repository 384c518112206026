"""vLLMUpdater: push a trainer's weights to vLLM workers over the versioned bus (TorchRL's name).

A collector's ``weight_updater``: ``update_policy_weights_(weights)`` publishes them as version
``v + 1`` on a :class:`~rlpost.transport.TorchWeightPublisher` while every worker
(:func:`~rlpost.actors.vllm_workers.make_vllm_worker`, given or found on the collector's policy)
receives and reloads them in place; the first push forms the bus. The ``learner`` actor publishes
through it too (:meth:`publish`; ``wait=False`` under ``weight_sync.train_during_reload``), and
calls :meth:`set_workers` after a worker restart (the bus's next generation).

Every bus step and worker call is bounded by ``timeout_s``: a bus failure raises
:class:`~rlpost.transport.WeightSyncError`, a silent worker :class:`WorkerTimeout`, a dead one
Ray's error; every worker call of a push is waited for before the first failure is raised, so
none is left running unobserved.

A peft model (alone or in a TransformersWrapper) is sent as TorchRL sends it: base names, each
adapted weight merged (``W + scale * B @ A``). Deviations: the trained model is not changed
(TorchRL calls ``merge_and_unload()`` on it); versions are counted here (and stamped by the
workers); a push takes any named tensors, not only TorchRL's ``TensorDict``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rlpost.policies.remote_client import is_local_worker, is_remote_worker
from rlpost.transport.bucketing import StreamedTensors
from rlpost.transport.bus_publisher import TorchWeightPublisher
from rlpost.transport.bus_types import NamedTensors, PublishStats, WeightSyncError

# A worker call may finish this long after the bus's own timeout (its reload follows the receive).
_WORKER_GRACE_S = 30.0


class WorkerTimeout(WeightSyncError, TimeoutError):
    """A worker did not answer a weight-update call within the updater's bound."""


def get_model_metadata(model: Any) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """``{name: (dtype, shape)}`` of a module's (or a state_dict's / TensorDict's) tensors: what
    :meth:`vLLMUpdater.init` takes to check each push (TorchRL's ``get_model_metadata``). For a
    peft model, those of its merged weights: the base model's names (nothing is merged to tell)."""
    weights = _weights_to_send(model)
    if isinstance(weights, StreamedTensors):
        return {name: (dtype, torch.Size(shape)) for name, dtype, shape in weights.specs}
    return {name: (tensor.dtype, tensor.shape) for name, tensor in weights}


def peft_merged_weights(model: torch.nn.Module) -> StreamedTensors:
    """What a push of the peft ``model`` sends: its base model's tensors under their names, each
    adapted weight merged (``W + scale * B @ A``, :func:`rlpost.policies.lora.merged_tensors`) in
    the base dtype.

    Deviation: the merge is never written into the model (TorchRL's ``merge_and_unload()``
    would fold the adapter in and drop it) nor made on a copy (TorchRL deep-copies the whole
    model per sync): merged tensors are streamed while the bus sends them, so a push adds about
    one bucket of memory (``bucket_mb``, two in flight)."""
    from rlpost.policies import lora

    specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in lora.merged_tensors(model, merge=False))

    @torch.no_grad()
    def produce():
        for name, tensor in lora.merged_tensors(model):
            yield name, tensor.detach().contiguous()

    return StreamedTensors(specs, produce)


class vLLMUpdater:  # noqa: N801  (TorchRL's name)
    """Pushes weights to vLLM workers (see the module docstring).

    Args:
        workers: the workers (Ray actor handles or in-process workers); None: those behind the
            registered collector's policy.

    Keyword Args:
        master_address, master_port: where the bus's store listens (port 0 or None: a free one).
        model_metadata: TorchRL's ``{name: (dtype, shape)}`` (:meth:`get_model_metadata`); when
            not empty, a missing, extra or reshaped tensor of a push is a ``ValueError``.
        vllm_tp_size: accepted for porting, not needed (each engine spreads over its own ranks).
        backend: "auto" (NCCL when the weights are on a GPU, else gloo), "nccl" or "gloo".
        device: where the published tensors live (the trainer's device).
        timeout_s: bound of every bus step; a worker call may take ``timeout_s + 30`` s.
        shared_memory: same-node workers read the weights from shared memory
            (:mod:`rlpost.transport.weight_bus`).

    Attributes:
        version: the last version the workers confirmed (0 before the first push).
        last_worker_infos: what each worker reported for the last push (its ``version``,
            ``receive_s``, ``load_s``), in worker order.
    """

    def __init__(
        self,
        workers: Iterable[Any] | None = None,
        *,
        master_address: str | None = "127.0.0.1",
        master_port: int | None = 0,
        model_metadata: Mapping[str, tuple[torch.dtype, torch.Size]] | None = None,
        vllm_tp_size: int | None = None,
        backend: str = "auto",
        device: str | torch.device | None = None,
        bucket_mb: float = 64,
        timeout_s: float = 120.0,
        shared_memory: bool = True,
    ) -> None:
        self.workers = list(workers) if workers is not None else None
        self.master_address, self.master_port = master_address or "127.0.0.1", master_port or 0
        self.model_metadata = dict(model_metadata) if model_metadata is not None else None
        self.vllm_tp_size, self.backend = vllm_tp_size, backend
        self.bucket_mb, self.timeout_s, self.shared_memory = bucket_mb, timeout_s, shared_memory
        self._device = device
        self.publisher: TorchWeightPublisher | None = None
        self.version = 0
        self.last_worker_infos: list[dict] = []
        self.collector = None
        self._unconfirmed: tuple[list[Any], int] | None = None  # (the workers' calls, version)

    get_model_metadata = staticmethod(get_model_metadata)  # TorchRL has it in both places

    @property
    def device(self) -> torch.device:
        """Where published tensors should live (the bus's device once it exists)."""
        if self.publisher is not None:
            return self.publisher.device
        return torch.device(self._device if self._device is not None else "cpu")

    def register_collector(self, collector: Any) -> None:
        """Called by the collector: its policy's workers are the default targets."""
        self.collector = collector

    def _targets(self) -> list[Any]:
        if self.workers is not None:
            return self.workers
        policy = getattr(self.collector, "policy", None)
        model = getattr(policy, "model", None)
        if is_local_worker(model) or is_remote_worker(model):  # vLLMWrapper(make_vllm_worker(...))
            handles = [model]
        else:  # a wrapper on several workers' load-balancing client
            handles = getattr(getattr(policy, "client", None), "handles", None)
        if not handles:
            raise ValueError(
                "vLLMUpdater has no workers: pass them (make_vllm_worker's) or use a collector whose policy is a "
                "vLLMWrapper on such workers"
            )
        self.workers = list(handles)
        return self.workers

    def init(self, model_metadata: Any = None) -> None:
        """Form the bus with every worker (done by the first push; ``model_metadata`` is not
        needed: the bus sends each layout); versions continue from the highest the workers serve."""
        workers = self._targets()
        self._unconfirmed = None
        if self.publisher is not None:
            self.publisher.close()
        self.publisher = TorchWeightPublisher(
            1 + len(workers), host=self.master_address, port=self.master_port, backend=self.backend,
            device=self._device, bucket_mb=self.bucket_mb, timeout_s=self.timeout_s, shared_memory=self.shared_memory,
        )  # fmt: skip
        self._join_workers()
        self.version = max([self.version, *map(int, self._wait([self._call(w, "get_version") for w in workers]))])

    def set_workers(self, workers: Iterable[Any]) -> int:
        """Use these workers from now on (after a restart): returns the bus's next generation."""
        self.workers = list(workers)
        self._unconfirmed = None  # the old set's calls end with the old generation
        if self.publisher is None:
            self.init()
        else:
            self.publisher.reform(1 + len(self.workers))
            self._join_workers()
        return self.publisher.generation

    def _join_workers(self) -> None:
        spec = dataclasses.asdict(self.publisher.spec)
        self._wait([self._call(worker, "join_bus", spec, rank) for rank, worker in enumerate(self.workers, start=1)])

    def workers_serve_lora(self) -> list[bool]:
        """Whether each worker's engine serves a LoRA adapter (then a publish sends the adapter)."""
        return [bool(served) for served in self._wait([self._call(w, "serves_lora") for w in self._targets()])]

    def push_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Publish ``weights`` as ``version`` (default: the last + 1) and return it once every
        worker serves them; a peft model sends :func:`peft_merged_weights`."""
        if weights is None:
            raise ValueError("push_weights needs the weights: a module, a state_dict or a TensorDict of parameters")
        if self.publisher is None:
            self.init()
        version = self.version + 1 if version is None else int(version)
        named = _weights_to_send(weights)
        if self.model_metadata:  # {} (an engine's, TorchRL's "not known"): nothing to check against
            _check_metadata(named, self.model_metadata)
        self.publish(named, version)
        return version

    def publish(self, named_tensors: NamedTensors, version: int, *, wait: bool = True) -> PublishStats:
        """Send ``(name, tensor)`` pairs as ``version``; returns once every worker serves it.

        ``wait=False`` returns once the bytes are sent (the caller may change its tensors) and
        leaves the reload to :meth:`confirm`, which the next publish calls first; until then
        :attr:`version` and :attr:`last_worker_infos` describe the update before.
        """
        self.confirm()
        if self.publisher is None:
            self.init()
        deadline = time.monotonic() + self.timeout_s + _WORKER_GRACE_S
        pending = [self._call(worker, "update_weights", self.timeout_s) for worker in self.workers]
        try:
            stats = self.publisher.publish(named_tensors, version, wait=False)
        except Exception as err:  # the workers' calls are still waited for, then the bus's error raised
            self._settle(pending, deadline, version, err)
            raise
        self._unconfirmed = (pending, version)
        if wait:
            self.confirm(deadline)
        return stats

    @property
    def unconfirmed_version(self) -> int | None:
        """The version that ``publish(wait=False)`` sent and no :meth:`confirm` has collected."""
        return self._unconfirmed[1] if self._unconfirmed is not None else None

    def confirm(self, deadline: float | None = None) -> None:
        """Wait (until ``deadline``, default ``timeout_s + 30`` s) for every worker to serve the
        version ``publish(wait=False)`` sent, then record it; a no-op when there is none."""
        if self._unconfirmed is None:
            return
        (pending, version), self._unconfirmed = self._unconfirmed, None
        failure = None
        try:
            self.publisher.confirm()
        except Exception as err:
            failure = err
        self._settle(pending, deadline, version, failure)

    def _settle(self, pending: list[Any], deadline: float | None, version: int, failure: Exception | None) -> None:
        """Wait for the workers' update calls of ``version``; raise the bus's ``failure``
        first (the workers' own error follows as its cause), else theirs."""
        try:
            infos = self._wait(pending, deadline)
        except Exception as err:
            if failure is None:
                raise
            raise failure from err
        if failure is not None:
            raise failure
        served = {int(info["version"]) for info in infos}
        if served != {version}:
            raise RuntimeError(f"vLLMUpdater: the workers report versions {sorted(served)} after publishing {version}")
        self.version, self.last_worker_infos = version, [dict(info) for info in infos]

    def __call__(self, weights: Any, **kwargs: Any) -> int:
        return self.push_weights(weights, **kwargs)

    # ------------------------------------------------------------------ worker calls

    def _call(self, worker: Any, method: str, *args: Any) -> Any:
        """Start ``worker.method(*args)``: a Ray call, or a thread for an in-process worker (the
        publisher must run while the worker receives)."""
        if type(worker).__name__ == "ActorHandle":  # a Ray actor: the call runs there
            return getattr(worker, method).remote(*args)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = getattr(worker, method)(*args)
            except BaseException as err:  # handed to the caller in _wait
                result["error"] = err

        thread = threading.Thread(target=run, name=f"vllm-updater-{method}", daemon=True)
        thread.start()
        return thread, result

    def _wait(self, pending: list[Any], deadline: float | None = None) -> list[Any]:
        """Every call's result, all waited for (one shared ``deadline``) before the first failure is raised."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s + _WORKER_GRACE_S
        out, failure = [], None
        for index, item in enumerate(pending):
            try:
                out.append(self._result(item, index, max(0.0, deadline - time.monotonic())))
            except Exception as err:
                out.append(None)
                failure = failure or err
        if failure is not None:
            raise failure
        return out

    def _result(self, item: Any, index: int, wait_s: float) -> Any:
        bound = self.timeout_s + _WORKER_GRACE_S
        late = WorkerTimeout(
            f"vLLMUpdater: worker {index} did not answer within {bound:.0f} s",
            generation=getattr(self.publisher, "generation", None),
            peers=[index + 1],
            elapsed_s=bound,
        )
        if not isinstance(item, tuple):
            import ray
            from ray.exceptions import GetTimeoutError

            try:
                return ray.get(item, timeout=wait_s)
            except GetTimeoutError:
                raise late from None
        thread, result = item
        thread.join(wait_s)
        if thread.is_alive():
            raise late
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def close(self) -> None:
        self._unconfirmed = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def __repr__(self) -> str:
        count = "?" if self.workers is None else len(self.workers)
        return f"vLLMUpdater(workers={count}, version={self.version})"


def _weights_to_send(weights: Any) -> list[tuple[str, torch.Tensor]] | StreamedTensors:
    """What a push of ``weights`` sends: a peft model's merged weights (given itself or inside a
    wrapper), else :func:`_named_tensors`."""
    model = _unwrapped(weights)
    if _is_peft_model(model):
        return peft_merged_weights(model)
    return _named_tensors(model)


def _unwrapped(weights: Any) -> Any:
    """A TransformersWrapper's model (the names the engine loads are its model's, without the
    wrapper's ``model.`` prefix); anything else as it is."""
    from rlpost.policies import LLMWrapperBase

    if isinstance(weights, LLMWrapperBase) and isinstance(getattr(weights, "model", None), torch.nn.Module):
        return weights.model
    return weights


def _is_peft_model(weights: Any) -> bool:
    """Whether ``weights`` is a ``peft.PeftModel`` (without importing peft: its maker did)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(weights, peft.PeftModel)


def _named_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module, mapping or TensorDict (nested keys joined by ".")."""
    weights = _unwrapped(weights)
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if hasattr(weights, "flatten_keys") and hasattr(weights, "items"):
        weights = weights.flatten_keys(".").to_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(f"push_weights takes a module, a state_dict or a TensorDict, got {type(weights).__name__}")
    return [(str(name), tensor.detach().contiguous()) for name, tensor in weights.items()]


def _check_metadata(named: list[tuple[str, torch.Tensor]] | StreamedTensors, metadata: Mapping[str, Any]) -> None:
    """Raise a ValueError naming what differs between the weights and ``model_metadata``."""
    if isinstance(named, StreamedTensors):
        got = {name: tuple(shape) for name, _, shape in named.specs}
    else:
        got = {name: tuple(tensor.shape) for name, tensor in named}
    want = {name: tuple(shape) for name, (_, shape) in metadata.items()}
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    reshaped = sorted(name for name in want.keys() & got.keys() if want[name] != got[name])
    if missing or extra or reshaped:
        raise ValueError(
            f"vLLMUpdater: the weights do not match model_metadata: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"other shape {[(n, got[n], want[n]) for n in reshaped[:5]]}"
        )
