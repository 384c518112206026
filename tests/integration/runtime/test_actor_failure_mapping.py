"""The clients' failure mapping on real Ray actors: who is named as lost when an actor dies."""

import time

import pytest

from rlpost.actors.calls import ActorLost
from rlpost.runtime.actors import actor_state, alive, release_names
from rlpost.service.clients import ActorClient

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


def _kill_by(way: str, ray, handle) -> None:
    """End the actor ``handle`` the way ``way`` names (each way Ray can lose an actor)."""
    import os
    import signal

    if way == "ray.kill":
        ray.kill(handle)
    elif way == "ray.kill(no_restart=False)":  # how Ray treats a process that died by a signal
        ray.kill(handle, no_restart=False)
    elif way == "SIGKILL":  # the OOM killer, a segfault
        os.kill(ray.get(handle.pid.remote(), timeout=30), signal.SIGKILL)
    elif way == "SIGTERM":  # Ray's worker exits on it
        os.kill(ray.get(handle.pid.remote(), timeout=30), signal.SIGTERM)
    elif way == "exit":  # the actor's own process exiting
        handle.exit.remote()
    else:
        raise ValueError(way)


@pytest.mark.parametrize("way", ["ray.kill", "ray.kill(no_restart=False)", "SIGKILL", "SIGTERM", "exit"])
def test_every_way_an_actor_dies_is_seen_from_rays_record_and_its_name_can_be_taken_again(ray_cluster, way):
    """Whatever ended the actor, ``alive`` says so within seconds, from the actor's state in Ray's
    control store. A name lookup alone is not enough: Ray still returns the dead actor's handle
    for its name after every way but ``ray.kill(handle)``. The supervisor's ``kill`` then frees
    the name, and a new actor takes it (what a restart does)."""
    import os

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

        def exit(self) -> None:
            os._exit(1)

    name = "dying-victim"
    client = ActorClient(name, Victim.options(name=name).remote())
    assert client.call("pid", timeout_s=60) > 0
    assert actor_state(client.handle) == "ALIVE" and client.alive()
    _kill_by(way, ray, client.handle)
    _wait_until_gone(name, client.handle)
    assert actor_state(client.handle) == "DEAD"
    with pytest.raises(ActorLost) as lost:
        client.call("pid", timeout_s=60)
    assert lost.value.name == name
    client.kill()  # what the supervisor does before it starts the role again
    # the name is released a moment after the kill (the kill is asynchronous): the starter waits
    release_names([name], timeout_s=30)
    again = ActorClient(name, Victim.options(name=name).remote())
    assert again.call("pid", timeout_s=60) > 0 and again.alive() and not client.alive()
    again.kill()
    _wait_until_gone(name, again.handle)


