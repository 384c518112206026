"""vLLMUpdater's in-process path: workers in this process (threads), the real gloo bus."""

from __future__ import annotations

import time

import pytest
import torch

from rlpost.collect import vLLMUpdater
from rlpost.transport.weight_bus import BusSpec, TorchWeightReceiver

pytestmark = pytest.mark.integration


class BusWorker:
    """The worker side of the bus, as an in-process worker exposes it (no engine)."""

    def __init__(self, version: int = 0, reload_s: float = 0.0):
        self.version, self.receiver, self.weights, self.reload_s = version, None, {}, reload_s

    def join_bus(self, spec: dict, rank: int) -> int:
        self.receiver = TorchWeightReceiver(BusSpec(**spec), rank)
        return rank

    def update_weights(self, timeout_s: float) -> dict:
        version, tensors = self.receiver.receive(timeout_s)
        self.weights = {name: tensor.clone() for name, tensor in tensors.items()}
        time.sleep(self.reload_s)  # an engine's reload
        self.version = version
        return {"version": version, "load_s": self.reload_s}

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


def test_a_publish_that_does_not_wait_leaves_the_workers_reloading_until_confirmed():
    workers = [BusWorker(reload_s=1.5), BusWorker(reload_s=1.5)]
    updater = vLLMUpdater(workers, backend="gloo", bucket_mb=1, timeout_s=30)
    updater.init()
    model = torch.nn.Linear(4, 3)
    sent = model.weight.detach().clone()
    start = time.monotonic()
    updater.publish(list(model.state_dict().items()), 1, wait=False)
    assert time.monotonic() - start < 1.5  # back before the workers' reload ended
    assert updater.unconfirmed_version == 1 and updater.version == 0 and updater.last_worker_infos == []
    with torch.no_grad():
        model.weight.add_(1.0)  # the trainer goes on: the workers still get what was sent
    updater.confirm()
    assert updater.unconfirmed_version is None and updater.version == 1
    assert [info["load_s"] for info in updater.last_worker_infos] == [1.5, 1.5]
    assert all(w.version == 1 and torch.equal(w.weights["weight"], sent) for w in workers)
    updater.publish(list(model.state_dict().items()), 2, wait=False)
    updater.publish(list(model.state_dict().items()), 3)  # confirms version 2 first
    assert updater.version == 3 and all(w.version == 3 for w in workers)
    updater.close()


def test_no_workers_is_a_clear_error():
    with pytest.raises(ValueError, match="has no workers"):
        vLLMUpdater().push_weights(torch.nn.Linear(2, 2))
