"""The watchdog on real Ray actors: a stopped process and a blocked thread are killed, within their
deadlines; a long call that progresses, a long wait outside the actor's work and a slow constructor
are left alone. (Each role's actors in whole runs: tests/e2e/test_frozen_actors.py.)"""

import os
import signal
import threading
import time

import pytest

from rlpost.actors import start_actor
from rlpost.config import RoleDeadlines, RoleResources, WatchdogConfig
from rlpost.runtime.actors import actor_state
from rlpost.service.watchdog import Watchdog

pytestmark = pytest.mark.integration

QUICK = RoleDeadlines(answer_s=1.5, progress_s=1.5)


def busy_class() -> type:
    """A stand-in role's plain class (defined here, so that Ray sends it by value to the workers)."""

    class Busy:
        """A stand-in role's plain class: work that progresses, work that blocks, waits that are not work."""

        def __init__(self, construct_s: float = 0.0):
            time.sleep(construct_s)  # a model loading

        def pid(self) -> int:
            return os.getpid()

        def work(self, seconds: float, progressing: bool) -> str:
            from rlpost.runtime.liveness import progress, working

            with working("generate"):
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    time.sleep(0.1)
                    if progressing:
                        progress()
            return "done"

        def block_for_ever(self) -> None:
            from rlpost.runtime.liveness import working

            with working("train_step"):
                threading.Event().wait()  # a deadlock: nothing will ever set it

        def wait(self, seconds: float) -> str:
            time.sleep(seconds)  # waiting on a peer: not the actor's own work
            return "waited"

    return Busy


def start(name: str, construct_s: float = 0.0):
    return start_actor(busy_class(), construct_s, name=name, resources=RoleResources(num_cpus=0), max_concurrency=2)


def watchdog_over(actors: dict) -> Watchdog:
    cfg = WatchdogConfig(interval_s=0.25, reference=QUICK, reward=QUICK)
    return Watchdog(cfg, lambda: list(actors.items()))


def rounds_until(dog: Watchdog, name: str, timeout_s: float) -> tuple[str | None, float]:
    """Run the watchdog's rounds until it kills ``name`` or ``timeout_s`` passes: (verdict, seconds)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        killed = dog.check()
        if name in killed:
            return killed[name], time.monotonic() - start
        time.sleep(dog.cfg.interval_s)
    return None, time.monotonic() - start


def test_a_stopped_process_is_killed_and_its_pending_call_fails(ray_cluster):
    ray = ray_cluster
    handle = start("reference")  # the role names the deadlines: answer_s 1.5
    actors = {"reference": handle}
    dog = watchdog_over(actors)
    pid = ray.get(handle.pid.remote(), timeout=60)
    assert rounds_until(dog, "reference", 3.0)[0] is None  # it answers: left alone
    call = handle.wait.remote(60)
    os.kill(pid, signal.SIGSTOP)
    try:
        why, seconds = rounds_until(dog, "reference", 10.0)
        assert why is not None and why.startswith("frozen: no answer to its heartbeat"), why
        assert 1.5 <= seconds <= 4.0
        with pytest.raises(ray.exceptions.RayActorError):  # the call waiting on it fails at once, as on a death
            ray.get(call, timeout=10)
        assert actor_state(handle) == "DEAD"
        assert dog.take_verdicts() == {"reference": why} and dog.take_verdicts() == {}
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # Ray's SIGKILL may already have ended it
        except ProcessLookupError:
            pass


def test_a_thread_blocked_inside_the_work_is_killed_as_hung(ray_cluster):
    ray = ray_cluster
    handle = start("reward")
    dog = watchdog_over({"reward": handle})
    ray.get(handle.pid.remote(), timeout=60)
    call = handle.block_for_ever.remote()
    why, seconds = rounds_until(dog, "reward", 10.0)
    assert why is not None and why.startswith("hung: its work (train_step) made no progress for"), why
    assert 1.5 <= seconds <= 4.0
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(call, timeout=10)


def test_long_progressing_work_waits_and_slow_constructors_are_left_alone(ray_cluster):
    ray = ray_cluster
    actors = {"reference": start("reference"), "reward": start("reward", construct_s=4.0)}
    dog = watchdog_over(actors)
    calls = [actors["reference"].work.remote(4.0, True), actors["reference"].wait.remote(4.0)]
    why, _ = rounds_until(dog, "reference", 5.0)
    assert why is None and dog.take_verdicts() == {}
    assert ray.get(calls, timeout=30) == ["done", "waited"]
    assert ray.get(actors["reward"].pid.remote(), timeout=30) > 0  # its 4 s constructor was not a freeze
    # the same work without progress is a hang
    actors["reference"].work.remote(10.0, False)
    why, _ = rounds_until(dog, "reference", 8.0)
    assert why is not None and why.startswith("hung"), why
    for handle in actors.values():
        ray.kill(handle)
