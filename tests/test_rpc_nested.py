"""Methods that make calls of their own: nodes that call each other back must not deadlock on
their slots (``CallLimits.max_concurrent``), and a lent slot is counted back exactly once.

Every wait here has a bound of its own, so a regression fails with a message instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator, Awaitable
from typing import Any

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
    peer's 8 message slots), and a second at the same time waits in line for a place (and for
    that room). The count passes max_calls only by such a call back, and comes back to 0."""
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


async def _all(items: AsyncIterator[int]) -> list[int]:
    return [x async for x in items]


def _nesting(a: tensorwire.Peer, b: tensorwire.Peer, case: str) -> None:
    """``f(i)`` on both nodes, which calls its caller back: twice at once (``"two at once"``),
    from a streaming method (``"from a stream"``: it yields ``1 + leaf(i)``), or through a
    stream (``"a stream back"``: ``1 + sum(gen_leaf(i))``); ``leaf(i) == i``, and ``gen_leaf(i)``
    yields ``i``. Called (or streamed) with ``i``, ``f`` answers ``1 + i``."""
    for me in (a, b):

        def register(me: tensorwire.Peer = me) -> None:
            node = me.node

            @node.method()
            async def leaf(i: int) -> int:
                return i

            @node.method()
            async def gen_leaf(i: int) -> AsyncIterator[int]:
                yield i

            if case == "two at once":

                @node.method("f")
                async def f(i: int) -> int:
                    x, y = await asyncio.gather(me.call("leaf", i), me.call("leaf", i))
                    return 1 + x + y - i

            elif case == "from a stream":

                @node.method("f")
                async def f_streaming(i: int) -> AsyncIterator[int]:
                    yield 1 + await me.call("leaf", i)

            else:

                @node.method("f")
                async def f_stream_back(i: int) -> int:
                    return 1 + sum(await _all(me.stream("gen_leaf", i)))

        register()


def _f(peer: tensorwire.Peer, case: str, i: int) -> Awaitable[Any]:
    if case == "from a stream":
        return _all(peer.stream("f", i, _deadline=10))
    return peer.call("f", i, _deadline=10)


def _settled(budget: _client._Budget) -> bool:
    counts = (budget.calls, budget.units, budget.extra, budget.riding, budget.outliving)
    return counts == (0, 0, 0, 0, 0) and not budget._waiters


NESTING = ["two at once", "from a stream", "a stream back"]


