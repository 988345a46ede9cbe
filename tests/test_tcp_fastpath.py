"""Attacks on the small-message fast path of the tcp transport (frames taken in the socket's
readable callback, one-frame sends written without awaits), with real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import sys
import zlib
from types import FrameType
from typing import Any

import numpy as np
import pytest
from _polling import eventually  # type: ignore[import-not-found]
from test_hostile import (  # type: ignore[import-not-found]
    VIOLATIONS,
    _violate,
    eager,
)

import tensorwire
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", list(VIOLATIONS))
async def test_a_violation_behind_whole_small_frames_in_one_segment_closes_the_connection(
    caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """Valid small messages and then a violation, all in one write: the readable callback takes
    the good frames and leaves the bad one to the reader, which drops the connection."""
    attack, reason = VIOLATIONS[name]

    def prefixed(s: Any) -> bytes:
        good = b"".join(eager(np.arange(8, dtype=np.int32) + i, tag=3, msg_id=s.msg_id()) for i in range(3))
        return good + attack(s)

    await _violate(caplog, prefixed, reason)


async def _recv_loop_with_cancels(b: tensorwire.Peer, n: int, size: int, seed: int) -> tuple[int, list[np.ndarray]]:
    """Receive ``n`` numbered messages on tag 5 with every kind of out= (matching, mismatched,
    read-only, none) and random cancellations; returns the mismatches seen and the out= arrays
    of cancelled recvs (filled with a sentinel once the cancel returned)."""
    rng = random.Random(seed)
    nexti, mismatches, cancelled = 0, 0, []
    while nexti < n:
        kind = rng.choice(["out", "out", "none", "bad", "ro"])
        out: np.ndarray | None = None
        if kind in ("out", "ro"):
            out = np.empty(size, np.int64)
            out.flags.writeable = kind == "out"
        elif kind == "bad":
            out = np.empty(size + 1, np.int64)
        if rng.random() < 0.3:
            await asyncio.sleep(rng.random() * 0.001)
        fut = asyncio.ensure_future(b.recv(tag=5, out=out))
        if rng.random() < 0.3:
            for _ in range(rng.randrange(5)):
                await asyncio.sleep(0)
            fut.cancel()
        try:
            got = await asyncio.wait_for(fut, 10)
        except asyncio.CancelledError:
            if kind == "out":
                assert out is not None
                out[:] = -1
                cancelled.append(out)
            continue
        except tensorwire.ShapeMismatchError:
            assert kind in ("bad", "ro")
            mismatches += 1
            continue
        assert kind in ("out", "none")
        assert out is None or got is out
        assert got[0] == nexti, f"got message {got[0]}, expected {nexti}"
        assert int(got[-1]) == zlib.crc32(got[:-1].tobytes())
        nexti += 1
    return mismatches, cancelled


@pytest.mark.parametrize("size", [2, 600], ids=["16B", "4.8KiB"])
@pytest.mark.parametrize(
    "limits",
    [
        tensorwire.Limits(),
        tensorwire.Limits(max_unexpected=2, recv_buffer_bytes=20_000),
        tensorwire.Limits(max_unexpected=1, recv_buffer_bytes=0),
    ],
    ids=["default", "2-slots", "1-slot-no-credit"],
)
async def test_small_messages_in_order_whole_and_never_lost_under_cancels_and_bad_outs(
    limits: tensorwire.Limits, size: int
) -> None:
    """Small messages (the readable callback's and the one-frame send's path) under every
    receive budget: FIFO, byte-exact, none lost to a mismatched or read-only out= or to a
    cancelled recv, and no write into a cancelled recv's out= after the cancel returned."""
    n = 300
    async with connected_pair("tcp", limits=limits) as (a, b):

        async def sender() -> None:
            r = random.Random(7)
            for i in range(n):
                x = np.frombuffer(r.randbytes(8 * size), np.int64).copy()
                x[0] = i
                x[-1] = zlib.crc32(x[:-1].tobytes())
                await a.send(x, tag=5)
                if r.random() < 0.2:
                    await asyncio.sleep(r.random() * 0.001)

        send = asyncio.create_task(sender())
        mismatches, cancelled = await _recv_loop_with_cancels(b, n, size, seed=size)
        await asyncio.wait_for(send, 10)
        await asyncio.sleep(0.05)
        assert mismatches
        for out in cancelled:
            assert (out == -1).all(), "a cancelled recv's out= was written after the cancel"


