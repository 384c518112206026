"""Turns in rotation across tenants, and each tenant's bound on pending requests."""

import asyncio

import pytest

from rlpost.serve.fairness import Admission, Busy, FairTurns

pytestmark = pytest.mark.unit


class Clock:
    """A clock the calls step by hand: each call takes the time it says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_that_floods_the_queue_waits_its_turn_behind_each_other_tenant():
    async def main():
        clock, order = Clock(), []
        turns = FairTurns(1, clock=clock)

        async def call(tenant, i):
            async with turns.turn(tenant):
                order.append(f"{tenant}{i}")
                clock.now += 1.0
                await asyncio.sleep(0)

        flood = [call("a", i) for i in range(6)]
        others = [call("b", 0), call("c", 0), call("b", 1)]
        await asyncio.gather(*flood[:1], *flood[1:], *others)
        return order, turns

    order, turns = asyncio.run(main())
    # a0 ran at once; then whoever has held the actor least, ties to the one waiting longest
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert turns.granted == {"a": 6, "b": 2, "c": 1} and turns.active == 0
    assert turns.held_s == {"a": 6.0, "b": 2.0, "c": 1.0}


def test_long_calls_buy_no_more_of_the_actor_and_a_returning_tenant_gets_no_back_pay():
    """Four tenants flooding one actor, one with calls nine times longer: each holds it a quarter
    of the time (by count, the long one would hold 75%). A tenant that waited out a pause then
    gets its share from its return, not the time it missed all at once."""

    async def main():
        clock = Clock()
        turns = FairTurns(1, clock=clock)
        stop, paused = asyncio.Event(), asyncio.Event()

        async def client(tenant, length):
            while not stop.is_set():
                if tenant == "e" and not paused.is_set():
                    await asyncio.sleep(0)
                    continue
                async with turns.turn(tenant):
                    clock.now += length
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(client(t, 9.0 if t == "a" else 1.0)) for t in "abcde"]
        while clock.now < 4000:
            await asyncio.sleep(0)
        shares = {t: turns.held_s[t] / clock.now for t in "abcd"}
        paused.set()  # e starts sending now
        start, held = clock.now, dict(turns.held_s)
        while clock.now < start + 1000:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.gather(*tasks)
        after = {t: (turns.held_s[t] - held.get(t, 0.0)) / (clock.now - start) for t in "abcde"}
        return shares, after

    shares, after = asyncio.run(main())
    assert all(0.22 <= share <= 0.28 for share in shares.values()), shares
    assert all(0.15 <= share <= 0.25 for share in after.values()), after  # e: a fifth, not all the missed time


def test_four_tenants_sending_without_pause_each_get_a_quarter_of_the_turns():
    async def main():
        clock = Clock()
        turns = FairTurns(1, clock=clock)
        stop = asyncio.Event()

        async def client(tenant):
            while not stop.is_set():
                async with turns.turn(tenant):
                    clock.now += 1.0
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(client(t)) for t in "abcd" for _ in range(1 + 3 * (t == "a"))]  # a: 4 callers
        while sum(turns.granted.values()) < 400:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.gather(*tasks)
        return turns.granted

    granted = asyncio.run(main())
    total = sum(granted.values())
    assert all(0.22 <= granted[t] / total <= 0.28 for t in "abcd"), granted


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