@pytest.mark.parametrize("case", NESTING)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_calls_back_at_once_from_streams_and_as_streams_complete_past_256_each_way(
    transport: str, case: str
) -> None:
    """Two nodes whose methods all call back, 300 calls each way (a node keeps 256 outstanding on
    one peer), with methods that make two calls back at once, streaming methods that call back,
    or methods that call back through a stream. Only one call back at a time, and only from a
    unary method, rode on the room its caller keeps for its call: the rest waited for a place
    among the 256, all taken by calls whose methods waited the same way, and all 600 ran out of
    their deadlines (streams: 250 each way too, their units full). A stream's method has that
    room too (its final reply has a place of its own), a stream back rides there (its item in
    this node's room for replies), and a second call back made at once waits for the room as
    well as for a place: all 600 are answered, and the counts come back to 0."""
    async with connected_pair(transport) as (a, b):
        budgets = [_client._budget(p) for p in (a, b)]
        assert [x.max_calls for x in budgets] == [256, 256]
        _nesting(a, b, case)
        n = 300
        got = await asyncio.gather(*(_f(p, case, i) for p in (a, b) for i in range(n)), return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        assert not failed, f"{len(failed)} of {2 * n} failed, the first: {failed[0]!r}"
        want = [1 + i for i in range(n)] * 2
        assert got == ([[x] for x in want] if case == "from a stream" else want)
        for budget in budgets:
            await eventually(lambda x=budget: _settled(x))  # type: ignore[misc]


@pytest.mark.parametrize("case", NESTING)
async def test_calls_back_ride_one_at_a_time_when_every_place_is_taken(case: str) -> None:
    """b's places on a (2: a quarter of a's 8 message slots) are taken by calls held until the
    end. A method called by a then calls a back as in ``_nesting``: before, only a unary
    method's one call back at a time went in (the room a keeps for its call), and the second at
    once, the call back of a stream's method and a stream back all waited for those places
    until their deadlines. Now each rides on that room, one at a time: b never has more than one
    call past its 2 outstanding on a."""
    async with connected_pair("tcp", limits=Limits(max_unexpected=8)) as (a, b):
        budget = _client._budget(b)
        assert budget.max_calls == 2
        hold = asyncio.Event()
        most: list[int] = []

        @a.node.method()
        async def held() -> int:
            async with asyncio.timeout(15):
                await hold.wait()
            return 0

        _nesting(a, b, case)

        for name in ("leaf", "gen_leaf"):  # (replaced: b's calls back count what b has outstanding)
            a.node.methods.unregister(name)

        @a.node.method("leaf")
        async def counting_leaf(i: int) -> int:
            most.append(budget.calls)
            await asyncio.sleep(0.01)  # (two at once: the second waits for the first)
            return i

        @a.node.method("gen_leaf")
        async def counting_gen_leaf(i: int) -> AsyncIterator[int]:
            most.append(budget.calls)
            yield i

        taken = [asyncio.ensure_future(b.call("held", _deadline=20)) for _ in range(2)]
        await eventually(lambda: budget.calls == 2)
        got = await _f(a, case, 5)
        assert got == ([6] if case == "from a stream" else 6)
        assert most and max(most) == 3 and budget.riding == 0, most
        hold.set()
        assert await asyncio.gather(*taken) == [0, 0]
        await eventually(lambda: _settled(budget))


async def test_calls_back_that_outlive_their_methods_never_pile_up() -> None:
    """b's places on a (2: a quarter of a's 8 message slots) are taken. A method whose call back
    runs out of its deadline leaves it behind: its request reached the caller, and its room is
    kept until the answer comes (the method there takes no notice of its cancellation, so none
    comes until told). Each new call being served had a room of its own for the next such call
    back: 5 calls left 5 outstanding past those 2, and ever more calls would leave ever more.
    Now none rides while one that rode outlives its room, and a call back waiting then rides
    as soon as that one has ended: b never has more than one call outstanding past its 2."""
    async with connected_pair("tcp", limits=Limits(max_unexpected=8)) as (a, b):
        budget = _client._budget(b)
        assert budget.max_calls == 2
        told = {k: asyncio.Event() for k in range(7)}
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 20

        @a.node.method()
        async def deaf(k: int) -> int:
            while not told[k].is_set() and loop.time() < give_up:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):  # (no notice of its cancellation)
                    await asyncio.wait_for(told[k].wait(), 1)
            return k

        @a.node.method()
        async def leaf() -> int:
            return 1

        @b.node.method()
        async def abandon(k: int) -> None:
            with contextlib.suppress(tensorwire.DeadlineExceeded):
                await b.call("deaf", k, _deadline=0.1)

        @b.node.method()
        async def once() -> int:
            return await b.call("leaf", _deadline=10)

        held = [asyncio.ensure_future(b.call("deaf", k, _deadline=30)) for k in (0, 1)]
        await eventually(lambda: budget.calls == 2)
        for k in range(2, 7):
            await a.call("abandon", k, _deadline=10)
            assert budget.calls <= budget.max_calls + 1, f"{budget.calls} calls outstanding"
        assert (budget.riding, budget.outliving) == (1, 1)  # deaf(2) rode, and outlives abandon
        waiting = asyncio.ensure_future(a.call("once", _deadline=10))
        await eventually(lambda: len(budget._waiters) == 1)  # its call back waits
        told[2].set()
        assert await waiting == 1  # it rode once deaf(2) had ended, the 2 places still taken
        assert not any(h.done() for h in held)
        for event in told.values():
            event.set()
        assert await asyncio.gather(*held) == [0, 1]
        await eventually(lambda: _settled(budget))
