"""A channel's failure, raised by every call made after it and handed to every call waiting for
room when it came, keeps none of those calls' frames alive: a caller that let go of a failed
call's argument gets its memory back, on real nodes over tcp and inproc on loopback."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable

import numpy as np
import pytest
from _polling import collected, eventually

import tensorwire
from tensorwire.rpc import _client
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState, Limits

pytestmark = pytest.mark.timeout(60)

_BIG = 64 << 20


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("case", ["call after", "call waiting for room"])
async def test_a_failed_calls_arguments_are_freed_once_its_caller_lets_go(transport: str, case: str) -> None:
    """The peer aborts; a call of a 64 MiB array made after, or one waiting then for room among
    the calls outstanding (2 here: a quarter of the peer's 8 message slots), fails. Before, the
    calls' room on that peer raised the channel's own failure object, and each raise added the
    call's frames, its arguments with them, to that object's traceback: the array stayed alive
    for as long as the peer did. Every call now fails with a copy of its own."""
    async with connected_pair(transport, limits=Limits(max_unexpected=8)) as (a, b):
        hold = asyncio.Event()

        @b.node.method()
        async def wait() -> None:
            await hold.wait()

        @b.node.method()
        async def take(x: np.ndarray) -> int:
            return int(x.nbytes)

        x = np.ones(_BIG, np.uint8)
        gone = weakref.ref(x)
        first: list[asyncio.Future[None]] = []
        pending: Awaitable[object] | None = None
        if case == "call waiting for room":
            first = [asyncio.ensure_future(a.call("wait", _deadline=30)) for _ in range(2)]
            pending = asyncio.ensure_future(a.call("take", x, _deadline=30))
            room = _client._budget(a)
            await eventually(lambda: room.calls == 2 and len(room._waiters) == 1)  # (its argument packed)
        b.abort()
        await eventually(lambda: a.channel.state is not ChannelState.OPEN)
        failing = pending if pending is not None else a.call("take", x, _deadline=30)
        with pytest.raises(tensorwire.PeerDisconnected):
            await failing
        for held in first:
            with pytest.raises(tensorwire.PeerDisconnected):
                await held
        del x, pending, failing

        await collected(gone)
        with pytest.raises(tensorwire.PeerDisconnected):  # the failure is still told, as before
            await a.call("take", np.ones(4), _deadline=30)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("case", ["sleep cancelled", "timer left"])
async def test_a_gone_callers_peer_is_let_go_whatever_its_served_methods_left_behind(transport: str, case: str) -> None:
    """A served method runs in a context that holds its caller's room (``CallerRoom``), and what
    copies that context outlives the call: a cancelled ``asyncio.sleep``'s timer handle stays in
    the loop's heap until its time would have come, a timer or a task the method started lives
    on. The room held the caller's channel, and through it its peer, its mailbox and what its
    messages held, long after the peer was gone (found by SIGSTOPping a child whose call of a
    sleeping method was pending: its peer, declared dead at the lease, was kept for 600 s).
    Here the caller drops its connection while the method sleeps, or closes after a method left
    a timer; the node that served them lets go of the peer."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=(transport,)) as na,
        tensorwire.start("127.0.0.1:0", transports=(transport,)) as nb,
    ):
        running = asyncio.Event()
        timers: list[asyncio.TimerHandle] = []

        @nb.method()
        async def slow() -> None:
            running.set()
            await asyncio.sleep(600)

        @nb.method()
        async def later() -> None:
            timers.append(asyncio.get_running_loop().call_later(600, print))

        a = await na.connect(nb.address)
        b = await nb.accept()
        gone = weakref.ref(b)
        try:
            if case == "sleep cancelled":
                call = asyncio.ensure_future(a.call("slow", _deadline=30))
                async with asyncio.timeout(10):
                    await running.wait()
                a.abort()
                with pytest.raises(tensorwire.TensorWireError):
                    await call
                del call
            else:
                await a.call("later", _deadline=30)
                await a.aclose()
            await eventually(lambda: not nb.peers)
            assert b.closed
            del a, b  # (an inproc channel holds its other end: the caller's peer goes too)
            await collected(gone)
        finally:
            for timer in timers:
                timer.cancel()
