import threading
import time

import pytest

from rlpost.transport.buffer import BufferTimeout, LocalBuffer

pytestmark = pytest.mark.unit


def groups(versions, start=0):
    return [{"prompt_id": start + i, "policy_version": v} for i, v in enumerate(versions)]


def test_batched_fifo_put_get_and_stats():
    buf = LocalBuffer(capacity=8)
    buf.put(groups([0, 0, 0]), timeout_s=1)
    got = buf.get(2, timeout_s=1)
    assert [g["prompt_id"] for g in got] == [0, 1]
    stats = buf.stats()
    assert (stats.size, stats.num_put, stats.num_got, stats.num_dropped_stale) == (1, 3, 2, 0)


def test_get_times_out_without_taking_anything():
    buf = LocalBuffer(capacity=8)
    buf.put(groups([0]), timeout_s=1)
    start = time.monotonic()
    with pytest.raises(BufferTimeout, match="waited 0.2s for 2 groups, buffer holds 1"):
        buf.get(2, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert buf.stats().size == 1  # nothing lost


def test_backpressure_blocks_producer_until_consumer_frees_space():
    buf = LocalBuffer(capacity=2)
    buf.put(groups([0, 0]), timeout_s=1)
    done = threading.Event()

    def produce():
        buf.put(groups([0, 0], start=2), timeout_s=5)
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.3)
    assert not done.is_set()  # blocked: the buffer is full
    assert [g["prompt_id"] for g in buf.get(2, timeout_s=1)] == [0, 1]
    thread.join(timeout=5)
    assert done.is_set()
    assert [g["prompt_id"] for g in buf.get(2, timeout_s=1)] == [2, 3]
    assert buf.stats().put_wait_s >= 0.25


def test_a_put_is_atomic_and_goes_in_when_one_slot_is_free():
    buf = LocalBuffer(capacity=2)
    buf.put(groups([0]), timeout_s=0.2)
    buf.put(groups([0, 0, 0], start=1), timeout_s=0.2)  # one slot free: the whole batch goes in
    assert buf.stats().size == 4
    with pytest.raises(BufferTimeout, match="none of 2 groups put"):
        buf.put(groups([0, 0], start=4), timeout_s=0.2)
    assert buf.stats().size == 4 and buf.stats().num_put == 4  # nothing of the timed-out batch


def test_replays_are_skipped_by_seq_and_takes_report_drops_and_acknowledge():
    def keyed(seqs, version=0):
        return [{"policy_version": version, "producer": "p", "seq": q} for q in seqs]

    buf = LocalBuffer(capacity=8, max_staleness=1)
    receipt = buf.put(keyed([1, 2]), timeout_s=1, producer="p", producer_state={"at": 2})
    assert (receipt.accepted, receipt.acknowledged) == (True, 0)
    buf.put(keyed([2, 3], version=3), timeout_s=1, producer="p", producer_state={"at": 3})  # 2 again: skipped
    assert buf.stats().size == 3 and buf.stats().last_seqs == {"p": 3}
    taken = buf.take(1, timeout_s=1, current_version=3, acknowledged={"p": 1})
    assert [g["seq"] for g in taken.groups] == [3]  # seqs 1 and 2 (version 0) were stale
    assert (taken.num_dropped_stale, taken.dropped_seqs) == (2, {"p": 2})
    assert buf.put([], timeout_s=1, producer="p", producer_state={"at": 3}).acknowledged == 1


def test_stale_groups_are_dropped_and_counted():
    buf = LocalBuffer(capacity=10, max_staleness=1)
    buf.put(groups([0, 1, 2, 3, 3]), timeout_s=1)
    got = buf.get(2, timeout_s=1, current_version=3)  # versions 0 and 1 are > 1 behind 3
    assert [g["policy_version"] for g in got] == [2, 3]
    assert buf.stats().num_dropped_stale == 2
    assert buf.stats().size == 1


def test_drain_returns_everything_without_counting_drops():
    buf = LocalBuffer(capacity=4, max_staleness=0)
    buf.put(groups([5, 5]), timeout_s=1)
    assert [g["prompt_id"] for g in buf.drain()] == [0, 1]
    assert buf.stats().num_dropped_stale == 0 and buf.stats().size == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LocalBuffer(0)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        LocalBuffer(1).get(0, timeout_s=1)


