"""vLLMUpdater's in-process path: workers in this process (threads), the real gloo bus."""

from __future__ import annotations

import pytest
import torch

from rlpost.collect import vLLMUpdater
from rlpost.transport.weight_bus import BusSpec, TorchWeightReceiver

pytestmark = pytest.mark.integration


class BusWorker:
    """The worker side of the bus, as an in-process worker exposes it (no engine)."""

    def __init__(self, version: int = 0):
        self.version, self.receiver, self.weights = version, None, {}

    def join_bus(self, spec: dict, rank: int) -> int:
        self.receiver = TorchWeightReceiver(BusSpec(**spec), rank)
        return rank

    def update_weights(self, timeout_s: float) -> dict:
        version, tensors = self.receiver.receive(timeout_s)
        self.weights = {name: tensor.clone() for name, tensor in tensors.items()}
        self.version = version
        return {"version": version}

    def get_version(self) -> int:
        return self.version


def test_pushes_reach_every_worker_with_increasing_versions():
    workers = [BusWorker(version=3), BusWorker(version=5)]
    updater = vLLMUpdater(workers, backend="gloo", bucket_mb=1, timeout_s=30)
    model = torch.nn.Linear(4, 3)
    assert updater.push_weights(model) == 6  # continues after the highest version served
    for worker in workers:
        assert worker.version == 6
        assert torch.equal(worker.weights["weight"], model.weight.detach())
    with torch.no_grad():
        model.weight.add_(1.0)
    assert updater(model.state_dict()) == 7
    assert all(torch.equal(w.weights["weight"], model.weight.detach()) for w in workers)
    with pytest.raises(ValueError, match="needs the weights"):
        updater.push_weights(None)
    with pytest.raises(TypeError, match="module, a state_dict or a TensorDict"):
        updater.push_weights([1, 2])
    updater.close()


def test_no_workers_is_a_clear_error():
    with pytest.raises(ValueError, match="has no workers"):
        vLLMUpdater().push_weights(torch.nn.Linear(2, 2))
