"""vLLMUpdater: push a trainer's weights to vLLM workers over the versioned bus (TorchRL's name).

A collector's ``weight_updater``: :meth:`LLMCollector.update_policy_weights_(weights)
<rlpost.collect.LLMCollector.update_policy_weights_>` calls :meth:`vLLMUpdater.push_weights`,
which publishes the weights as version ``v + 1`` on a weight bus
(:class:`~rlpost.transport.TorchWeightPublisher`: gloo on CPU, NCCL on GPU, in buckets) while
every worker receives and reloads them in place. The workers are those of
:func:`~rlpost.policies.make_vllm_worker` (Ray actors or in-process), given here or found on the
collector's policy. The first push forms the bus (``init``); every step is bounded by
``timeout_s`` and raises instead of hanging (:class:`~rlpost.transport.WeightSyncError` from the
bus, ``TimeoutError`` from a worker that does not answer).

Deviation from TorchRL: versions are counted here (and by the workers, which stamp each
generation with the version they serve), and a push takes any named tensors (a module, its
``state_dict``, a TensorDict of parameters) rather than TorchRL's ``TensorDict`` of weights
only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rlpost.transport.weight_bus import TorchWeightPublisher


class vLLMUpdater:  # noqa: N801  (TorchRL's name)
    """Pushes weights to vLLM workers (see the module docstring).

    Args:
        workers: the workers (Ray actor handles or in-process workers); None: those behind the
            registered collector's policy.

    Keyword Args:
        master_address, master_port: where the bus's store listens (port 0: a free one).
        backend: "auto" (NCCL when the weights are on a GPU, else gloo), "nccl" or "gloo".
        device: where the published tensors live (the trainer's device).
        bucket_mb: size of the bus's buckets.
        timeout_s: bound of every bus step and worker call.
    """

    def __init__(
        self,
        workers: Iterable[Any] | None = None,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "auto",
        device: str | torch.device | None = None,
        bucket_mb: float = 64,
        timeout_s: float = 120.0,
    ) -> None:
        self.workers = list(workers) if workers is not None else None
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.device, self.bucket_mb, self.timeout_s = device, bucket_mb, timeout_s
        self.publisher: TorchWeightPublisher | None = None
        self.version = 0
        self.collector = None

    def register_collector(self, collector: Any) -> None:
        """Called by the collector: its policy's workers are the default targets."""
        self.collector = collector

    def _targets(self) -> list[Any]:
        if self.workers is not None:
            return self.workers
        client = getattr(getattr(self.collector, "policy", None), "client", None)
        handles = getattr(client, "handles", None)
        if not handles:
            raise ValueError(
                "vLLMUpdater has no workers: pass them (make_vllm_worker's) or use a collector whose policy is a "
                "vLLMWrapper on such workers"
            )
        self.workers = list(handles)
        return self.workers

    def init(self, model_metadata: Any = None) -> None:
        """Form the bus with every worker (done by the first push; ``model_metadata`` is
        TorchRL's argument and not needed: the bus sends each update's layout). The version
        continues from the highest one the workers serve."""
        workers = self._targets()
        self.publisher = TorchWeightPublisher(
            1 + len(workers), host=self.master_address, port=self.master_port, backend=self.backend,
            device=self.device, bucket_mb=self.bucket_mb, timeout_s=self.timeout_s,
        )  # fmt: skip
        spec = dataclasses.asdict(self.publisher.spec)
        self._wait([self._call(worker, "join_bus", spec, rank) for rank, worker in enumerate(workers, start=1)])
        # continue from what the workers serve: a version below it would be refused
        self.version = max([self.version, *map(int, self._wait([self._call(w, "get_version") for w in workers]))])

    def push_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Publish ``weights`` as ``version`` (default: the last one, or the workers' at the
        first push, + 1) and return once every worker serves them; returns the version."""
        if weights is None:
            raise ValueError("push_weights needs the weights: a module, a state_dict or a TensorDict of parameters")
        if self.publisher is None:
            self.init()
        version = self.version + 1 if version is None else int(version)
        named = _named_tensors(weights)
        pending = [self._call(worker, "update_weights", self.timeout_s) for worker in self.workers]
        self.publisher.publish(named, version)
        infos = self._wait(pending)
        served = {int(info["version"]) for info in infos}
        if served != {version}:
            raise RuntimeError(f"vLLMUpdater: the workers report versions {sorted(served)} after publishing {version}")
        self.version = version
        return version

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

    def _wait(self, pending: list[Any]) -> list[Any]:
        out = []
        for item in pending:
            if not isinstance(item, tuple):
                import ray
                from ray.exceptions import GetTimeoutError

                try:
                    out.append(ray.get(item, timeout=self.timeout_s + 30))
                except GetTimeoutError:
                    raise TimeoutError(f"vLLMUpdater: a worker did not answer within {self.timeout_s + 30} s") from None
                continue
            thread, result = item
            thread.join(self.timeout_s + 30)
            if thread.is_alive():
                raise TimeoutError(f"vLLMUpdater: a worker did not answer within {self.timeout_s + 30} s")
            if "error" in result:
                raise result["error"]
            out.append(result.get("value"))
        return out

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def __repr__(self) -> str:
        count = "?" if self.workers is None else len(self.workers)
        return f"vLLMUpdater(workers={count}, version={self.version})"


def _named_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module, a mapping or a TensorDict (nested keys joined by ".")."""
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if hasattr(weights, "flatten_keys") and hasattr(weights, "items"):
        weights = weights.flatten_keys(".").to_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(f"push_weights takes a module, a state_dict or a TensorDict, got {type(weights).__name__}")
    return [(str(name), tensor.detach().contiguous()) for name, tensor in weights.items()]
