"""The staged-TCP socket layer (``transports/tcp/_sockio.py``) on real sockets: how it waits for
a readable socket. The reader stays registered with the loop between reads, so a steady exchange
does not pay two epoll_ctl calls per message; it is removed when it fires with nobody waiting
(level-triggered, it would fire on every loop turn) and when the socket closes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import crc32c
import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire.tensors import prepare
from tensorwire.testing import connected_pair, idle_cpu_percent
from tensorwire.transports import Capabilities, ChannelState, Limits, Session, TransportContext
from tensorwire.transports._frames import (
    CHECKSUM,
    FLAG_CHECKSUM,
    HEADER,
    RENDEZVOUS,
    TRAILER,
    FrameHeader,
    FrameType,
    PeerLimits,
    pack,
    unpack,
)
from tensorwire.transports.tcp import TcpTransport, _sockio
from tensorwire.transports.tcp import _channel as _channel_mod
from tensorwire.transports.tcp._channel import TcpChannel
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
    # idle for 60 s with 4 s to do it: the child is killed, and the error names its last step
    # (it imports in 0.2 s here, 0.4 s with both cores busy)
    with pytest.raises(AssertionError, match=r"did not finish in 4 s; they got as far as: imported( -> \w+)*"):
        idle_cpu_percent("tcp", seconds=60, timeout=4)


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

        async def counted(rest: list[object], *more: object) -> None:
            nonlocal finished
            finished += 1
            await real(rest, *more)

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


# -- a TcpChannel on one end of a loopback connection, the other end driven frame by frame -------
MiB = 1 << 20


@asynccontextmanager
async def _channel(
    limits: Limits | None = None, *, remote: PeerLimits | None = None, checksum: bool = False
) -> AsyncIterator[tuple[TcpChannel, socket.socket]]:
    """A channel on a loopback TCP connection (past its handshake) and the raw, non-blocking
    socket of its peer; ``remote``: what that peer promised (by default, plenty)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        mine, _ = listener.accept()
    peer.setblocking(False)
    flags = FLAG_CHECKSUM if checksum else 0
    remote = remote or PeerLimits(64 * MiB, 1024, 1 << 40, MiB, flags)
    ch = TcpChannel(SockIO(mine), limits or Limits(), remote, name="test", checksum=checksum)
    try:
        yield ch, peer
    finally:
        ch.abort()
        await ch.aclose()
        peer.close()


def _frame(
    ftype: FrameType,
    *,
    flags: int = 0,
    meta: bytes = b"",
    payload: bytes = b"",
    msg_id: int = 0,
    arg: int = 0,
    checksum: bool = False,
) -> bytes:
    """One frame as a peer writes it: MSG and DATA end in a crc32c trailer where ``checksum``."""
    summed = checksum and ftype in (FrameType.MSG, FrameType.DATA)
    raw = pack(ftype, flags | (CHECKSUM if summed else 0), len(meta), len(payload), msg_id, arg, checked=checksum)
    raw += meta + payload
    return raw + TRAILER.pack(crc32c.crc32c(raw)) if summed else raw


async def _read_frame(peer: socket.socket, *, checksum: bool = False) -> tuple[FrameHeader, bytes]:
    """The next frame the channel wrote: its header, and its metadata and payload."""
    loop = asyncio.get_running_loop()

    async def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = await loop.sock_recv(peer, n - len(data))
            assert got, "the channel closed the connection"
            data += got
        return data

    hdr = unpack(await exactly(HEADER.size), checked=checksum)
    body = await exactly(hdr.meta_len + hdr.payload_len + (TRAILER.size if hdr.flags & CHECKSUM else 0))
    return hdr, body


def _fill(sock: socket.socket, data: bytes) -> None:
    """Put all of ``data`` in the kernel's buffers now, nobody reading yet (a loopback
    connection holds a few MiB)."""
    sock.setblocking(False)
    view = memoryview(data)
    while view:
        view = view[sock.send(view) :]