def test_reserve_blocks_until_a_batch_fits():
    buf = LocalBuffer(capacity=4)
    buf.put(groups([0, 0, 0]), timeout_s=1)
    assert buf.reserve(1, timeout_s=0.1) is True
    assert buf.reserve(2, timeout_s=0.1) is False
    threading.Timer(0.2, lambda: buf.get(2, timeout_s=1)).start()
    assert buf.reserve(2, timeout_s=5) is True
    buf.drain()
    assert buf.reserve(10, timeout_s=0.1) is True  # capped at the capacity: an empty buffer fits


def test_two_producers_never_reserve_the_same_room():
    buf = LocalBuffer(capacity=4)
    assert buf.reserve(3, timeout_s=0.1, producer="env-pool-0") is True
    assert buf.reserve(3, timeout_s=0.1, producer="env-pool-1") is False  # 1 slot left, not 3
    assert buf.reserve(1, timeout_s=0.1, producer="env-pool-1") is True
    assert buf.reserve(3, timeout_s=0.1, producer="env-pool-0") is True  # replaces its own, not added to it
    buf.put(groups([0, 0]), timeout_s=0.1, producer="env-pool-0")  # fewer than held (filtered): all released
    assert buf.reserve(1, timeout_s=0.1, producer="env-pool-2") is True  # 4 - 2 put - 1 held by env-pool-1
    assert buf.reserve(1, timeout_s=0.1, producer="env-pool-3") is False
    # a put turns its reservation into groups: no room comes back until they are taken
    threading.Timer(0.2, lambda: buf.put(groups([1], start=2), timeout_s=1, producer="env-pool-1")).start()
    assert buf.reserve(1, timeout_s=1, producer="env-pool-3") is False  # env-pool-1's group is in its slot
    buf.get(3, timeout_s=1)
    assert buf.reserve(2, timeout_s=0.1, producer="env-pool-3") is True  # empty: 4 - env-pool-2's 1 held


def test_producer_state_is_recorded_with_its_put_and_snapshot_restores():
    buf = LocalBuffer(capacity=10)
    assert buf.producer_state("env-pool-0") is None
    buf.put(groups([0, 0]), timeout_s=1, producer="env-pool-0", producer_state={"position": 2})
    buf.put([], timeout_s=1, producer="env-pool-1", producer_state={"position": 1})  # all filtered
    buf.put(groups([1], start=2), timeout_s=1)  # no producer: no state change
    assert buf.producer_state("env-pool-0") == {"position": 2}
    snap = buf.snapshot()
    assert len(snap.groups) == 3 and snap.producer_states == {
        "env-pool-0": {"position": 2},
        "env-pool-1": {"position": 1},
    }
    assert buf.stats().size == 3  # a snapshot takes nothing

    other = LocalBuffer(capacity=2)  # smaller than the snapshot: restore still keeps every group
    other.restore(snap)
    assert [g["policy_version"] for g in other.get(3, timeout_s=1)] == [0, 0, 1]
    assert other.producer_state("env-pool-1") == {"position": 1}
    with pytest.raises(RuntimeError, match="empty buffer"):
        buf.restore(snap)


def test_put_that_times_out_does_not_record_the_producer_state():
    buf = LocalBuffer(capacity=1)
    buf.put(groups([0]), timeout_s=0.05)
    with pytest.raises(BufferTimeout):
        buf.put(groups([0, 0], start=1), timeout_s=0.05, producer="p", producer_state={"position": 2})
    assert buf.producer_state("p") is None and buf.stats().size == 1


def test_drops_of_a_take_that_timed_out_are_reported_by_the_next():
    buf = LocalBuffer(capacity=4, max_staleness=0)
    buf.put([{"policy_version": 0, "producer": "p", "seq": 1}], timeout_s=1)
    with pytest.raises(BufferTimeout):
        buf.take(1, timeout_s=0.05, current_version=1)  # drops seq 1, then times out
    buf.put([{"policy_version": 1, "producer": "p", "seq": 2}], timeout_s=1)
    taken = buf.take(1, timeout_s=1, current_version=1)
    assert (taken.num_dropped_stale, taken.dropped_seqs, [g["seq"] for g in taken.groups]) == (1, {"p": 1}, [2])


