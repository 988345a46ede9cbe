"""Loop turns on a message's path: a waiter is woken in the turn after the thing it waits for
has happened, not a turn later (each turn of a node's loop costs 5-20 us here: a transport's
progress, the selector, the callbacks queued). ``Pledge``, a future for work that cannot be
called off (a UCX send, get or put), is awaited directly by ``wait_out`` and the ucx channel;
the receive side of a ucx message is woken by ``Arrival.complete`` itself."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tensorwire._loops import Pledge, wait_out
from tensorwire.testing import connected_pair

needs_ucx = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")


class _Turns:
    """Counts the loop's turns: a callback that queues itself again each time it runs."""

    def __init__(self) -> None:
        self.n = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.n += 1
        self._handle = self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


async def _turns_to_wake(fut: asyncio.Future[None]) -> int:
    """Turns between ``fut``'s result and the return of a ``wait_out(fut)`` that waited for it."""
    turns = _Turns()
    woke: list[int] = []

    async def waiter() -> None:
        await wait_out(fut)
        woke.append(turns.n)

    task = asyncio.ensure_future(waiter())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()
    at = turns.n
    fut.set_result(None)
    await task
    turns.stop()
    return woke[0] - at


async def test_wait_out_wakes_a_pledges_waiter_a_turn_sooner_than_a_plain_futures() -> None:
    loop = asyncio.get_running_loop()
    pledged = await _turns_to_wake(Pledge(loop=loop))
    plain = await _turns_to_wake(loop.create_future())
    assert pledged <= 1, f"a pledge's waiter woke {pledged} turns after it was settled"
    assert pledged < plain, (pledged, plain)


async def test_a_pledge_refuses_cancel_and_its_cancelled_waiter_goes_once_it_is_done() -> None:
    loop = asyncio.get_running_loop()
    fut: Pledge = Pledge(loop=loop)
    assert fut.cancel() is False
    assert not fut.done()
    task = asyncio.ensure_future(wait_out(fut))
    await asyncio.sleep(0)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "a cancel ended the wait while the pledged work went on"
    assert not fut.done()
    fut.set_exception(RuntimeError("the work failed"))
    with pytest.raises(asyncio.CancelledError):  # the cancel, once the work ended; its outcome stays
        await task
    with pytest.raises(RuntimeError, match="the work failed"):
        fut.result()


async def test_wait_out_of_a_pledge_leaves_its_failure_to_the_caller() -> None:
    fut: Pledge = Pledge(loop=asyncio.get_running_loop())
    asyncio.get_running_loop().call_soon(fut.set_exception, ValueError("told to the caller"))
    await wait_out(fut)  # returns: the outcome is read by whoever asked for it
    with pytest.raises(ValueError, match="told to the caller"):
        fut.result()


@needs_ucx
async def test_a_ucx_recv_into_out_returns_the_turn_after_its_payload_landed() -> None:
    """A 128 KiB message (over the 64 KiB that ride in the MSG frame: its payload a UCX message
    of its own) into a posted recv's out=: the recv returns in the loop turn after the payload
    receive completed. Awaiting a shield of the arrival's ``done`` took two (its callbacks run
    in one turn, the recv's task in the next)."""
    x = np.arange(128 * 1024, dtype=np.uint8)
    async with connected_pair("ucx") as (a, b):
        await a.send(x, tag="warm")
        await b.recv(tag="warm")
        channel: Any = b.channel
        turns = _Turns()
        landed: list[int] = []
        done_of = channel._payload_done

        def spy(transfer: Any, req: Any) -> None:
            done_of(transfer, req)
            landed.append(turns.n)

        channel._payload_done = spy  # (looked up per message: ``_post_payload``)
        try:
            gaps = []

            async def receive(out: np.ndarray) -> int:
                await b.recv(tag="t", out=out)
                return turns.n  # (in the recv's task: an await of that task takes a turn more)

            for _ in range(5):
                out = np.zeros_like(x)
                recv = asyncio.ensure_future(receive(out))
                await asyncio.sleep(0)
                landed.clear()
                await a.send(x, tag="t")
                returned = await recv
                assert landed, "the payload did not go as a UCX message of its own"
                assert np.array_equal(out, x)
                gaps.append(returned - landed[-1])
        finally:
            del channel._payload_done
            turns.stop()
        assert min(gaps) <= 1, f"turns from the payload's landing to the recv's return: {gaps}"


