"""TorchRL's weight-sync scheme for vLLM, on rlpost's weight bus.

TorchRL's GRPO scripts send a trainer's weights to an :class:`~rlpost.actors.async_vllm.AsyncVLLM`
fleet like this, and so does code ported to rlpost::

    scheme = VLLMWeightSyncScheme(master_address=engine.get_master_address(),
                                  master_port=engine.get_master_port(),
                                  gpus_per_replica=engine.get_tp_size(), num_replicas=engine.num_replicas)
    sender = scheme.create_sender()
    sender.register_model(model)                        # the trainer's transformers model
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=engine)
    sender.register_collector(collector)                # its version follows each update
    sender.update_weights()                             # every replica now serves the new weights

A peft model sends its merged weights as in :mod:`rlpost.collect.weight_update`. The sender is
a :class:`~rlpost.collect.vLLMUpdater` on the fleet's replicas (rlpost's versioned bus, every step
bounded by ``timeout_s``). Before each update it reads the version each replica serves: a replica
Ray restarted (initial weights, outside the group) makes it re-form the group with every replica.
A replica lost during an update breaks it: the sender re-forms the group (waiting, bounded, for
the restart) and sends once more; a second failure raises
:class:`~rlpost.transport.WeightSyncError` (or Ray's error for a replica that stays dead), and
the next update re-forms the group first.

Deviations from TorchRL: the replicas join from the sender's ``init_all_workers_group`` (rlpost
drives both ends), so the receiver's methods do nothing; ``strategy`` is accepted and any named
tensors may be sent; ``num_replicas`` and ``gpus_per_replica`` are checked against the fleet;
``timeout_s`` and ``backend`` are rlpost's.
"""

from __future__ import annotations

import abc
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from rlpost.collect.weight_update import get_model_metadata, vLLMUpdater
from rlpost.policies.remote_client import is_local_worker, is_remote_worker
from rlpost.transport.bus_types import WeightSyncError

log = logging.getLogger("rlpost")


class RLvLLMEngine(abc.ABC):
    """A vLLM engine that takes weight updates from a trainer (TorchRL's interface; AsyncVLLM
    implements it). Trap: an engine with a prefix cache must not serve KV computed with older
    weights after an update (:meth:`reset_prefix_cache`)."""

    @abc.abstractmethod
    def get_tp_size(self) -> int:
        """The tensor-parallel size of each of the engine's replicas."""

    @abc.abstractmethod
    def get_model_metadata(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """``{name: (dtype, shape)}`` of the weights the engine takes ({} when only the trainer knows)."""

    @abc.abstractmethod
    def get_master_address(self) -> str:
        """Where the weight group's store listens, as the engine's workers dial it."""

    @abc.abstractmethod
    def get_master_port(self) -> int:
        """The port of the weight group's store."""

    @abc.abstractmethod
    def init_weight_update_group(self) -> None:
        """Form the weight group of this process (the sender) and the engine's workers."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Any:
        """Send ``(name, tensor)`` pairs and return once the engine serves them."""

    def reset_prefix_cache(self) -> None:  # noqa: B027  (optional: engines without a prefix cache)
        """Drop the engine's cached KV prefixes (they were computed with older weights)."""


def engine_workers(vllm_engine: Any) -> list:
    """The inference workers behind ``vllm_engine``: an AsyncVLLM fleet's replicas, or a worker of
    ``make_vllm_worker`` (a Ray actor or in-process)."""
    actors = getattr(vllm_engine, "actors", None)
    if actors:
        return list(actors)
    if isinstance(vllm_engine, RLvLLMEngine):
        raise RuntimeError(f"{type(vllm_engine).__name__} has no started replicas: launch it before syncing weights")
    if callable(getattr(vllm_engine, "update_weights", None)):
        return [vllm_engine]
    raise TypeError(f"expected an AsyncVLLM fleet or a make_vllm_worker worker, got {type(vllm_engine).__name__}")


REPLICA_RESTART_WAIT_S = 600.0  # how long an update waits for a replica Ray is restarting (its model loads)


def serving_versions(workers: list, timeout_s: float = REPLICA_RESTART_WAIT_S) -> list[int]:
    """The version each worker serves, waiting for the ones Ray is restarting: such a worker
    refuses calls at once (``ActorUnavailableError``) until its start is done. TimeoutError past
    ``timeout_s``; a worker that stays dead raises Ray's error."""
    import ray

    deadline = time.monotonic() + timeout_s
    versions = []
    for index, worker in enumerate(workers):
        if type(worker).__name__ != "ActorHandle":  # an in-process worker
            versions.append(int(worker.get_version()))
            continue
        while True:
            try:
                versions.append(
                    int(ray.get(worker.get_version.remote(), timeout=max(1.0, deadline - time.monotonic())))
                )
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {index} did not come back within {timeout_s:.0f} s") from None
                time.sleep(0.5)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"replica {index} did not answer within {timeout_s:.0f} s") from None
    return versions


