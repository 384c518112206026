"""How the clients map Ray's failures to the supervisor's errors (Ray's own exception types)."""

import pytest
import ray

from rlpost.actors.calls import ActorLost, BusFailure, CallTimeout, Pending, classify, wait_all
from rlpost.transport.buffer import BufferLost
from rlpost.transport.weight_bus import WeightSyncError

pytestmark = pytest.mark.unit


def task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("GroupCollector.wait", "Traceback ...", cause)


def test_the_called_actor_died_or_did_not_answer():
    died = classify(ray.exceptions.ActorDiedError(), "inference-0", "generate")
    assert isinstance(died, ActorLost) and died.name == "inference-0" and "died during generate" in str(died)
    silent = classify(ray.exceptions.GetTimeoutError("timed out"), "learner", "score")
    assert isinstance(silent, CallTimeout) and silent.name == "learner"


def test_a_task_that_failed_because_another_actor_died_names_no_actor():
    lost = classify(task_error(ray.exceptions.ActorDiedError()), "env-pool-0", "wait")
    assert isinstance(lost, ActorLost) and lost.name is None
    # what ray.get raises: the task error is also an instance of its cause's class (here a
    # RayActorError), yet the called actor (the learner) is alive and must not be killed
    raised = task_error(ray.exceptions.ActorDiedError()).as_instanceof_cause()
    assert isinstance(raised, ray.exceptions.RayActorError)
    lost = classify(raised, "learner", "publish")
    assert isinstance(lost, ActorLost) and lost.name is None and "an actor it used died" in str(lost)
    gone = classify(task_error(BufferLost("the buffer actor died")), "env-pool-0", "wait")
    assert isinstance(gone, ActorLost) and gone.name is None


def test_a_failed_weight_sync_is_a_bus_failure():
    failed = classify(task_error(WeightSyncError("peer 1 did not answer", version=3)), "learner", "publish")
    assert isinstance(failed, BusFailure) and "weight sync failed in learner.publish" in str(failed)


def test_any_other_error_is_left_as_it_is():
    bug = task_error(ValueError("bad input"))
    assert classify(bug, "reference", "annotate") is bug


def test_wait_all_waits_for_every_call_and_raises_the_first_failure(monkeypatch):
    got = []

    def fake_get(ref, timeout):
        got.append(ref)
        if ref == "b":
            raise ray.exceptions.ActorDiedError()
        if ref == "d":
            raise task_error(ValueError("the actor's own error"))
        return ref.upper()

    monkeypatch.setattr(ray, "get", fake_get)
    assert wait_all([Pending("x", "m", "a"), Pending("x", "m", "c")], 1.0) == ["A", "C"]
    with pytest.raises(ActorLost, match="y died during m"):
        wait_all([Pending("x", "m", "a"), Pending("y", "m", "b"), Pending("z", "m", "c")], 1.0)
    assert got[-3:] == ["a", "b", "c"]  # the call after the failure was still waited for
    with pytest.raises(ValueError, match="the actor's own error"):  # unwrapped, its message intact
        Pending("w", "m", "d").result(1.0)
