"""The learner's Ray actor (rlpost.actors.learner.actor) on the real tiny model: it forms the weight
bus with a worker and forwards publishing, scoring and the version to its learner."""

from __future__ import annotations

import pytest
import torch

from rlpost.actors.learner import Learner, start_learner
from tests.integration.actors.learner.test_learner import make_cfg

pytestmark = pytest.mark.integration


def test_learner_actor_publishes_on_the_torch_bus(ray_cluster, tiny_model_path, prompt_ids):
    """The learner actor's vLLMUpdater forms the bus with a worker actor and drives its receive."""

    class BusWorker:  # the weight side of an inference worker, without an engine
        def __init__(self):
            self.receiver, self.update, self.version = None, None, 0

        def join_bus(self, spec, rank):
            from rlpost.transport.weight_bus import BusSpec, TorchWeightReceiver

            self.receiver = TorchWeightReceiver(BusSpec(**spec), rank)
            return rank

        def update_weights(self, timeout_s):
            self.update = self.receiver.receive(timeout_s)
            self.version = self.update.version
            return {"version": self.version, "receive_s": 0.0, "load_s": 0.25}

        def get_version(self):
            return self.version

        def received(self):
            return self.update.version, {name: t.clone() for name, t in self.update.tensors.items()}

    cfg = make_cfg(tiny_model_path, resources={"learner": {"num_cpus": 0.5, "num_threads": 2}})
    actor = start_learner(cfg, namespace="rlpost-test-learner", num_cpus=0)
    worker = ray_cluster.remote(BusWorker).options(num_cpus=0).remote()
    try:
        assert ray_cluster.get(actor.connect_workers.remote([worker], "127.0.0.1", "gloo", 1, 30.0), timeout=120) == 0
        stats = ray_cluster.get(actor.publish.remote(), timeout=90)
        assert stats["weight_load_s"] == 0.25  # the worker's reload time comes back with the stats
        received = {"update": ray_cluster.get(worker.received.remote(), timeout=60)}
        assert ray_cluster.get(actor.set_workers.remote([worker]), timeout=120) == 1  # the next generation
        assert ray_cluster.get(actor.publish.remote(), timeout=90)["policy_version"] == 0  # same version again
        # not waited for: back once sent; the confirmation (the worker's reload) is collected later
        assert ray_cluster.get(actor.publish.remote(False), timeout=90)["policy_version"] == 0
        assert ray_cluster.get(actor.confirm_publish.remote(), timeout=90)["weight_load_s"] == 0.25
        local = Learner(cfg)
        version, tensors = received["update"]
        assert version == stats["policy_version"] == 0 and stats["bytes"] > 0
        expected = dict(local.named_parameters_for_sync())
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)  # bit for bit
        probe = [prompt_ids + [40, 41]]
        assert ray_cluster.get(actor.score.remote(probe), timeout=60) == local.score(probe)
        assert ray_cluster.get(actor.policy_version.remote(), timeout=60) == 0
        assert ray_cluster.get(actor.num_threads.remote(), timeout=60) == 2  # not Ray's 1 for its CPU share
        assert ray_cluster.get_actor("learner", namespace="rlpost-test-learner") is not None
    finally:
        ray_cluster.get(actor.close.remote(), timeout=60)
        ray_cluster.kill(actor)
        ray_cluster.kill(worker)
