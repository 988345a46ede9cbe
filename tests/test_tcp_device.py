"""Device memory over the staged TCP channel when something goes wrong on the way, without a GPU
(the host engine stands in for one): a send whose copies out of device memory fail part way, a
recv whose copies into device memory fail, and a message landing in device memory whose consumer
stream stays busy while other messages follow it on the stream. Real nodes on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _device_paths import CHUNK, DEPTH, small_rings
from _polling import eventually

from tensorwire.errors import PeerDisconnected, TransferError
from tensorwire.memory import HostEngine, wait_event
from tensorwire.memory._engine import DeviceBuffer
from tensorwire.tensors import EngineArray
from tensorwire.testing import busy_stream, connected_pair
from tensorwire.transports import ChannelState, Limits

pytestmark = pytest.mark.timeout(60)


class _Refusing(HostEngine):
    """A host engine whose copies one way (``to_host`` or ``to_device``) fail as they are
    queued from the ``at``-th on, as a GPU's do after a CUDA error; ``copy_delay`` as HostEngine's."""

    def __init__(self, way: str = "", at: int = 0, copy_delay: float = 0.0) -> None:
        super().__init__(copy_delay=copy_delay)
        self.way, self.at, self.copies = way, at, 0

    def _new_lane(self) -> Any:
        lane = super()._new_lane()
        if self.way:
            queue = getattr(lane, self.way)

            def copy(*args: Any) -> None:
                self.copies += 1
                if self.copies >= self.at:
                    raise RuntimeError(f"device error: a copy {self.way.replace('_', ' ')} failed")
                queue(*args)

            setattr(lane, self.way, copy)
        return lane


class _Full(HostEngine):
    """A host engine with no memory left for buffers of tensorwire's (as CuPy's allocator says)."""

    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        with self.allocating(nbytes, "a buffer of tensorwire's"):
            raise MemoryError(f"Out of memory allocating {nbytes} bytes")


@pytest.fixture
def engine() -> Iterator[HostEngine]:
    yield from small_rings(HostEngine())


def _rings(engine: HostEngine) -> HostEngine:
    engine.pool("out").configure(CHUNK, DEPTH)
    engine.pool("in").configure(CHUNK, DEPTH)
    return engine


def _data(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


_CREDIT = {"eager": 1 << 20, "rendezvous": 0}


def _tid(tag: str) -> int:
    from tensorwire._peer import tag_id

    return tag_id(tag)


# -- a send failing part way --------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
async def test_a_send_failing_part_way_is_withdrawn_and_the_channel_goes_on(protocol: str) -> None:
    """A send of device memory whose copies out of it fail from the fifth staging chunk on (its
    header and the first chunks of its payload on the wire): the send raises TransferError with the cause,
    and the receiver is told at once that the message is withdrawn, as for a cancelled send: the
    recv posted for it takes the next message on its tag, and the message's slot (the peer
    grants one) comes back. Before, the send raised the device's error bare and sent no ABORT:
    the recv waited for the rest until the channel ended, and the next send waited for good for
    the slot the withdrawn message held."""
    sender = _rings(_Refusing("to_host", at=5))
    data = _data(CHUNK * 5 + 7)
    try:
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=_CREDIT[protocol], max_unexpected=1)) as (
            a,
            b,
        ):
            recv = asyncio.ensure_future(b.recv(tag="x"))
            await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match="failed part way") as failed:
                    await a.send(EngineArray(sender, data), tag="x")
                assert isinstance(failed.value.__cause__, RuntimeError)
                nxt = _data(1000)
                await a.send(nxt, tag="x")
                assert np.array_equal(await recv, nxt)
            assert a.channel.state is ChannelState.OPEN and b.channel.state is ChannelState.OPEN
            async with asyncio.timeout(10):
                _, back = await asyncio.gather(a.send(np.arange(7), tag="y"), b.recv(tag="y"))
            assert np.array_equal(back, np.arange(7))
            assert sender.pool("out").free == DEPTH
    finally:
        sender.close()


async def test_an_owner_whose_copy_out_fails_answers_a_read_with_the_error() -> None:
    """An owner-assisted read of an exposed device tensor whose copies out of device memory fail
    part way at the owner: the read raises TransferError at once, with the owner's reason, and
    the channel goes on. Before, the owner's send raised the device's error bare: no ABORT went
    out, and no error answer (``_serve_one`` answers TensorWireErrors): the read waited for good."""
    owner = _rings(_Refusing("to_host", at=5))
    src = _data(CHUNK * 5 + 7)
    try:
        async with connected_pair("tcp") as (a, b):
            a.node.expose(EngineArray(owner, src), name="t")
            a.node.expose(src, name="h")
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match="could not send"):
                    await b.read(await b.lookup("t"), out=np.zeros_like(src))
                assert np.array_equal(await b.read(await b.lookup("h")), src)
            assert b.channel.state is ChannelState.OPEN
    finally:
        owner.close()


# -- a recv whose copies into device memory fail ------------------------------------------------
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
@pytest.mark.parametrize("where", ["ring", "overflow"])
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
async def test_a_copy_into_device_memory_that_fails_drops_that_message_alone(
    protocol: str, where: str, checksum: bool
) -> None:
    """A recv into device memory whose copies up fail from the second one on (``ring``), or from
    the first one out of the overflow memory that takes the message past the staging ring behind
    a busy consumer stream (``overflow``): that recv raises TransferError with the cause, as over
    inproc and ucx; the sender's send returns; the next message on the tag arrives whole, and
    other tags go on. Before, the reader failed, and with it the channel (BrokenResourceError)."""
    engine = _rings(_Refusing("to_device", at=2 if where == "ring" else DEPTH + 1))
    data = _data(CHUNK * DEPTH * 2 + 5 if where == "overflow" else CHUNK * 5 + 7)
    credit = _CREDIT[protocol]
    if where == "overflow" and protocol == "rendezvous":
        credit = data.nbytes - CHUNK  # room for the overflow (the rest past the ring), not for all of it
    try:
        with busy_stream(engine) as (stream, gate):
            async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=credit), checksum=checksum) as (a, b):
                out = EngineArray(engine, np.zeros_like(data), stream=stream if where == "overflow" else None)
                recv = asyncio.ensure_future(b.recv(tag="x", out=out))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                send = asyncio.ensure_future(a.send(data, tag="x"))
                async with asyncio.timeout(10):  # (a busy stream stays busy all the while)
                    with pytest.raises(TransferError, match="could not be copied into device memory") as failed:
                        await recv
                    assert isinstance(failed.value.__cause__, RuntimeError)
                    await send
                    nxt = _data(CHUNK * 2 + 3)
                    _, got = await asyncio.gather(a.send(nxt, tag="x"), b.recv(tag="x", out=np.zeros_like(nxt)))
                    assert np.array_equal(got, nxt)
                    await asyncio.gather(a.send(np.arange(7), tag="y"), b.recv(tag="y"))
                assert b.channel.state is ChannelState.OPEN
                gate.set()
                await wait_event(engine, engine.record_on(stream))
                await eventually(lambda: b.channel._overflowing == 0)
        assert engine.pool("in").free == DEPTH
    finally:
        engine.close()


class _RefusingARecord(HostEngine):
    """A host engine whose lanes refuse to record one event, the first asked for once ``when()``
    holds (on a GPU: cudaEventRecord failing after the copy before it was queued)."""

    def __init__(self, when: Callable[[], bool]) -> None:
        super().__init__()
        self.when, self.refused = when, 0

    def _new_lane(self) -> Any:
        lane = super()._new_lane()
        record = lane.record

        def refusing() -> Any:
            if not self.refused and self.when():
                self.refused += 1
                raise RuntimeError("device error: an event could not be recorded")
            return record()

        lane.record = refusing  # type: ignore[method-assign]
        return lane


async def test_an_overflow_chunk_whose_copy_up_cannot_be_followed_by_an_event_is_not_lost() -> None:
    """A recv into device memory behind a busy consumer stream, its message going on past the
    staging ring through overflow chunks; the event after the first overflow chunk's copy up
    cannot be recorded: that message is dropped alone (TransferError with the cause), and the
    chunk, whose copy was queued and may still read it, is retired from the pool, so the pool
    has its depth again once the stream frees (a new chunk takes its place). Before, the chunk
    was neither given back nor retired: the pool counted it in use for good (``free`` 0 after
    the depth's worth of such failures) and never freed it (page-locked memory, on a GPU)."""
    b_channel: list[Any] = []

    def overflowing() -> bool:
        return bool(b_channel) and any(o.size for o in b_channel[0]._overflows.values())

    engine = _rings(_RefusingARecord(overflowing))
    data = _data(CHUNK * DEPTH * 2 + 5)
    try:
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            b_channel.append(b.channel)
            for _ in range(DEPTH):  # (one lost chunk each, before)
                engine.refused = 0
                with busy_stream(engine) as (stream, gate):
                    out = EngineArray(engine, np.zeros_like(data), stream=stream)
                    recv = asyncio.ensure_future(b.recv(tag="x", out=out))
                    await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                    async with asyncio.timeout(10):  # (the stream stays busy all the while)
                        await a.send(data, tag="x")
                        with pytest.raises(TransferError, match="could not be copied into device memory") as failed:
                            await recv
                        assert "could not be recorded" in str(failed.value.__cause__)
                    assert engine.refused == 1
                    gate.set()
                    await wait_event(engine, engine.record_on(stream))
                    await eventually(lambda: b.channel._overflowing == 0)
            async with asyncio.timeout(10):  # the channel and the pool go on
                nxt = _data(CHUNK * DEPTH + 3)
                got = EngineArray(engine, np.zeros_like(nxt))
                await asyncio.gather(a.send(nxt, tag="x"), b.recv(tag="x", out=got))
                assert np.array_equal(got.array, nxt)
        pool = engine.pool("in")
        assert (pool.free, pool.retired) == (DEPTH, DEPTH), pool
    finally:
        engine.close()


# -- a message landing behind a busy consumer stream ----------------------------------------------
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
async def test_a_message_landing_behind_a_busy_stream_holds_up_no_message_after_it(
    engine: HostEngine, protocol: str, checksum: bool
) -> None:
    """A recv into device memory whose consumer stream stays busy, of a message twice the
    staging ring: the messages after it on the stream (another tag, an RPC call's reply) come
    while the stream is still busy; the recv returns with its copies queued behind the stream,
    and its out= holds the message once the stream frees; the overflow memory is freed then.
    Before, tcp's reader waited for the stream once the ring was used up, and every message
    behind this one with it: the small message waited as long as the stream (3.0 s when held
    for 3 s; inproc and ucx took 1-4 ms)."""
    data = _data(CHUNK * DEPTH * 2 + 5)
    credit = 1 << 20 if protocol == "eager" else data.nbytes - CHUNK  # (room for the overflow, not for all of it)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=credit), checksum=checksum) as (a, b):

            @a.node.method("twice")
            async def twice(x: np.ndarray) -> np.ndarray:
                return x * 2

            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            big = asyncio.ensure_future(b.recv(tag="x", out=out))
            await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            send = asyncio.ensure_future(a.send(data, tag="x"))
            await eventually(lambda: engine.max_queued >= DEPTH)  # the ring is behind the stream
            async with asyncio.timeout(5):  # the stream stays busy all the while
                small = _data(100)
                _, got = await asyncio.gather(a.send(small, tag="y"), b.recv(tag="y"))
                assert np.array_equal(got, small)
                assert np.array_equal(await b.call("twice", np.arange(5)), np.arange(5) * 2)
                await send
                assert await big is out
            assert not gate.query(), "the stream was let go early"
            assert b.channel._overflowing > 0
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            assert np.array_equal(out.array, data)
            await eventually(lambda: b.channel._overflowing == 0)
    assert engine.pool("in").free == DEPTH


async def test_a_peers_close_behind_a_message_landing_behind_a_busy_stream_is_seen_at_once(
    engine: HostEngine,
) -> None:
    """The peer closes right after a message that lands behind a busy consumer stream: a recv on
    another tag raises PeerDisconnected while the stream is still busy, and the message, whole
    before the close, is delivered. Before, the close waited behind the message for the stream
    (the lease, 3 s, ended the channel first where the stream stayed busy longer)."""
    data = _data(CHUNK * DEPTH * 2 + 5)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            big = asyncio.ensure_future(b.recv(tag="x", out=out))
            await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            await a.send(data, tag="x")
            await a.aclose()
            async with asyncio.timeout(2):
                with pytest.raises(PeerDisconnected):
                    await b.recv(tag="z")
                assert await big is out
            assert not gate.query()
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            assert np.array_equal(out.array, data)


async def test_a_message_past_the_overflow_allowance_waits_for_its_stream(engine: HostEngine) -> None:
    """A message whose rest past the staging ring is more than the receiver allows for overflow
    memory (``Limits.recv_buffer_bytes``) takes none, and lands as before: the reader waits for
    the stream, and the message is whole once it frees."""
    data = _data(CHUNK * DEPTH * 3)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=CHUNK * DEPTH)) as (a, b):
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            big = asyncio.ensure_future(b.recv(tag="x", out=out))
            await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            send = asyncio.ensure_future(a.send(data, tag="x"))
            await eventually(lambda: engine.max_queued >= DEPTH)
            await asyncio.sleep(0.05)
            assert not big.done() and b.channel._overflowing == 0
            gate.set()
            async with asyncio.timeout(10):
                await send
                assert await big is out
            await wait_event(engine, engine.record_on(stream))
            assert np.array_equal(out.array, data)


