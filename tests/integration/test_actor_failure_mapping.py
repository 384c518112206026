"""The clients' failure mapping on real Ray actors: who is named as lost when an actor dies."""

import time

import pytest

from rlpost.clients import ActorClient, ActorLost, alive

pytestmark = pytest.mark.integration


def _wait_until_gone(name: str, handle, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(name, handle):
        assert time.monotonic() < deadline, f"{name} still alive {timeout_s:.0f} s after ray.kill"
        time.sleep(0.1)


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
    # ray.kill returns before the worker is gone, and a call that reaches it meanwhile still
    # succeeds: wait until Ray no longer holds its name
    _wait_until_gone("mapping-worker", worker)
    with pytest.raises(ray.exceptions.RayActorError):  # and the process no longer answers
        ray.get(worker.work.remote(), timeout=30)
    # the caller is alive and raised because the worker it used died: no actor is named, so the
    # supervisor looks for the dead one instead of killing the caller
    with pytest.raises(ActorLost) as lost:
        caller.call("call_worker", timeout_s=60)
    assert lost.value.name is None and "an actor it used died" in str(lost.value)
    assert caller.alive()

    caller.kill()
    # a call sent before the caller is gone could still run and fail on the dead worker (an error
    # about another actor)
    _wait_until_gone("mapping-caller", caller.handle)
    with pytest.raises(ActorLost) as lost:
        caller.call("call_worker", timeout_s=60)
    assert lost.value.name == "mapping-caller"