async def test_a_rendezvous_header_whose_trailer_comes_later_still_reaches_its_recv() -> None:
    """With checksums, a rendezvous MSG frame's crc32c trailer may reach the socket after the
    rest of the frame (TCP splits anywhere). Before, the recv posted for it was handed the
    message while the reader still waited for the trailer, found nothing to pull and failed
    (TransferError); the message went back to the queue marked as pulled, so no CTS ever went
    out and every later recv on the tag, and the sender, waited for good."""
    loop = asyncio.get_running_loop()
    async with _channel(checksum=True) as (ch, peer):
        x = np.arange(1024.0)
        out = np.zeros_like(x)
        recv = asyncio.ensure_future(ch.recv(5, out))
        await asyncio.sleep(0.01)
        msg = _frame(FrameType.MSG, flags=RENDEZVOUS, meta=prepare(x).header, msg_id=1, arg=5, checksum=True)
        await loop.sock_sendall(peer, msg[: -TRAILER.size])
        await asyncio.sleep(0.05)
        assert not recv.done(), recv
        await loop.sock_sendall(peer, msg[-TRAILER.size :])
        async with asyncio.timeout(5):
            hdr, _ = await _read_frame(peer, checksum=True)
            assert (hdr.type, hdr.msg_id) == (FrameType.CTS, 1)
            await loop.sock_sendall(peer, _frame(FrameType.DATA, payload=x.tobytes(), msg_id=1, checksum=True))
            got, receipt = await recv
        assert got is out and np.array_equal(out, x)
        assert receipt.protocol == "rendezvous"