@pytest.mark.parametrize("memory", ["device", "none"])
async def test_a_recv_cancelled_as_its_message_lands_in_overflow_memory_loses_nothing(memory: str) -> None:
    """A recv into device memory behind a busy stream, cancelled while its message's rest lands
    in overflow memory (the sender's copies out are slow, so it comes frame by frame), with device
    memory for a buffer of ours or none (the message then goes to host memory of ours, the cancel
    returning once what landed in out= is copied down, after the stream): the next recv gets the
    message whole."""
    sender = _rings(HostEngine(copy_delay=0.01))
    engine = _rings(HostEngine() if memory == "device" else _Full())
    data = _data(CHUNK * DEPTH * 3 + 5)
    try:
        with busy_stream(engine) as (stream, gate):
            async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
                out = EngineArray(engine, np.zeros_like(data), stream=stream)
                recv = asyncio.ensure_future(b.recv(tag="x", out=out))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                send = asyncio.ensure_future(a.send(EngineArray(sender, data), tag="x"))

                def spilling() -> bool:
                    return any(0 < o.room < o.size for o in b.channel._overflows.values())

                await eventually(spilling, pause=0)
                assert not recv.done()
                if memory == "none":  # the copy down of what landed waits for the stream
                    asyncio.get_running_loop().call_later(0.2, gate.set)
                recv.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await recv
                gate.set()
                async with asyncio.timeout(10):
                    await send
                    host = np.zeros_like(data)
                    assert await b.recv(tag="x", out=host) is host
                    assert np.array_equal(host, data)
                    await asyncio.gather(a.send(np.arange(7), tag="x"), b.recv(tag="x"))
                await eventually(lambda: b.channel._overflowing == 0)
    finally:
        sender.close()
        engine.close()


