"""Turns in rotation across tenants, and each tenant's bound on pending requests."""

import asyncio

import pytest

from rlpost.serve.fairness import Admission, Busy, FairTurns

pytestmark = pytest.mark.unit


def test_a_tenant_that_floods_the_queue_waits_its_turn_behind_each_other_tenant():
    async def main():
        turns, order = FairTurns(1), []

        async def call(tenant, i):
            async with turns.turn(tenant):
                order.append(f"{tenant}{i}")
                await asyncio.sleep(0)

        flood = [call("a", i) for i in range(6)]
        others = [call("b", 0), call("c", 0), call("b", 1)]
        await asyncio.gather(*flood[:1], *flood[1:], *others)
        return order, turns

    order, turns = asyncio.run(main())
    # a0 ran at once; then the waiting tenants in rotation, each tenant's calls in their order
    assert order == ["a0", "a1", "b0", "c0", "a2", "b1", "a3", "a4", "a5"]
    assert turns.granted == {"a": 6, "b": 2, "c": 1} and turns.active == 0


def test_four_tenants_sending_without_pause_each_get_a_quarter_of_the_turns():
    async def main():
        turns = FairTurns(1)
        stop = asyncio.Event()

        async def client(tenant):
            while not stop.is_set():
                async with turns.turn(tenant):
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(client(t)) for t in "abcd" for _ in range(1 + 3 * (t == "a"))]  # a: 4 callers
        while sum(turns.granted.values()) < 400:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.gather(*tasks)
        return turns.granted

    granted = asyncio.run(main())
    total = sum(granted.values())
    assert all(granted[t] / total >= 0.2 for t in "abcd"), granted


def test_a_cancelled_waiter_gives_its_place_up():
    async def main():
        turns = FairTurns(1)
        first = asyncio.Event()

        async def holder():
            async with turns.turn("a"):
                await first.wait()

        held = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(turns._acquire("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        first.set()
        await held
        async with turns.turn("c"):
            pass
        return turns

    turns = asyncio.run(main())
    assert turns.active == 0 and turns.waiting("b") == 0


def test_a_tenant_at_its_bound_is_told_to_try_again_unless_the_request_unblocks_its_queue():
    admission = Admission(2)
    admission.started("a")
    admission.started("a")
    with pytest.raises(Busy, match="tenant 'a' has 2 requests pending .*try again later"):
        admission.check("a")
    admission.check("a", unblocks=True)
    admission.check("b")
    admission.finished("a")
    admission.check("a")