def test_releasing_a_name_kills_its_live_holder_and_a_free_name_is_left_as_it_is(ray_cluster):
    """A run resumed in the same driver starts its actors under the names of actors it judged
    lost, which may still be alive to Ray (a node not yet declared dead): the holder is killed and
    the name is free when ``release_names`` returns."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Holder:
        def ping(self) -> str:
            return "pong"

    first = Holder.options(name="held-name").remote()
    assert ray.get(first.ping.remote(), timeout=60) == "pong"
    start = time.monotonic()
    release_names(["held-name", "never-taken-name"], timeout_s=30)
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError):
        ray.get_actor("held-name")
    assert actor_state(first) == "DEAD"
    second = Holder.options(name="held-name").remote()
    assert ray.get(second.ping.remote(), timeout=60) == "pong"
    ray.kill(second)


def test_an_actor_that_ray_restarts_is_lost_while_restarting_and_a_failed_constructor_names_its_cause(ray_cluster):
    """RESTARTING counts as lost (nothing the process held survived); an actor whose
    constructor raises is DEAD and a call to it says why."""
    import os
    import signal

    ray = ray_cluster

    @ray.remote(num_cpus=0, max_restarts=1)
    class Restarting:
        def __init__(self):
            time.sleep(2.0 if os.environ.get("RLPOST_TEST_SLOW_START") else 0.0)

        def pid(self) -> int:
            return os.getpid()

    handle = Restarting.options(name="restarting", runtime_env={"env_vars": {"RLPOST_TEST_SLOW_START": "1"}}).remote()
    client = ActorClient("restarting", handle)
    os.kill(client.call("pid", timeout_s=60), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while actor_state(handle) != "RESTARTING":  # its constructor takes 2 s: the state is seen
        assert time.monotonic() < deadline, f"no restart 30 s after the SIGKILL: {actor_state(handle)}"
        time.sleep(0.02)
    assert not client.alive()
    while actor_state(handle) != "ALIVE":
        assert time.monotonic() < deadline, f"not restarted 30 s after the SIGKILL: {actor_state(handle)}"
        time.sleep(0.05)
    client.kill()

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self):
            raise ValueError("the model file is missing")

        def pid(self) -> int:
            return os.getpid()

    broken = ActorClient("broken", Broken.options(name="broken").remote())
    with pytest.raises(ActorLost) as lost:
        broken.call("pid", timeout_s=60)
    assert lost.value.name == "broken" and "the model file is missing" in str(lost.value)
    assert actor_state(broken.handle) == "DEAD" and not broken.alive()
    broken.kill()


def test_the_engine_client_tells_of_a_dead_worker_as_it_reissues_the_request(ray_cluster):
    """RemoteVLLMClient re-issues a request whose worker died on the next worker and reports the
    death through ``on_worker_lost`` (an env pool passes it to the controller at once)."""
    import os
    import signal

    from rlpost.policies import RemoteVLLMClient

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Scorer:
        def __init__(self, index: int):
            self.index = index

        def pid(self) -> int:
            return os.getpid()

        def score(self, token_ids, temperature):
            return [[float(self.index)] * len(ids) for ids in token_ids]

    workers = [Scorer.remote(i) for i in range(2)]
    os.kill(ray.get(workers[0].pid.remote(), timeout=60), signal.SIGKILL)
    ray.get(workers[1].pid.remote(), timeout=60)
    lost = []
    client = RemoteVLLMClient(workers, request_timeout_s=60, worker_wait_s=1)
    client.on_worker_lost = lambda index, error: lost.append((index, type(error).__name__))
    answers = {client.score([[1, 2]], temperature=1.0)[0][0] for _ in range(3)}
    assert answers == {1.0}  # every request ended on the live worker
    assert lost and lost[0][0] == 0 and all(index == 0 for index, _ in lost)
    assert client.num_reissued == len(lost)


@pytest.mark.long  # an engine with processes of its own starts in ~40 s on 2 cores
@pytest.mark.timeout(400)
def test_an_inference_actor_whose_engine_process_is_killed_ends_its_own_process(ray_cluster, tiny_model_path):
    """On a GPU vLLM runs its engine core in a child process of the inference actor. When that
    child is killed (the OOM killer's favourite: it holds the memory), the actor ends its own
    process, so the run sees a dead actor and starts a new worker, instead of an actor that
    fails every call."""
    import os
    import signal

    import psutil

    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.config import EngineConfig
    from rlpost.runtime.actors import actor_record
    from rlpost.service.clients import InferenceClient

    engine = EngineConfig(
        max_model_len=256, kv_cache_space_gb=0.25, max_num_seqs=8, enforce_eager=True, in_process=False
    )
    handle = make_vllm_worker(str(tiny_model_path), name="inference-with-processes", num_cpus=0.5,
                              engine_config=engine, dtype="float32")  # fmt: skip
    client = InferenceClient("inference-with-processes", handle)
    assert client.wait_ready(300) == 0
    children = psutil.Process(actor_record(handle)["Pid"]).children(recursive=True)
    assert children, "the engine runs in processes of its own"
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    _wait_until_gone("inference-with-processes", handle, timeout_s=30.0)
    with pytest.raises(ActorLost) as lost:
        client.wait_ready(60)
    assert lost.value.name == "inference-with-processes"
    client.kill()


def half_built_class() -> type:
    """A threaded actor's plain class whose constructor raises and whose repr needs what the
    constructor never set (as LLMCollector's did): Ray formats the error with the repr."""

    class HalfBuilt:
        def __init__(self, path: str):
            with open(path) as f:  # a relative path from another directory: FileNotFoundError
                self.rows = f.read()

        def __repr__(self) -> str:
            return f"HalfBuilt({len(self.rows)} bytes)"

        def ping(self) -> int:
            return 1

    return HalfBuilt


def test_a_constructors_error_reaches_the_driver_even_when_the_repr_fails(ray_cluster):
    """Plain ``ray.remote``: the half-built repr takes the worker down and the driver learns only
    that its process died; through ``remote_class`` (every rlpost actor) the driver's error
    names the constructor's exception."""
    from rlpost.runtime.liveness import remote_class

    ray = ray_cluster
    cls = half_built_class()
    plain = ActorClient("half-built-plain", ray.remote(cls).options(max_concurrency=4, num_cpus=0).remote("no/such"))
    with pytest.raises(ActorLost) as lost:
        plain.call("ping", timeout_s=60)
    assert "FileNotFoundError" not in str(lost.value)  # the failure mode rlpost's actors are guarded against
    watched = remote_class(cls).options(max_concurrency=4, num_cpus=0).remote("no/such")
    with pytest.raises(ActorLost) as lost:
        ActorClient("half-built", watched).call("ping", timeout_s=60)
    assert str(lost.value) == (
        "half-built died during ping: its constructor raised FileNotFoundError: [Errno 2] No such file or "
        "directory: 'no/such'"
    )


def test_an_env_pool_whose_constructor_raises_names_the_error(ray_cluster, tiny_model_path):
    """A real env pool whose dataset is not where its process looks (a relative path on a node
    started elsewhere): the driver's error is the pool's own, not a dead process."""
    from rlpost.actors.env_pool import EnvPoolSettings, start_env_pool
    from rlpost.config import load_config
    from rlpost.service.clients import EnvPoolClient

    cfg = load_config("configs/tiny-cpu.yaml", [f"model.name_or_path={tiny_model_path}", "data.task=custom",
                                                "data.dataset=./elsewhere/rows.jsonl", "data.reward_fn=x:y"])  # fmt: skip
    settings = EnvPoolSettings.from_job(cfg)
    pool = EnvPoolClient("env-pool-0", start_env_pool(settings, 0, None, None, namespace="rlpost-ctor", num_cpus=0))
    with pytest.raises(ActorLost) as lost:
        pool.wait(1.0)
    # the pool's process aborts (SIGABRT) after its creation task failed: the cause is the one it recorded
    assert str(lost.value).startswith("env-pool-0 died during wait: its constructor raised FileNotFoundError: ")
    assert "elsewhere/rows.jsonl" in str(lost.value)


def test_an_actor_that_aborts_after_recording_its_error_is_reported_with_it(ray_cluster):
    """A process that ends by a signal (SIGABRT, as a C extension's abort) after the actor
    recorded its error (as an inference worker does before it ends a process whose engine died):
    the driver's error adds that error to Ray's "worker process has died"."""
    from rlpost.runtime.liveness import remote_class

    def aborting_class() -> type:
        class Aborting:
            def fail(self) -> None:
                import os

                from rlpost.runtime.liveness import record_error

                record_error(RuntimeError("its engine's process died (EngineDeadError)"), "engine")
                os.abort()

        return Aborting

    ray = ray_cluster
    client = ActorClient("aborting", remote_class(aborting_class()).options(num_cpus=0).remote())
    with pytest.raises(ActorLost) as lost:
        client.call("fail", timeout_s=60)
    assert "aborting died during fail: The actor is dead because its worker process has died" in str(lost.value)
    assert str(lost.value).endswith(
        "(its last error: engine: RuntimeError: its engine's process died (EngineDeadError))"
    )
    assert ray is not None


def test_wait_started_tells_an_actor_up_from_one_whose_bundle_has_no_node(ray_cluster):
    """A started actor answers True; one that cannot be placed (here: a resource no node has, as
    a bundle whose node was lost) answers False as soon as ``placed()`` says so, not after the
    start's timeout; one whose constructor raises is named lost, with the constructor's error."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Up:
        pass

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self):
            raise ValueError("no such model: /nowhere")

    up = ActorClient("started-up", Up.options(name="started-up").remote())
    assert up.wait_started(60.0, placed=lambda: True)
    up.kill()

    asks = []
    unplaceable = ActorClient("started-nowhere", Up.options(resources={"a_node_that_is_gone": 1}).remote())
    start = time.monotonic()
    assert not unplaceable.wait_started(600.0, placed=lambda: asks.append(1) or len(asks) < 3)
    assert time.monotonic() - start < 10.0 and len(asks) == 3
    unplaceable.kill()

    broken = ActorClient("started-broken", Broken.remote())
    with pytest.raises(ActorLost) as lost:
        broken.wait_started(60.0, placed=lambda: True)
    assert lost.value.name == "started-broken" and "no such model: /nowhere" in str(lost.value)