@pytest.mark.parametrize("path", ["reader-task", "readable-callback"])
async def test_a_flood_of_small_frames_lets_the_loop_run(path: str) -> None:
    """A peer that keeps the socket full of frames that need no waiting, ABORTs of messages it
    never sent (taken by the reader task) or empty CREDITs (taken in the readable callback),
    all legal and ignored, must not hold the event loop: here 1 MiB of them waits in the socket,
    then the close. Before, the reader took them all and the close without the loop running
    anything else (a peer that keeps sending held it for good, and the node missed its lease
    renewals); now it lets the loop run every so often, as ``read_into`` does for payloads."""
    async with _channel() as (ch, peer):
        await asyncio.sleep(0.01)  # the reader is parked between frames
        if path == "reader-task":
            flood = _frame(FrameType.ABORT, msg_id=999) * ((1 << 20) // HEADER.size)
        else:
            # one small message first, so that the 16 KiB reads never end on a frame boundary
            # (the callback went back to the loop, by chance, whenever one did)
            for n in range(1, 17):
                x = np.zeros(n, np.uint8)
                flood = _frame(FrameType.MSG, meta=prepare(x).header, payload=x.tobytes(), msg_id=1, arg=1)
                if len(flood) % 16:
                    break
            flood += _frame(FrameType.CREDIT) * ((1 << 20) // HEADER.size)
        _fill(peer, flood)
        peer.shutdown(socket.SHUT_WR)
        turns = 0
        async with asyncio.timeout(10):
            while ch.state is ChannelState.OPEN:
                turns += 1
                await asyncio.sleep(0)
        # the reader got to the close (the channel breaks there), and this task ran meanwhile;
        # before, only in the few turns until the reader started on the flood
        assert ch.state is ChannelState.BROKEN
        assert turns > 8, turns


async def test_a_large_message_lets_the_loop_run_between_its_data_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large payload comes as many DATA frames, each read by its own ``read_into``. The
    reader yields after ``_YIELD_EVERY`` bytes read without waiting, but counted them per call,
    and a frame (``chunk_bytes``, 4 MiB) is smaller than the 8 MiB: a receiver slower than its
    sender (a recv into fresh memory, whose page faults slow it) never found the socket empty
    and held the loop for the whole message. Measured, 1 GiB over tcp between two processes:
    the receiver's loop stopped 1.1-3.8 s, every small send, call and read waited for the whole
    transfer, and at a 1-3 s lease the sender declared the receiver dead mid-message. Here the
    limit is lowered so that a few MiB waiting in the socket, read as 64 KiB frames, cross it:
    the loop must run while the message is part received, and a small message on another tag
    behind its second frame must reach its recv before the large one is whole."""
    monkeypatch.setattr(_sockio, "_YIELD_EVERY", 128 * 1024)
    async with _channel() as (ch, peer):
        n, piece = 2 * MiB, 64 * 1024
        x = np.full(n, 255, np.uint8)
        out = np.zeros(n, np.uint8)
        big = asyncio.ensure_future(ch.recv(7, out))
        small_out = np.zeros(2, np.float32)
        whole_when_small_came: list[bool] = []

        async def small() -> None:
            await ch.recv(8, small_out)
            whole_when_small_came.append(bool(out[-1]))

        small_task = asyncio.ensure_future(small())
        await asyncio.sleep(0.01)  # both recvs posted, the reader parked between frames
        y = np.ones(2, np.float32)
        data = _frame(FrameType.MSG, meta=prepare(x).header, payload=x[:piece].tobytes(), msg_id=1, arg=7)
        for off in range(piece, n, piece):
            data += _frame(FrameType.DATA, payload=x[off : off + piece].tobytes(), msg_id=1, arg=off)
            if off == piece:
                data += _frame(FrameType.MSG, meta=prepare(y).header, payload=y.tobytes(), msg_id=2, arg=8)
        _fill(peer, data)  # all of it waits in the socket: the reader never finds it empty
        part_received = 0
        async with asyncio.timeout(10):
            while not big.done():
                part_received += bool(out[0]) and not out[-1]
                await asyncio.sleep(0)
            await big
            await small_task
        assert np.array_equal(out, x) and np.array_equal(small_out, y)
        # before: 0 turns and the small message's recv returned after the large one was whole
        assert part_received >= 4, part_received
        assert whole_when_small_came == [False]


async def test_a_small_message_beside_a_large_one_shortens_the_large_ones_next_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame goes out whole, so a small message sent while a large one goes out waits for the
    large one's frame in progress: ``chunk_bytes`` (4 MiB, ~5 ms on a 2-core loopback; 1 ms behind
    512 KiB, docs/benchmarks.md). Once a small message went out beside a large one, the large
    one's next frames are ``QUICK_CHUNK`` at most (for ``QUICK_SECONDS``, lengthened here so that
    nothing hangs on the clock); a large message alone keeps ``chunk_bytes`` frames. Counted on
    the wire: the frames the peer reads, in order. Before, every frame was ``chunk_bytes``."""
    monkeypatch.setattr(_channel_mod, "QUICK_SECONDS", 600.0, raising=False)
    remote = PeerLimits(256 * MiB, 1024, 1 << 40, MiB)  # room for both large ones eager
    async with _channel(remote=remote) as (ch, peer):
        chunk = Limits().chunk_bytes
        big = np.full(12 * chunk, 3, np.uint8)  # more than the socket holds: its frames wait for reads

        async def frames(want: int) -> list[tuple[FrameType, int, int, int]]:
            """(type, msg id, offset or tag, payload bytes) of each frame until ``want`` payload bytes came."""
            seen, got = [], 0
            while got < want:
                hdr, _ = await _read_frame(peer)
                seen.append((hdr.type, hdr.msg_id, hdr.arg, hdr.payload_len))
                got += hdr.payload_len
            return seen

        async with asyncio.timeout(15):
            alone = asyncio.ensure_future(ch.send(1, prepare(big)))
            sizes = [n for _, _, _, n in await frames(big.nbytes)]
            await alone
            assert sizes == [chunk] * 12  # the MSG frame's inline part, then 11 DATA frames

            large = asyncio.ensure_future(ch.send(1, prepare(big)))
            await asyncio.sleep(0.05)  # its frames fill the socket; the writer waits for reads
            assert not large.done()
            small = asyncio.ensure_future(ch.send(2, prepare(np.arange(2.0))))
            seen = await frames(big.nbytes + 16)
            await large
            await small
        at = next(i for i, f in enumerate(seen) if f[0] is FrameType.MSG and f[2] == 2)
        data = [f for f in seen if f[1] == seen[0][1]]  # the large one's frames, in order
        offsets = [f[2] for f in data[1:]]
        assert offsets == list(itertools.accumulate(f[3] for f in data[:-1]))  # contiguous
        before, after = seen[:at], [f[3] for f in seen[at + 1 :]]
        assert after and all(n <= 512 << 10 for n in after), (len(before), after[:4])  # QUICK_CHUNK
        assert all(f[3] == chunk for f in before)


async def test_a_send_cancelled_before_its_frame_went_out_hands_its_slot_to_a_waiting_send() -> None:
    """A send that took the peer's last message slot and was cancelled before its frame went out
    gives the slot back here; a send waiting for one must take it. Before, it waited for the
    peer to return a slot, which a peer that has not consumed anything yet never does."""
    remote = PeerLimits(64 * MiB, 2, 1 << 40, MiB)  # two message slots
    async with _channel(Limits(chunk_bytes=16 * MiB), remote=remote) as (ch, peer):
        big = np.ones(16 * MiB, np.uint8)  # one frame, more than the socket takes: it holds the turn
        first = asyncio.ensure_future(ch.send(1, prepare(big)))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(ch.send(2, prepare(np.arange(4.0))))  # the last slot; waits for the turn
        await asyncio.sleep(0.01)
        third = asyncio.ensure_future(ch.send(3, prepare(np.arange(4.0))))  # waits for a slot
        await asyncio.sleep(0.01)
        assert not (first.done() or second.done() or third.done())
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await second

        async def tags() -> list[int]:  # the peer reads on, returning nothing
            seen = []
            while len(seen) < 2:
                hdr, _ = await _read_frame(peer)
                if hdr.type is FrameType.MSG:
                    seen.append(hdr.arg)
            return seen

        async with asyncio.timeout(5):
            reading = asyncio.ensure_future(tags())
            await first
        async with asyncio.timeout(2):
            await third
            assert await reading == [1, 3]  # the cancelled send never reached the wire


async def test_aclose_returns_when_the_peer_stopped_reading() -> None:
    """aclose bounds its BYE by a second; with the kernel's send buffer full (a peer that stopped
    reading: hung, stopped, or gone without a reset) the BYE cannot go, and the close goes on
    without it. Before, the BYE was written like any frame, finished whatever cancellation came,
    and aclose never returned."""
    async with _channel() as (ch, peer):
        await ch.send(1, prepare(np.arange(4.0)))  # a working channel, idle: nobody's turn
        # the kernel's buffer full, as whole frames to a peer that stopped reading leave it
        # (these bytes are never read)
        sock = ch._io.sock
        with contextlib.suppress(BlockingIOError):
            while True:
                sock.send(b"\0" * 65536)
        closing = asyncio.ensure_future(ch.aclose())
        try:
            await asyncio.wait_for(asyncio.shield(closing), 5)
        finally:
            peer.close()  # an aclose still writing the BYE fails now, and ends
            await asyncio.wait_for(closing, 5)
        assert ch.state is ChannelState.CLOSED


async def test_what_was_sent_before_aclose_reaches_a_peer_that_sends_while_it_closes() -> None:
    """Messages whose sends returned before aclose, and its BYE, reach a peer that reads them at
    its own pace and sends a frame of its own (credit back for what it took) as the channel
    closes. Before, the socket was closed at once with those bytes still queued in the kernel:
    the peer's frame then reached a closed socket, whose kernel answered with a reset and
    dropped what it still held for the peer: of 4 messages none or one came, and no BYE (the
    peer's read failed with ConnectionResetError). Two channels meet it as a recv that raises
    PeerDisconnected ("Connection reset by peer") where messages sent before the close were due."""
    loop = asyncio.get_running_loop()
    async with _channel() as (ch, peer):
        n = 4
        kinds: list[FrameType] = []

        async def read_at_its_pace() -> None:  # 64 KiB a millisecond, frame by frame
            data = bytearray()
            while FrameType.BYE not in kinds:
                got = await loop.sock_recv(peer, 64 << 10)
                assert got, f"the channel closed the connection after {kinds}"
                data += got
                while len(data) >= HEADER.size:
                    hdr = unpack(bytes(data[: HEADER.size]))
                    end = HEADER.size + hdr.meta_len + hdr.payload_len
                    if len(data) < end:
                        break
                    del data[:end]
                    kinds.append(hdr.type)
                await asyncio.sleep(0.001)

        reading = asyncio.ensure_future(read_at_its_pace())
        for i in range(n):
            await asyncio.wait_for(ch.send(1, prepare(np.full(MiB, i, np.uint8))), 5)
        closing = asyncio.ensure_future(ch.aclose())
        await eventually(lambda: ch.state is ChannelState.CLOSED, 5, pause=0)
        peer.send(pack(FrameType.CREDIT))  # what a peer sends at any time
        try:
            await asyncio.wait_for(reading, 5)
        except ConnectionResetError:
            pytest.fail(f"the connection was reset after {kinds.count(FrameType.MSG)} of {n} messages")
        assert kinds == [FrameType.MSG] * n + [FrameType.BYE]
        peer.shutdown(socket.SHUT_WR)  # the peer's close, as a channel closes at the BYE
        await asyncio.wait_for(closing, 5)


@pytest.mark.parametrize(
    "address",
    [b"127.0.0.1:70000", b"127.0.0.1:-1", b"127.0.0.1:0", b"a..b:80", b"a\x00b:80", b"x" * 300 + b":80"],
    ids=["port-past-65535", "negative-port", "port-0", "empty-label", "nul", "long-label"],
)
async def test_a_malformed_address_is_a_connect_error(address: bytes) -> None:
    """The tcp address a server offers is an opaque blob to the control plane: one the socket
    module or the resolver refuses fails the connect with ConnectError, no OverflowError,
    UnicodeError or ValueError."""
    transport = TcpTransport(TransportContext("n", "127.0.0.1", Limits(handshake_seconds=2)), Capabilities())
    session = Session("sid", b"k" * 32, "a", "b", Limits())
    try:
        with pytest.raises(tensorwire.ConnectError):
            await transport.connect(transport.dial_address(address, "127.0.0.1"), session)
    finally:
        await transport.aclose()