def test_a_replay_buffer_api_over_the_same_queue():
    """extend / add / sample / len / write_count / empty: what a script using TorchRL's buffer
    calls; sample takes the oldest groups, each once."""
    reports = []
    buf = LocalBuffer(4, max_staleness=0, batch_size=2, wait_s=0.2, report=reports.append)
    assert buf.extend(groups([1, 1, 1])) == [0, 1, 2]
    assert buf.add(groups([2], start=3)[0]) == 3
    assert len(buf) == 4 and buf.write_count == 4
    assert [x["prompt_id"] for x in buf.sample()] == [0, 1]
    assert [x["prompt_id"] for x in buf.sample(1, current_version=2)] == [3]  # 2 was stale
    assert len(buf) == 0 and buf.stats().num_dropped_stale == 1
    with pytest.raises(BufferTimeout, match="waited 0.2s for 2 groups"):
        buf.sample()
    buf.extend(groups([0] * 4))
    with pytest.raises(BufferTimeout, match="buffer full"):
        buf.extend(groups([0]))
    buf.empty()
    assert len(buf) == 0 and buf.stats().num_dropped_stale == 1
    # every put and take reported its stats, the failed ones too
    assert [r.size for r in reports] == [3, 4, 2, 0, 0, 4, 4]
    with pytest.raises(RuntimeError, match="needs a batch size"):
        LocalBuffer(2).sample()
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        LocalBuffer(2, batch_size=0)


class Item:
    """A group as the writer sees it: numbered in place."""

    def __init__(self, version=0):
        self.policy_version, self.producer, self.seq = version, None, None


def test_a_group_writer_numbers_keeps_until_acknowledged_and_refuses_once_fenced():
    from rlpost.transport.group_writer import GroupWriter

    buf = LocalBuffer(capacity=2)
    position = {"n": 0}
    writer = GroupWriter(buf, "pool-a", state=lambda: dict(position))
    assert writer.wait_for_room(2)
    position["n"] = 2
    writer.extend([Item(), Item()])
    assert [g.seq for g in writer.outbox] == [1, 2] and buf.producer_state("pool-a") == {"n": 2}
    stop = threading.Event()
    stop.set()
    assert not writer.wait_for_room(1, stop)  # full: a stopped writer gives up waiting
    buf.take(2, timeout_s=1)
    with pytest.raises(BufferTimeout):  # the consumer received both: its next take says so
        buf.take(1, timeout_s=0.05, acknowledged={"pool-a": 2})
    position["n"] = 3
    writer.extend([])  # an empty put records the position and learns what was received
    assert writer.outbox == [] and buf.producer_state("pool-a") == {"n": 3}
    assert writer.num_batches_put == 2 and writer.num_groups_put == 2
    buf.fence("pool-a", epoch=1)  # the producer was replaced: its epoch-0 writer is refused
    with pytest.raises(RuntimeError, match="pool-a \\(epoch 0\\) was replaced"):
        writer.extend([Item()])


def test_a_group_writer_survives_its_buffer_and_puts_again_what_is_not_acknowledged():
    from rlpost.transport.buffer import BufferLost
    from rlpost.transport.group_writer import GroupWriter

    class Dead:
        def put(self, *args, **kwargs):
            raise BufferLost("the buffer actor died")

    old, new = LocalBuffer(capacity=8), LocalBuffer(capacity=8)
    writer = GroupWriter(old, "pool-a", buffer_wait_s=5)
    writer.extend([Item(), Item()])
    writer.buffer = Dead()  # the actor dies; the next put waits for set_buffer
    put = threading.Thread(target=writer.extend, args=([Item()],))
    put.start()
    time.sleep(0.2)
    assert writer.set_buffer(new) == 3  # the two kept groups and the one in flight
    put.join(5)
    got = new.get(new.stats().size, timeout_s=1)
    assert [g.seq for g in got] == [1, 2, 3]
    writer.buffer_wait_s = 0.1
    writer.buffer = Dead()
    with pytest.raises(BufferLost, match="no new one came within 0s"):
        writer.extend([])
