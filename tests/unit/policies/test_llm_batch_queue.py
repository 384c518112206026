"""BatchQueue (the wrappers' ``batching``): rows of concurrent calls grouped into shared runs,
each caller given its own results, an error given to every caller of the failing batch, every
wait bounded, one run at a time."""

from __future__ import annotations

import copy
import pickle
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from rlpost.policies.batching import BatchQueue, batch_size_bounds

pytestmark = pytest.mark.unit


class Recorder:
    """A ``run`` that squares its items and records each batch; ``gate`` (when set) holds every
    run until it is set; items equal to "bad" make the batch raise."""

    def __init__(self, gate: threading.Event | None = None):
        self.batches: list[list] = []
        self.gate = gate
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()

    def __call__(self, items: list) -> list:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.batches.append(list(items))
        try:
            if self.gate is not None:
                assert self.gate.wait(timeout=10), "test gate never opened"
            time.sleep(0.01)
            if "bad" in items:
                raise ValueError(f"bad batch {items}")
            return [x * x for x in items]
        finally:
            with self.lock:
                self.running -= 1


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_batch_size_bounds_follow_torchrls_rules():
    assert batch_size_bounds(None, None, None) == (None, None)  # no batching
    assert batch_size_bounds(True, None, None) == (1, None)
    assert batch_size_bounds(None, 4, None) == (4, None)
    assert batch_size_bounds(None, None, 3) == (1, 3)  # TorchRL documents 1; its code keeps None
    assert batch_size_bounds(True, 3, 3) == (3, 3)
    with pytest.raises(ValueError, match=r"min_batch_size \(5\) must be <= max_batch_size \(2\)"):
        batch_size_bounds(True, 5, 2)
    with pytest.raises(ValueError, match="must be None if batching is False"):
        batch_size_bounds(False, 2, None)
    with pytest.raises(ValueError, match="min_batch_size must be an integer >= 1"):
        batch_size_bounds(True, 0, None)


def test_concurrent_calls_share_one_run_once_min_batch_size_is_queued():
    run = Recorder()
    queue = BatchQueue(run, min_batch_size=4, timeout_s=10)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(queue.submit, [1, 2])
        wait_until(lambda: queue.state()["queue_size"] == 2)
        assert run.batches == []  # 2 < min_batch_size: it waits
        second = pool.submit(queue.submit, [3, 4])
        assert first.result(timeout=5) == [1, 4]
        assert second.result(timeout=5) == [9, 16]
    assert run.batches == [[1, 2, 3, 4]]


def test_a_short_batch_runs_after_the_timeout():
    run = Recorder()
    queue = BatchQueue(run, min_batch_size=5, timeout_s=0.3)
    start = time.monotonic()
    assert queue.submit([3]) == [9]
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 2.0
    assert run.batches == [[3]]


def test_max_batch_size_splits_oldest_first_and_results_keep_their_order():
    run = Recorder()
    queue = BatchQueue(run, min_batch_size=1, max_batch_size=2)
    assert queue.submit([1, 2, 3, 4, 5]) == [1, 4, 9, 16, 25]
    assert run.batches == [[1, 2], [3, 4], [5]]


def test_min_batch_size_one_runs_the_first_call_at_once_and_groups_the_ones_that_wait():
    gate = threading.Event()
    run = Recorder(gate)
    queue = BatchQueue(run, min_batch_size=1, max_batch_size=3)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(queue.submit, [1])
        wait_until(lambda: run.batches == [[1]])  # ran at once, held by the gate
        later = [pool.submit(queue.submit, [x]) for x in (2, 3, 4)]
        wait_until(lambda: queue.state()["queue_size"] == 3)
        gate.set()
        assert first.result(timeout=5) == [1]
        assert [f.result(timeout=5) for f in later] == [[4], [9], [16]]
    assert run.batches == [[1], [2, 3, 4]]
    assert run.most_running == 1  # never two runs at once


def test_an_error_reaches_every_caller_of_the_batch_and_no_other():
    gate = threading.Event()
    run = Recorder(gate)
    queue = BatchQueue(run, min_batch_size=3, max_batch_size=3, timeout_s=10)
    with ThreadPoolExecutor(4) as pool:
        callers = [pool.submit(queue.submit, [x]) for x in ("bad", 2)]
        wait_until(lambda: queue.state()["queue_size"] == 2)
        callers.append(pool.submit(queue.submit, [3]))  # fills the failing batch
        wait_until(lambda: len(run.batches) == 1)
        bystander = pool.submit(queue.submit, [4, 5, 6])  # queued behind it: a batch of its own
        wait_until(lambda: queue.state()["queue_size"] == 3)
        gate.set()
        for caller in callers:
            with pytest.raises(ValueError, match="bad batch"):
                caller.result(timeout=5)
        assert bystander.result(timeout=5) == [16, 25, 36]
    assert queue.submit([7, 8, 9]) == [49, 64, 81]  # the queue goes on


def test_a_run_returning_the_wrong_number_of_results_is_an_error_for_its_callers():
    queue = BatchQueue(lambda items: items[:-1], min_batch_size=1)
    with pytest.raises(RuntimeError, match="returned 1 results for 2 inputs"):
        queue.submit([1, 2])


def test_cleanup_cancels_waiting_callers_or_flushes_them():
    queue = BatchQueue(Recorder(), min_batch_size=3, timeout_s=30)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(queue.submit, [1])
        wait_until(lambda: queue.state()["queue_size"] == 1)
        start = time.monotonic()
        queue.cleanup()
        with pytest.raises(CancelledError, match="cleanup_batching"):
            waiting.result(timeout=5)
        assert time.monotonic() - start < 2  # woken at once, not after its 30 s
    state = queue.state()
    assert (state["queue_size"], state["pending_futures"], state["lock_state"]) == (0, 0, "unlocked")

    run = Recorder()
    queue = BatchQueue(run, min_batch_size=3, timeout_s=30)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(queue.submit, [2, 3])
        wait_until(lambda: queue.state()["queue_size"] == 2)
        queue.cleanup(flush=True)
        assert waiting.result(timeout=5) == [4, 9]
    assert run.batches == [[2, 3]]


def test_state_reports_the_queue_and_a_running_batch():
    gate = threading.Event()
    queue = BatchQueue(Recorder(gate), min_batch_size=1, max_batch_size=2, timeout_s=4)
    assert queue.state() == {
        "batching_enabled": True, "min_batch_size": 1, "max_batch_size": 2, "queue_size": 0,
        "processing": False, "lock_state": "unlocked", "pending_futures": 0, "timeout": 4.0,
    }  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(queue.submit, [1, 2])
        wait_until(lambda: queue.state()["processing"])
        queued = pool.submit(queue.submit, [3])
        wait_until(lambda: queue.state()["queue_size"] == 1)
        state = queue.state()
        assert (state["lock_state"], state["pending_futures"]) == ("locked", 3)
        gate.set()
        assert running.result(timeout=5) == [1, 4] and queued.result(timeout=5) == [9]


def test_a_copy_has_the_settings_and_a_lock_of_its_own():
    queue = BatchQueue(abs, min_batch_size=2, max_batch_size=4, timeout_s=3)
    for twin in (copy.deepcopy(queue), pickle.loads(pickle.dumps(queue))):
        assert (twin.min_batch_size, twin.max_batch_size, twin.timeout_s) == (2, 4, 3.0)
        assert twin.state()["queue_size"] == 0 and twin._cond is not queue._cond
