"""The clients' failure mapping on real Ray actors: who is named as lost when an actor dies."""

import time

import pytest

from rlpost.clients import ActorClient, ActorLost

pytestmark = pytest.mark.integration


def test_only_the_actor_that_died_is_named_lost(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Worker:
        def work(self) -> int:
            return 1

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, worker):
            self.worker = worker

        def call_worker(self) -> int:
            return ray.get(self.worker.work.remote(), timeout=30)

    worker = Worker.options(name="mapping-worker").remote()
    caller = ActorClient("mapping-caller", Caller.options(name="mapping-caller").remote(worker))
    assert caller.call("call_worker", timeout_s=60) == 1

    ray.kill(worker)
    # the caller is alive and raised because the worker it used died: no actor is named, so the
    # supervisor looks for the dead one instead of killing the caller
    with pytest.raises(ActorLost) as lost:
        caller.call("call_worker", timeout_s=60)
    assert lost.value.name is None and "an actor it used died" in str(lost.value)
    assert caller.alive()

    caller.kill()
    # ray.kill returns before the actor is gone: a call sent meanwhile could still run and fail on
    # the dead worker (an error about another actor), so wait until Ray no longer holds its name
    deadline = time.monotonic() + 30
    while caller.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(ActorLost) as lost:
        caller.call("call_worker", timeout_s=60)
    assert lost.value.name == "mapping-caller"
