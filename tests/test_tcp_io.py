"""The staged-TCP socket layer (``transports/tcp/_sockio.py``) on real sockets: how it waits for
a readable socket. The reader stays registered with the loop between reads, so a steady exchange
does not pay two epoll_ctl calls per message; it is removed when it fires with nobody waiting
(level-triggered, it would fire on every loop turn) and when the socket closes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import connected_pair, idle_cpu_percent
from tensorwire.transports.tcp._sockio import SockIO

pytestmark = pytest.mark.timeout(20)


@contextmanager
def _counting_readers(loop: asyncio.AbstractEventLoop) -> Iterator[dict[str, int]]:
    """Count the loop's add_reader/remove_reader calls (the real ones still run)."""
    counts = {"add": 0, "remove": 0}
    add, remove = loop.add_reader, loop.remove_reader

    def counted_add(fd: int, cb: object, *args: object) -> None:
        counts["add"] += 1
        add(fd, cb, *args)  # type: ignore[arg-type]

    def counted_remove(fd: int) -> bool:
        counts["remove"] += 1
        return remove(fd)

    loop.add_reader, loop.remove_reader = counted_add, counted_remove  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del loop.add_reader, loop.remove_reader  # back to the class's methods


@asynccontextmanager
async def _pair() -> AsyncIterator[tuple[SockIO, socket.socket]]:
    a, b = socket.socketpair()
    io = SockIO(a)
    try:
        yield io, b
    finally:
        io.close()
        b.close()


async def test_a_steady_exchange_does_not_register_the_reader_per_message() -> None:
    loop = asyncio.get_running_loop()
    async with connected_pair("tcp") as (a, b):
        x, out = np.arange(4.0), np.empty(4)

        async def echo() -> None:
            back = np.empty(4)
            for _ in range(300):
                await b.send(await b.recv(tag=1, out=back), tag=2)

        task = asyncio.create_task(echo())
        with _counting_readers(loop) as counts:
            for i in range(300):
                await a.send(x + i, tag=1)
                await a.recv(tag=2, out=out)
                assert np.array_equal(out, x + i)
        await task
    # before: one add and one remove for every wait of either side's read loop (over 600 each)
    assert counts["add"] < 60, counts


async def test_data_that_arrives_while_nobody_reads_is_read_later_without_spinning() -> None:
    async with _pair() as (io, peer):
        peer.sendall(b"one!")
        assert await io.read_exact(4) == b"one!"
        fired = 0
        real = io._on_readable

        def counted() -> None:
            nonlocal fired
            fired += 1
            real()

        io._on_readable = counted  # type: ignore[method-assign]
        waiting = asyncio.create_task(io.read_exact(4))  # registers the (counted) reader
        await asyncio.sleep(0.01)
        peer.sendall(b"two!")
        assert await waiting == b"two!"
        peer.sendall(b"three")  # nobody waits now: one callback removes the reader
        await asyncio.sleep(0.3)
        assert fired <= 3, fired  # a reader left registered would fire on every loop turn
        assert not io._watching
        assert await asyncio.wait_for(io.read_exact(5), 5) == b"three"


async def test_a_cancelled_read_leaves_the_socket_readable_for_the_next() -> None:
    async with _pair() as (io, peer):
        first = asyncio.create_task(io.read_exact(3))
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        peer.sendall(b"abc")
        await asyncio.sleep(0.05)  # the reader fires for nobody and is removed
        assert await asyncio.wait_for(io.read_exact(3), 5) == b"abc"


async def test_close_removes_the_reader() -> None:
    loop = asyncio.get_running_loop()
    async with _pair() as (io, _):
        fd = io.fd
        reading = asyncio.create_task(io.read_exact(1))
        await asyncio.sleep(0.01)
        assert io._watching
        io.close()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert not loop.remove_reader(fd)  # nothing was left registered on the closed descriptor


def test_idle_tcp_nodes_burn_no_cpu() -> None:
    """Two nodes joined over tcp, after a transfer, sleep in epoll while nothing moves: the reader
    left registered between reads must not wake the loop."""
    pct = idle_cpu_percent("tcp")
    # leases and heartbeats only: a few tenths of a percent; a spinning reader takes a whole core
    assert pct < 5.0, f"idle cpu {pct:.2f}%"