@needs_ucx
async def test_a_ucx_send_returns_the_turn_after_ucx_completed_its_payload() -> None:
    """The payload send's completion (dispatched by the worker) wakes ``send`` in the next
    turn: its wait is a ``Pledge`` awaited directly, where a shield of a plain future took two."""
    x = np.arange(128 * 1024, dtype=np.uint8)
    async with connected_pair("ucx") as (a, b):
        await a.send(x, tag="warm")
        await b.recv(tag="warm")
        w: Any = a.channel._w
        turns = _Turns()
        completed: list[int] = []
        dispatch = w._dispatch_raw

        def spy(done: list[int]) -> int:
            sends = [p for p in done if p in w._raw and w._raw[p][3] == "ucx payload send"]
            n = dispatch(done)
            if any(p not in w._raw for p in sends):
                completed.append(turns.n)
            return int(n)

        w._dispatch_raw = spy
        try:
            gaps = []
            for _ in range(5):
                out = np.zeros_like(x)
                recv = asyncio.ensure_future(b.recv(tag="t", out=out))
                completed.clear()
                await a.send(x, tag="t")
                returned = turns.n
                await recv
                if completed:  # (UCX may finish a send before it is waited for: no wait then)
                    gaps.append(returned - completed[-1])
        finally:
            del w._dispatch_raw
            turns.stop()
        assert gaps, "no payload send was waited for"
        assert min(gaps) <= 1, f"turns from the payload send's completion to send's return: {gaps}"


@needs_ucx
async def test_a_large_ucx_receive_is_not_looked_at_after_every_round_ucx_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX moves a large payload round by round (over cma, 512 KiB a round); asking every
    request whether it completed after each round (``Worker._dispatch``, 5 us here) cost 12% of
    a 16 MiB receive. While bytes move and nothing reported a completion, the worker looks once
    per ``_LOOK_MOVING``; the receive's own end is still seen at once (the recv returns the
    turn after, as above)."""
    from tensorwire.transports.ucx import _worker

    # A round takes 75 us here, and 200 us or more on a loaded host, where the worker rightly
    # looked after nearly every one (CI-like load: 74 looks for 66 rounds). Ten times the spacing
    # asks the same of the worker, with rounds up to ten times slower than that.
    monkeypatch.setattr(_worker, "_LOOK_MOVING", 10 * _worker._LOOK_MOVING)
    x = np.resize(np.arange(251, dtype=np.uint8), 32 << 20)
    async with connected_pair("ucx") as (a, b):
        w: Any = b.channel._w
        moved = looks = 0
        progress_once = w.worker.progress_once
        dispatch = w._dispatch

        def counted_progress() -> Any:
            nonlocal moved
            got = progress_once()
            moved += bool(got)
            return got

        def counted_dispatch() -> int:
            nonlocal looks
            looks += 1
            return int(dispatch())

        class _Counted:
            # (the real worker and its counted progress are the instance's, not closures of the
            # class's: a class is freed only by the cycle collector, and the node's UCX worker
            # with it, some tests later)
            def __init__(self, real: Any, progress_once: Callable[[], Any]) -> None:
                self.real = real
                self.progress_once = progress_once

            def __getattr__(self, name: str) -> Any:
                return getattr(self.real, name)

        w_worker = w.worker
        w.worker, w._dispatch = _Counted(w_worker, counted_progress), counted_dispatch
        try:
            out = np.zeros_like(x)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            await asyncio.sleep(0)
            await a.send(x, tag="t")
            await recv
        finally:
            w.worker = w_worker
            del w._dispatch
        assert np.array_equal(out, x)
        assert moved >= 32, f"UCX moved the 32 MiB in {moved} rounds: not the round-by-round transfer this is about"
        # (each loop callback of the worker also looks once after its rounds, whatever moved)
        assert looks < 0.8 * moved, (
            f"{looks} looks for {moved} rounds that moved bytes (_LOOK_MOVING {_worker._LOOK_MOVING})"
        )
