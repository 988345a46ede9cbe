"""Methods that make calls of their own: nodes that call each other back must not deadlock on
their slots (``CallLimits.max_concurrent``), and a lent slot is counted back exactly once.

Every wait here has a bound of its own, so a regression fails with a message instead of hanging.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from _polling import eventually

from tensorwire.rpc import CallLimits
from tensorwire.rpc._server import server_of
from tensorwire.testing import connected_pair

TRANSPORTS = [
    "tcp",
    "inproc",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
    ),
]
pytestmark = pytest.mark.timeout(60)


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