def test_idle_measure_that_runs_out_of_time_says_how_far_it_got() -> None:
    # idle for 60 s with 8 s to do it: the child is killed, and the error names its last step
    with pytest.raises(AssertionError, match=r"did not finish in 8 s; they got as far as: imported( -> \w+)*"):
        idle_cpu_percent("tcp", seconds=60, timeout=8)


# -- the small-message paths: frames taken in the readable callback, frames written at once -----
async def test_small_messages_reach_their_recv_without_waking_the_reader_task() -> None:
    """A small eager message whole in the receive buffer is handed to its recv from the readable
    callback: the reader task stays parked on the same wait for the whole exchange."""
    async with connected_pair("tcp") as (a, b):
        await a.send(np.zeros(1), tag=0)  # the channel is up and idle
        await b.recv(tag=0)
        io = b.channel._io  # type: ignore[attr-defined]
        await asyncio.sleep(0.01)
        parked = io._waiter
        assert parked is not None and io._parked
        out = np.empty(4)
        for i in range(50):
            recv = asyncio.ensure_future(b.recv(tag=1, out=out))  # posted first: express
            await asyncio.sleep(0)
            await a.send(np.arange(4.0) + i, tag=1)
            assert await asyncio.wait_for(recv, 5) is out
            assert np.array_equal(out, np.arange(4.0) + i)
            await a.send({"i": i, "x": np.full(3, i)}, tag=2)  # nobody waits: kept for the recv
            await asyncio.sleep(0.001)
            got = await asyncio.wait_for(b.recv(tag=2), 5)
            assert got["i"] == i and np.array_equal(got["x"], np.full(3, i))
        assert io._waiter is parked and not parked.done()


@pytest.mark.parametrize("posted", [True, False], ids=["recv-posted", "recv-later"])
async def test_a_corrupted_small_frame_is_never_delivered(posted: bool) -> None:
    """With checksums, a small message whose bytes were damaged on the way fails its recv with
    IntegrityError (the readable callback leaves the frame to the reader, which reports it)."""
    async with connected_pair("tcp", checksum=True) as (a, b):
        io = a.channel._io  # type: ignore[attr-defined]
        real = io.send_now

        def corrupting(bufs: list[object]) -> list[object]:
            last = bytearray(bufs[-2])  # the payload, before the crc32c trailer
            last[0] ^= 0x10
            return real([*bufs[:-2], last, bufs[-1]])  # type: ignore[list-item]

        recv = asyncio.ensure_future(b.recv(tag=1)) if posted else None
        await asyncio.sleep(0.01)
        io.send_now = corrupting
        await a.send(np.arange(16, dtype=np.uint8), tag=1)
        io.send_now = real
        if recv is None:
            await asyncio.sleep(0.05)
            recv = asyncio.ensure_future(b.recv(tag=1))
        with pytest.raises(tensorwire.IntegrityError):
            await asyncio.wait_for(recv, 5)


async def test_a_send_cancelled_while_its_one_frame_is_part_written_keeps_the_stream_whole() -> None:
    """A message in one frame that the socket takes only part of is finished before any other
    frame, even when its sender is cancelled meanwhile; what follows arrives intact."""
    # eager, one frame (chunk_bytes above its size), more than the socket takes at once
    async with connected_pair("tcp", limits=tensorwire.Limits(chunk_bytes=64 << 20)) as (a, b):
        x = np.full(32 << 20, 5, np.uint8)
        io = a.channel._io  # type: ignore[attr-defined]
        real, finished = io.send_rest, 0

        async def counted(rest: list[object]) -> None:
            nonlocal finished
            finished += 1
            await real(rest)

        io.send_rest = counted
        for spins in range(6):
            send = asyncio.ensure_future(a.send(x, tag=1))
            for _ in range(spins):
                await asyncio.sleep(0)
            send.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await send
            y = np.full(100, spins, np.uint8)
            await asyncio.wait_for(a.send(y, tag=1), 5)
            first = await asyncio.wait_for(b.recv(tag=1), 5)
            if first.nbytes == x.nbytes:  # the cancel came after the frame was written
                assert np.array_equal(first, x)
                first = await asyncio.wait_for(b.recv(tag=1), 5)
            assert np.array_equal(first, y)
        assert finished, "no send was part written: the test proves nothing"