@pytest.mark.parametrize("memory", ["device", "none"])
@pytest.mark.parametrize("closer", ["peer", "peer-node"])
async def test_a_read_landing_behind_a_busy_stream_ends_at_its_owners_close(closer: str, memory: str) -> None:
    """An owner-assisted read whose answer (no overflow allowance: ``recv_buffer_bytes=0``)
    lands into device memory whose consumer stream stays busy, its owner closing meanwhile,
    the rest of the answer and the close in the socket buffers: the read raises
    PeerDisconnected for the owner's close while the stream is still busy, with device memory
    for buffers of ours or none, and once the stream frees the channel ends and every staging
    chunk is back in the pool. Before, the reader, waiting for the stream, read nothing, and
    the close behind the answer was learnt at the lease (30 s here); with no device memory the
    read's end waited for the stream, to copy down bytes nobody wanted (60 s, the test's limit).
    The rest of the answer past the ring is half a chunk, more than the reader's read-ahead and
    less than a new connection's receive window: with a whole ring's worth (192 KiB) the
    owner's kernel kept 68 KiB and its FIN in 1 run of 6 (FIN-WAIT-1: the reader's socket
    held 111 KB, its buffer not grown yet), and the read ended at the lease."""
    n = CHUNK * DEPTH + CHUNK // 2 + 5
    engine = _rings(HostEngine() if memory == "device" else _Full())
    owner = _rings(HostEngine())  # (its copies out are not counted in ``engine.max_queued``)
    try:
        with busy_stream(engine) as (stream, gate):
            async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=0), lease_seconds=30) as (a, b):
                a.node.expose(EngineArray(owner, _data(n)), name="t")
                h = await b.lookup("t")
                out = EngineArray(engine, np.zeros(n, np.uint8), stream=stream)
                read = asyncio.ensure_future(b.read(h, out=out))
                await eventually(lambda: engine.max_queued >= DEPTH)  # the ring is behind the stream
                assert not read.done()
                await {"peer": a.aclose, "peer-node": a.node.aclose}[closer]()
                # (a hang guard, not cancelling the read: the lease would take 30 s)
                await asyncio.wait([read], timeout=5)
                assert read.done(), "the read waited for the stream"
                with pytest.raises(PeerDisconnected) as failed:
                    await read
                assert "lease" not in str(failed.value), failed.value
                assert not gate.query(), "the stream was let go early"
                gate.set()
                await eventually(lambda: b.channel.state is not ChannelState.OPEN)
                await eventually(lambda: engine.pool("in").free == DEPTH and b.channel._overflowing == 0)
    finally:
        owner.close()
        engine.close()


