"""The buffer actor on a real local Ray cluster through its one client, RayBuffer: batching,
backpressure, staleness, a dead actor and a silent one; and LocalBuffer in a script's own
RayReplayBuffer (TorchRL's API)."""

import os
import signal
import threading
import time

import pytest

from rlpost.actors.buffer import BufferSettings, start_buffer
from rlpost.runtime.actors import ActorLost, CallTimeout, actor_record
from rlpost.transport.buffer import BufferLost, BufferTimeout, RayBuffer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def groups(versions, start=0):
    return [{"prompt_id": start + i, "policy_version": v, "tokens": list(range(8))} for i, v in enumerate(versions)]


def test_named_actor_batched_round_trip(ray_cluster):
    buf = start_buffer(BufferSettings(capacity=1000, max_staleness=None), name="buffer-roundtrip")
    assert ray_cluster.get_actor("buffer-roundtrip") is not None
    buf.put(groups([0] * 500), timeout_s=10)
    got = buf.get(500, timeout_s=10)
    assert [g["prompt_id"] for g in got] == list(range(500))
    assert buf.stats().num_got == 500


def test_the_run_buffer_has_the_group_type_loaded_before_the_first_put(ray_cluster):
    """The first put's unpickling must not import rlpost.data (tensordict): that import cost a
    tiny async run's first step 1.5 s."""
    import sys

    buf = start_buffer(BufferSettings(capacity=4, max_staleness=None), name="buffer-preload")
    loaded = ray_cluster.get(buf.handle.__ray_call__.remote(lambda self: "rlpost.data.samples" in sys.modules))
    assert loaded is True


def test_backpressure_and_staleness_through_the_actor(ray_cluster):
    buf = start_buffer(BufferSettings(capacity=2, max_staleness=1), name="buffer-pressure")
    buf.put(groups([0, 0]), timeout_s=5)
    # A producer blocked by backpressure inside the actor must not block the consumer's get.
    blocked = threading.Thread(target=buf.put, args=(groups([2, 2], start=2), 20))
    blocked.start()
    time.sleep(0.5)
    assert blocked.is_alive()
    got = buf.get(2, timeout_s=5, current_version=1)
    assert [g["prompt_id"] for g in got] == [0, 1]
    blocked.join(timeout=10)
    assert not blocked.is_alive()
    with pytest.raises(BufferTimeout, match="buffer full"):
        buf.put(groups([0]), timeout_s=0.3)
    buf.drop_stale(current_version=2)  # nothing stale: versions 2 vs 2
    assert buf.stats().size == 2
    with pytest.raises(BufferTimeout):  # both are now 2 versions behind: dropped, nothing to get
        buf.get(2, timeout_s=0.5, current_version=4)
    assert buf.stats().num_dropped_stale == 2


def test_reservations_through_the_actor(ray_cluster):
    buf = start_buffer(BufferSettings(capacity=4, max_staleness=None), name="buffer-reserve")
    assert buf.reserve(3, timeout_s=1, producer="env-pool-0") is True
    assert buf.reserve(3, timeout_s=0.2, producer="env-pool-1") is False  # room held for env-pool-0
    buf.put(groups([0, 0, 0]), timeout_s=1, producer="env-pool-0")
    buf.get(3, timeout_s=1)
    assert buf.reserve(3, timeout_s=1, producer="env-pool-1") is True  # released by its put


def test_get_after_staleness_drop_times_out_and_counts(ray_cluster):
    buf = start_buffer(BufferSettings(capacity=4, max_staleness=0), name="buffer-stale")
    buf.put(groups([1, 1, 2]), timeout_s=5)
    with pytest.raises(BufferTimeout):
        buf.get(2, timeout_s=0.5, current_version=2)
    stats = buf.stats()
    assert stats.num_dropped_stale == 2 and stats.size == 1


def test_dead_actor_is_an_error_not_a_hang(ray_cluster):
    import ray

    buf = start_buffer(BufferSettings(capacity=4, max_staleness=None), name="buffer-dead")
    ray.kill(buf.handle)
    start = time.monotonic()
    with pytest.raises(BufferLost, match="the buffer actor died") as lost:
        buf.get(1, timeout_s=1)
    assert time.monotonic() - start < 5  # not restarted by Ray: the first call says so
    assert isinstance(lost.value, ActorLost) and lost.value.name == "buffer-dead"  # the supervisor's error
    assert not buf.alive()


def test_a_script_holds_a_local_buffer_in_its_own_ray_replay_buffer(ray_cluster):
    """LocalBuffer through TorchRL's API in a RayReplayBuffer: extend / sample, the buffer's own
    wait and the call's own bound."""
    from rlpost.data import RayReplayBuffer
    from rlpost.transport.buffer import LocalBuffer

    own = RayReplayBuffer(replay_buffer_cls=LocalBuffer, capacity=4, batch_size=2, wait_s=0.5, timeout_s=30)
    try:
        own.extend(groups([0, 0]))
        assert [g["prompt_id"] for g in own.sample()] == [0, 1]
        with pytest.raises(BufferTimeout, match="waited 0.5s for 2 groups"):  # empty: waits, then says so
            own.sample()
        with pytest.raises(TimeoutError, match="take did not return within 1 s"):  # the call's own bound
            own.call("take", 1, 5.0, timeout_s=1)
    finally:
        own.close()


def test_the_client_maps_a_wait_a_silence_and_a_death(ray_cluster):
    """The buffer's own wait stays a BufferTimeout; an actor that does not answer within the
    call's bound is a CallTimeout and a dead one an ActorLost, named, as the supervisor expects
    of every client."""
    buf = start_buffer(BufferSettings(capacity=4, max_staleness=None), name="buffer-client")
    with pytest.raises(BufferTimeout, match="waited 0.3s for 1 groups"):  # the buffer's own wait: not a silence
        buf.take(1, timeout_s=0.3)
    assert buf.alive() and buf.names == ["buffer-client"]
    pid = int(actor_record(buf.handle)["Pid"])
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, answering nothing: a frozen process
    try:
        silent = RayBuffer(buf.handle, "buffer-client", rpc_margin_s=0.5)
        with pytest.raises(CallTimeout, match="buffer-client did not answer stats within 0.5s") as late:
            silent.stats()
        assert late.value.name == "buffer-client" and buf.alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert buf.stats().size == 0  # it answers again
    buf.kill()
    with pytest.raises(ActorLost, match="the buffer actor died"):
        buf.take(1, timeout_s=0.3)
    assert not buf.alive()
