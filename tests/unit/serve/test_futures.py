"""Futures and the per-model queue: order by seq_id, retries, gaps, long polls, tenants."""

import asyncio

import pytest

from rlpost.serve.futures import SERVER, USER, FutureStore, ModelQueue, RequestError

pytestmark = pytest.mark.unit


def _run(coro):
    return asyncio.run(coro)


def _job(log: list, name: str, fail: Exception | None = None):
    async def work():
        await asyncio.sleep(0)
        log.append(name)
        if fail is not None:
            raise fail
        return name.encode(), "application/json"

    return work


def test_requests_run_in_seq_order_whatever_order_they_arrive_in():
    async def main():
        store, ran = FutureStore(long_poll_s=1.0), []
        queue = ModelQueue(store)
        futures = {seq: queue.submit(seq, "t", "fb", _job(ran, f"r{seq}")) for seq in (3, 2, 4, 1)}
        again = queue.submit(2, "t", "fb", _job(ran, "retry"))  # the client's retry of seq 2
        for f in futures.values():
            await store.wait(f.request_id, "t")
        assert again is futures[2]
        return ran, [futures[s].payload for s in (1, 2, 3, 4)]

    ran, payloads = _run(main())
    assert ran == ["r1", "r2", "r3", "r4"]
    assert payloads == [b"r1", b"r2", b"r3", b"r4"]


def test_a_client_mistake_is_a_user_error_and_a_fault_a_server_error_and_the_queue_goes_on():
    async def main():
        store, ran = FutureStore(long_poll_s=1.0), []
        queue = ModelQueue(store)
        bad = queue.submit(1, "t", "fb", _job(ran, "bad", ValueError("data[0]: empty")))
        broken = queue.submit(2, "t", "fb", _job(ran, "broken", RuntimeError("actor died\nmore")))
        told = queue.submit(3, "t", "fb", _job(ran, "told", RequestError("retry later", SERVER)))
        good = queue.submit(4, "t", "fb", _job(ran, "good"))
        for f in (bad, broken, told, good):
            await store.wait(f.request_id, "t")
        return bad, broken, told, good

    bad, broken, told, good = _run(main())
    assert (bad.error, bad.category) == ("data[0]: empty", USER)
    assert (broken.error, broken.category) == ("RuntimeError: actor died", SERVER)
    assert (told.error, told.category) == ("retry later", SERVER)
    assert good.payload == b"good"


def test_a_gap_that_stays_open_fails_the_requests_behind_it():
    async def main():
        store, ran = FutureStore(long_poll_s=1.0), []
        queue = ModelQueue(store, gap_timeout_s=0.05)
        waiting = queue.submit(3, "t", "fb", _job(ran, "r3"))
        await store.wait(waiting.request_id, "t")
        late = queue.submit(2, "t", "fb", _job(ran, "r2"))
        after = queue.submit(4, "t", "fb", _job(ran, "r4"))
        await store.wait(after.request_id, "t")
        return waiting, late, after, ran

    waiting, late, after, ran = _run(main())
    assert "request 1 never arrived" in waiting.error
    assert "numbers must not go back" in late.error
    assert after.payload == b"r4" and ran == ["r4"]


def test_a_poll_waits_for_the_result_then_says_pending_and_other_tenants_see_nothing():
    async def main():
        store = FutureStore(long_poll_s=0.05)
        future = store.create("alice", "sample")
        pending = await store.wait(future.request_id, "alice")
        assert not pending.done.is_set()
        assert await store.wait(future.request_id, "bob") is None
        assert await store.wait("req-made-up", "alice") is None

        async def finish_soon():
            await asyncio.sleep(0.01)
            future.finish(b"{}", "application/json")

        store.long_poll_s = 5.0
        asyncio.get_running_loop().create_task(finish_soon())
        done = await store.wait(future.request_id, "alice")
        again = await store.wait(future.request_id, "alice")  # a result is read more than once
        return done, again

    done, again = _run(main())
    assert done.payload == b"{}" and again is done


def test_a_closed_queue_finishes_the_request_running_and_fails_the_rest():
    """Closing (an unload, a session's end) fails the requests waiting and any sent later with the
    reason; the one running finishes, and idle() returns once it has."""

    async def main():
        store, ran, release = FutureStore(long_poll_s=1.0), [], asyncio.Event()
        queue = ModelQueue(store)

        async def slow():
            await release.wait()
            ran.append("running")
            return b"done", "application/json"

        running = queue.submit(1, "t", "fb", slow)
        waiting = queue.submit(2, "t", "fb", _job(ran, "r2"))
        await asyncio.sleep(0.01)
        queue.close("its session expired")
        later = queue.submit(3, "t", "fb", _job(ran, "r3"))
        idle = asyncio.ensure_future(queue.idle())
        await asyncio.sleep(0.01)
        assert not idle.done()  # the running request holds it
        release.set()
        await asyncio.wait_for(idle, 5)
        return ran, running, waiting, later

    ran, running, waiting, later = _run(main())
    assert ran == ["running"] and running.payload == b"done"
    assert waiting.error == later.error == "model: its session expired" and waiting.category == USER