@pytest.mark.parametrize("closing", ["node", "peer"])
@pytest.mark.parametrize("owner", ["client", "server"])
async def test_a_read_parked_behind_more_than_the_socket_buffers_ends_at_its_owners_goodbye(
    owner: str, closing: str
) -> None:
    """As above, but the rest of the answer is far more than the socket buffers hold (16 MiB):
    the owner's close stays in its kernel behind bytes the reader, parked behind the busy
    stream, does not take, so the socket never hangs up here. The owner's node says goodbye on
    the control plane as it closes, or as it closes only that peer (Leave; from the node that
    connected over its control connection, from the one that accepted over a new one to the
    address the other gave), and the read raises PeerDisconnected naming the close within
    seconds, not the lease (20 s here). Once the stream frees, the reader reads on to the close
    and the channel ends. Before, the read waited for the lease (the 5 s wait below ran out):
    for a node's close before f5426ab, for a peer's alone before this test's "peer" cases."""
    n = CHUNK * DEPTH + (16 << 20)
    engine = _rings(HostEngine())
    owner_engine = _rings(HostEngine())
    try:
        with busy_stream(engine) as (stream, gate):
            async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=0), lease_seconds=20) as (a, b):
                holder, reader = (a, b) if owner == "client" else (b, a)
                holder.node.expose(EngineArray(owner_engine, _data(n)), name="t")
                h = await reader.lookup("t")
                out = EngineArray(engine, np.zeros(n, np.uint8), stream=stream)
                read = asyncio.ensure_future(reader.read(h, out=out))
                await eventually(lambda: engine.max_queued >= DEPTH)  # the ring is behind the stream
                assert not read.done()
                await {"node": holder.node.aclose, "peer": holder.aclose}[closing]()
                # (a hang guard, not cancelling the read: the lease would take 20 s)
                await asyncio.wait([read], timeout=5)
                assert read.done(), "the read waited for the lease"
                # (a peer closed alone: its goodbye, or, where the owner's kernel drops the
                # connection at the close, a reset, seen at once too, may come first)
                said = "said goodbye" if closing == "node" else "said goodbye|peer closed the channel"
                with pytest.raises(PeerDisconnected, match=said) as failed:
                    await read
                assert "lease" not in str(failed.value), failed.value
                assert not gate.query(), "the stream was let go early"
                gate.set()
                await eventually(lambda: reader.channel.state is not ChannelState.OPEN, seconds=15)
                await eventually(lambda: engine.pool("in").free == DEPTH and reader.channel._overflowing == 0)
    finally:
        owner_engine.close()
        engine.close()