@pytest.mark.parametrize(
    "limits",
    [
        tensorwire.Limits(),
        tensorwire.Limits(max_unexpected=1, recv_buffer_bytes=0),
        tensorwire.Limits(chunk_bytes=4096),
    ],
    ids=["default", "1-slot-no-credit", "4KiB-chunks"],
)
async def test_sends_cancelled_anywhere_keep_the_stream_in_order_and_whole(limits: tensorwire.Limits) -> None:
    """Sends of one-frame, multi-frame and rendezvous messages cancelled at random points: what
    arrives is in order, whole and never twice, and every send that returned arrived."""
    rng = random.Random(5)
    async with connected_pair("tcp", limits=limits) as (a, b):
        got: list[int] = []

        async def receiver() -> None:
            while True:
                m = await b.recv(tag=1)
                assert zlib.crc32(m["x"]) == m["c"]
                got.append(m["i"])

        rx = asyncio.create_task(receiver())
        sent = set()
        for i in range(400):
            x = np.frombuffer(rng.randbytes(rng.choice([0, 8, 4000, 15000, 20000, 200000])), np.uint8)
            send = asyncio.ensure_future(a.send({"i": i, "x": x, "c": zlib.crc32(x)}, tag=1))
            if rng.random() < 0.4:
                for _ in range(rng.randrange(6)):
                    await asyncio.sleep(0)
                send.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(send, 10)
                sent.add(i)
        await a.send({"i": -1, "x": np.zeros(0, np.uint8), "c": 0}, tag=1)
        while not got or got[-1] != -1:
            assert not rx.done(), rx
            await asyncio.sleep(0.01)
        rx.cancel()
        got.pop()
        assert got == sorted(set(got)), "reordered or duplicated"
        assert sent <= set(got), f"sent but lost: {sorted(sent - set(got))[:10]}"


async def test_a_recv_that_finds_its_small_message_whole_in_the_queue_takes_it_at_once() -> None:
    """Small messages that outrun their recvs (a stream of them) wait whole in the queue, and
    the recv that finds one copies it out and returns in the same step, through no coroutine of
    tensorwire's but its own: the general path's three (and a holder with a future) cost more
    than the copy of a few KiB. Counted in coroutines started, not time (old code: six)."""
    package = os.path.dirname(tensorwire.__file__) + os.sep
    x = np.arange(512, dtype=np.float64)
    started: list[str] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_COROUTINE and code.co_filename.startswith(package):
            started.append(code.co_qualname)

    async with connected_pair("tcp") as (a, b):
        mailbox = b.channel.mailbox  # type: ignore[attr-defined]
        for out in (np.empty_like(x), None):
            await a.send({"x": x, "n": 7}, tag="queued")
            await eventually(lambda: any(q and q[0].done.done() for q in mailbox._arrived.values()))
            started.clear()
            sys.settrace(trace)
            try:
                got, receipt = await b.recv_with_receipt(tag="queued", out=None if out is None else {"x": out, "n": 0})
            finally:
                sys.settrace(None)
            assert np.array_equal(got["x"], x) and got["n"] == 7
            assert receipt.nbytes == x.nbytes and receipt.staged == (out is not None) and not receipt.direct
            assert started == ["Peer.recv_with_receipt", "Peer._recv_own_with_receipt", "Mailbox.recv"], started
        # its slot and credit went back: the next message goes the same way
        await a.send(x, tag="queued")
        assert np.array_equal(await b.recv(tag="queued"), x)
