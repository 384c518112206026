"""The buffer actor on a real local Ray cluster: batching, backpressure, staleness, a dead actor."""

import time

import pytest

from rlpost.actors.buffer import BufferSettings, start_buffer
from rlpost.transport.buffer import BufferLost, BufferTimeout

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


def test_backpressure_and_staleness_through_the_actor(ray_cluster):
    import ray

    buf = start_buffer(BufferSettings(capacity=2, max_staleness=1), name="buffer-pressure")
    buf.put(groups([0, 0]), timeout_s=5)
    # A producer blocked by backpressure inside the actor must not block the consumer's get.
    blocked = buf.handle.put.remote(groups([2, 2], start=2), 20)
    time.sleep(0.5)
    ready, _ = ray.wait([blocked], timeout=0.1)
    assert not ready
    got = buf.get(2, timeout_s=5, current_version=1)
    assert [g["prompt_id"] for g in got] == [0, 1]
    ray.get(blocked, timeout=10)
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
    with pytest.raises(BufferLost, match="the buffer actor died"):
        buf.get(1, timeout_s=1)
    assert time.monotonic() - start < 30
