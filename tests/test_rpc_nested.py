"""Methods that make calls of their own: nodes that call each other back must not deadlock on
their slots (``CallLimits.max_concurrent``), and a lent slot is counted back exactly once.

Every wait here has a bound of its own, so a regression fails with a message instead of hanging.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from _polling import eventually

import tensorwire
from tensorwire.rpc import CallLimits, _client
from tensorwire.rpc._server import server_of
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits

TRANSPORTS = [
    "tcp",
    "inproc",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
    ),
]
pytestmark = pytest.mark.timeout(60)


def _calling_back(a: tensorwire.Peer, b: tensorwire.Peer) -> None:
    """Methods on both nodes that call the other back: ``on_b(i)`` (on b) is ``1 + back_on_a(i)``
    (on a), and ``on_a(i)`` is ``1 + back_on_b(i)``, where ``back_on_a(i) == i`` and
    ``back_on_b(i) == -i``."""

    @a.node.method()
    async def back_on_a(i: int) -> int:
        return i

    @b.node.method()
    async def back_on_b(i: int) -> int:
        return -i

    @b.node.method()
    async def on_b(i: int) -> int:
        return 1 + await b.call("back_on_a", i)

    @a.node.method()
    async def on_a(i: int) -> int:
        return 1 + await a.call("back_on_b", i)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_nodes_whose_methods_call_each_other_back_do_not_deadlock(transport: str) -> None:
    """A's method calls B, and B's method calls A back, while B does the same the other way. Each
    node's slots filled with methods waiting for calls the other could not admit, its slots full
    of the same: with max_concurrent=4 and 8 calls each way, all 16 ran out of their deadline
    (with the default limits, 100 calls each way: all 200). A method waiting for calls it made
    now lends its slot, and every call is answered."""
    async with connected_pair(transport) as (a, b):
        for node in (a.node, b.node):
            node.methods.limits = CallLimits(max_concurrent=4)

        _calling_back(a, b)

        there = [a.call("on_b", i, _deadline=10) for i in range(8)]
        back = [b.call("on_a", i, _deadline=10) for i in range(8)]
        got = await asyncio.gather(*there, *back, return_exceptions=True)
        assert got == [1 + i for i in range(8)] + [1 - i for i in range(8)], got

        # deeper: a chain that crosses between the nodes 12 times, 6 or 7 calls on each, with 4 slots
        @a.node.method()
        async def ping(n: int) -> int:
            return 0 if n == 0 else 1 + await a.call("pong", n - 1)

        @b.node.method()
        async def pong(n: int) -> int:
            return 0 if n == 0 else 1 + await b.call("ping", n - 1)

        assert await b.call("ping", 12, _deadline=10) == 12
        for peer in (a, b):
            await eventually(lambda p=peer: p.node.methods.slots.used == 0 and not server_of(p).calls)  # type: ignore[misc]


async def test_a_method_goes_on_after_its_call_without_waiting_for_its_slot() -> None:
    """The slot comes back the moment the method's call ends, without waiting for one to be free:
    the call admitted meanwhile, which waits for what the method does next, holds the only
    slot. Then a lent slot is given back once, however the calls that borrowed it end: one made
    by a task that outlives its method keeps it until it ends."""
    async with connected_pair("tcp") as (a, b):
        slots = b.node.methods.slots
        b.node.methods.limits = CallLimits(max_concurrent=1)
        ready = asyncio.Event()
        working = asyncio.Event()
        finish = asyncio.Event()

        @a.node.method()
        async def remote_work(seconds: float) -> str:
            working.set()
            await asyncio.sleep(seconds)
            async with asyncio.timeout(5):
                await finish.wait()
            return "done"

        @b.node.method()
        async def first() -> str:
            result = await b.call("remote_work", 0)  # its slot is lent meanwhile: second gets in
            ready.set()  # what second waits for: must not wait for second's slot to get here
            return result

        @b.node.method()
        async def second() -> str:
            async with asyncio.timeout(5):
                await ready.wait()
            return "second"

        one = asyncio.ensure_future(a.call("first", _deadline=10))
        async with asyncio.timeout(5):
            await working.wait()
        assert slots.used == 0  # lent while first waits for remote_work
        two = asyncio.ensure_future(a.call("second", _deadline=10))
        await eventually(lambda: slots.used == 1)  # second got in, and holds it as first goes on
        finish.set()
        assert await one == "done" and await two == "second"
        await eventually(lambda: slots.used == 0 and not slots._waiters)

        background: list[asyncio.Task[str]] = []

        @b.node.method()
        async def leaves_a_call_behind() -> str:
            background.append(asyncio.create_task(b.call("remote_work", 0.3)))
            await asyncio.sleep(0.05)
            return "returned"

        assert await a.call("leaves_a_call_behind", _deadline=10) == "returned"
        assert slots.used == 0  # lent to the call still running, which keeps it
        assert await background[0] == "done"
        assert slots.used == 0 and not slots._waiters  # not taken back by a call that ended
        # and the slot still bounds calls: two at once run one after the other
        running: list[int] = []

        @b.node.method()
        async def count() -> int:
            running.append(1)
            n = len(running)
            await asyncio.sleep(0.05)
            running.pop()
            return n

        assert sorted(await asyncio.gather(a.call("count"), a.call("count"))) == [1, 1]
        assert slots.used == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_more_calls_back_than_outstanding_calls_each_way_complete(transport: str) -> None:
    """A node keeps at most 256 calls outstanding on one peer. With 300 calls each way between two
    nodes whose methods all call back, each node's 256 places were taken by calls whose methods
    on the other node waited for a place to call back, behind the 44 calls still waiting: all
    600 ran out of their deadlines (250 each way passed). A call back to the caller of the method
    making it now goes in the room that caller keeps for its call, and all 600 are answered; the
    counts come back to 0."""
    async with connected_pair(transport) as (a, b):
        budgets = [_client._budget(p) for p in (a, b)]
        assert [x.max_calls for x in budgets] == [256, 256]

        _calling_back(a, b)

        n = 300
        there = [a.call("on_b", i, _deadline=10) for i in range(n)]
        back = [b.call("on_a", i, _deadline=10) for i in range(n)]
        got = await asyncio.gather(*there, *back, return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        assert not failed, f"{len(failed)} of {2 * n} failed, the first: {failed[0]!r}"
        assert got == [1 + i for i in range(n)] + [1 - i for i in range(n)]
        for budget in budgets:
            await eventually(lambda x=budget: x.calls == 0 and x.units == 0 and not x._waiters)  # type: ignore[misc]


async def test_one_call_back_at_a_time_rides_on_the_callers_room() -> None:
    """The room a caller keeps for its call fits one call back to it while the method runs: it
    goes in even when its node's outstanding calls are all taken (here 2: a quarter of the
    peer's 8 message slots), and a second at the same time waits for a place as any call does.
    The count passes max_calls only by such a call back, and comes back to 0."""
    async with connected_pair("tcp", limits=Limits(max_unexpected=8)) as (a, b):
        budget = _client._budget(b)
        assert budget.max_calls == 2
        hold = asyncio.Event()
        seen: list[tuple[int, int]] = []

        @a.node.method()
        async def slow() -> int:
            async with asyncio.timeout(5):
                await hold.wait()
            return 1

        @b.node.method()
        async def twice() -> int:
            one = asyncio.ensure_future(b.call("slow", _deadline=10))
            await eventually(lambda: budget.calls == 3)  # it rode, past the 2 that were taken
            two = asyncio.ensure_future(b.call("slow", _deadline=10))
            await eventually(lambda: len(budget._waiters) == 2)  # it waits, behind the call made below
            seen.append((budget.calls, len(budget._waiters)))
            hold.set()
            return await one + await two

        taken = [asyncio.ensure_future(b.call("slow", _deadline=10)) for _ in range(2)]
        waiting = asyncio.ensure_future(b.call("slow", _deadline=10))  # no place left: it waits
        await eventually(lambda: budget.calls == 2 and len(budget._waiters) == 1)
        assert await a.call("twice", _deadline=10) == 2
        assert seen == [(3, 2)]
        assert await asyncio.gather(*taken, waiting) == [1, 1, 1]
        await eventually(lambda: budget.calls == 0 and budget.units == 0 and not budget._waiters)