class VLLMWeightSyncScheme:
    """Where and how weights go from a trainer to vLLM replicas (TorchRL's scheme).

    Args:
        master_address, master_port: where the group's store listens (None: 127.0.0.1, a free port).
        gpus_per_replica: GPUs of each replica (its tensor-parallel size).
        num_replicas: replicas the group expects.
        strategy: TorchRL's "tensordict" or "state_dict" (the weights may be given in either form).
        device: the trainer's GPU index (used when CUDA is available).

    Keyword Args:
        backend: "auto" (NCCL for weights on a GPU, else gloo), "nccl" or "gloo".
        timeout_s: bound of every step of an update.
    """

    def __init__(self, master_address: str | None = None, master_port: int | None = None, gpus_per_replica: int = 1,
                 num_replicas: int = 1, strategy: str = "tensordict", device: torch.device | str | int = 0, *,
                 backend: str = "auto", timeout_s: float = 120.0):  # fmt: skip
        if strategy not in ("tensordict", "state_dict"):
            raise ValueError(f"strategy must be 'tensordict' or 'state_dict', got {strategy!r}")
        self.master_address = master_address or "127.0.0.1"
        self.master_port = master_port or 0
        self.gpus_per_replica, self.num_replicas = int(gpus_per_replica), int(num_replicas)
        self.strategy_name, self.device, self.backend, self.timeout_s = strategy, device, backend, timeout_s

    def create_sender(self) -> VLLMWeightSender:
        return VLLMWeightSender(self)

    def create_receiver(self, vllm_engine: Any) -> VLLMWeightReceiver:
        return VLLMWeightReceiver(self, vllm_engine)

    def trainer_device(self) -> torch.device | None:
        """Where published tensors live: the trainer's GPU when there is one, else the CPU (None)."""
        if not torch.cuda.is_available():
            return None
        return torch.device("cuda", self.device) if isinstance(self.device, int) else torch.device(self.device)


class VLLMWeightSender:
    """Sends a trainer's weights to every replica of a fleet; see the module docstring."""

    def __init__(self, scheme: VLLMWeightSyncScheme):
        self._scheme = scheme
        self._model_ref: Any = None
        self._engine: Any = None
        self._updater: vLLMUpdater | None = None
        self._collectors: list = []
        self._regroup_next = False  # the last update failed: re-form the group before the next

    def register_model(self, model: Any) -> None:
        """The model whose weights :meth:`update_weights` sends when given none (kept by weak reference)."""
        self._model_ref = weakref.ref(model)

    def register_collector(self, collector: Any) -> None:
        """After each update, ``collector.increment_version()`` is called."""
        self._collectors.append(collector)

    def init_all_workers_group(self, model_metadata: dict | None = None, vllm_engine: Any = None) -> None:
        """Form the group of the trainer and every replica of ``vllm_engine``; each update is then
        checked against ``model_metadata`` (``{name: (dtype, shape)}``, when given)."""
        if vllm_engine is None:
            raise ValueError("init_all_workers_group needs vllm_engine= (the AsyncVLLM fleet the weights go to)")
        workers = engine_workers(vllm_engine)
        if len(workers) != self._scheme.num_replicas:
            raise ValueError(
                f"the scheme expects num_replicas={self._scheme.num_replicas} and the engine has {len(workers)} replicas"
            )
        tp_size = getattr(vllm_engine, "get_tp_size", lambda: self._scheme.gpus_per_replica)()
        if tp_size != self._scheme.gpus_per_replica:
            raise ValueError(
                f"the scheme expects gpus_per_replica={self._scheme.gpus_per_replica}, the engine has {tp_size}"
            )
        if self._updater is not None:
            self._updater.close()
        self._engine = vllm_engine
        self._updater = vLLMUpdater(
            workers, master_address=self._scheme.master_address, master_port=self._scheme.master_port,
            model_metadata=model_metadata or None, backend=self._scheme.backend,
            device=self._scheme.trainer_device(), timeout_s=self._scheme.timeout_s,
        )  # fmt: skip
        self._updater.init()

    @property
    def version(self) -> int:
        """The weights version every replica serves after the last update (0 before any)."""
        return 0 if self._updater is None else self._updater.version

    def update_weights(self, weights: Any = None) -> int:
        """Send ``weights`` (default: the registered model's) to every replica; returns the new
        version once each serves it."""
        if self._updater is None:
            raise RuntimeError("Transport not initialized. Call init_all_workers_group first.")
        if weights is None:
            model = self._model_ref() if self._model_ref is not None else None
            if model is None:
                raise RuntimeError("update_weights has no weights: pass them or register_model(model) first")
            weights = model
        version = self._push(weights)
        for collector in self._collectors:
            collector.increment_version()
        return version

    def _push(self, weights: Any) -> int:
        """Push; on a replica lost during it, re-form the group with the fleet as it is now and push once more."""
        import ray

        lost = (WeightSyncError, ray.exceptions.RayError)
        try:
            self._rejoin_restarted_replicas()
            return self._updater.push_weights(weights)
        except lost as err:
            self._regroup_next = True
            log.warning("weight sync failed (%s); re-forming the group and sending again", str(err).splitlines()[0])
        self._rejoin_restarted_replicas()
        try:
            return self._updater.push_weights(weights)
        except lost:
            self._regroup_next = True
            raise

    def _rejoin_restarted_replicas(self) -> None:
        """Re-form the group when a replica serves another version (Ray restarted it), the fleet
        changed, or the last update failed."""
        workers = engine_workers(self._engine)
        behind = [i for i, version in enumerate(serving_versions(workers)) if version != self._updater.version]
        changed = workers != self._updater.workers
        if behind:
            log.warning("weight sync: replica(s) %s serve an older version (restarted); re-forming the group", behind)
        if behind or changed or self._regroup_next:
            self._updater.set_workers(workers)
            self._regroup_next = False

    def shutdown(self) -> None:
        if self._updater is not None:
            self._updater.close()
            self._updater = None
        self._collectors.clear()


class VLLMWeightReceiver:
    """The replicas' side of the scheme (TorchRL's); nothing to do: the sender drives the replicas."""

    def __init__(self, scheme: VLLMWeightSyncScheme, vllm_engine: Any):
        self._scheme, self._vllm_engine = scheme, vllm_engine

    def init_all_workers_group(self, model_metadata: dict | None = None) -> None:
        """Nothing to do: the sender's ``init_all_workers_group`` has the replicas join."""

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Nothing to do: a replica loads each update as it arrives."""

    def poll_and_apply(self, timeout: float = 0.1) -> bool:
        """False: updates are pushed, never polled (as in TorchRL)."""
        return False


class vLLMUpdaterV2(vLLMUpdater):  # noqa: N801  (TorchRL's name)
    """TorchRL's engine-based updater: a :class:`~rlpost.collect.vLLMUpdater` on the workers of
    an :class:`RLvLLMEngine` (whose address, port and ``model_metadata`` it takes unless
    ``kwargs`` give them) or of a ``make_vllm_worker`` worker. Deviation: it sends over rlpost's
    bus rather than the engine's ``update_weights``, hence also takes ``make_vllm_worker``'s
    workers; a peft model is sent merged as :func:`~rlpost.collect.weight_update.peft_merged_weights` does.
    """

    def __init__(self, vllm_engine: Any, **kwargs: Any):
        if isinstance(vllm_engine, RLvLLMEngine):
            kwargs.setdefault("master_address", vllm_engine.get_master_address())
            kwargs.setdefault("master_port", vllm_engine.get_master_port())
            kwargs.setdefault("model_metadata", vllm_engine.get_model_metadata())
        elif not (is_remote_worker(vllm_engine) or is_local_worker(vllm_engine)):
            raise TypeError(
                "vllm_engine must implement RLvLLMEngine interface (an AsyncVLLM fleet) or be a worker of "
                f"make_vllm_worker, got {type(vllm_engine)}"
            )
        super().__init__(engine_workers(vllm_engine), **kwargs)
        self.vllm_engine = vllm_engine

    def get_tp_size(self) -> int:
        return getattr(self.vllm_engine, "get_tp_size", lambda: 1)()

    def init(self, model_metadata: Any = None) -> None:
        if model_metadata:
            self.model_metadata = dict(model_metadata)
        super().init()

    def push_weights_from_transformers(self, transformers_model: Any) -> int:
        return self.push_weights(transformers_model)

    def all_worker_ids(self) -> list[int]:
        return list(range(len(self.workers)))


__all__ = [
    "RLvLLMEngine",
    "VLLMWeightReceiver",
    "VLLMWeightSender",
    "VLLMWeightSyncScheme",
    "get_model_metadata",
    "vLLMUpdaterV2",
]
