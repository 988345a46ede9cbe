"""A recv into device memory cancelled while its message's bytes land, when the device has no
memory left for a buffer of tensorwire's to keep them in (the host engine stands in for a GPU):
the message is kept in host memory and goes whole to the next recv on its tag; with no host
memory either, it is dropped alone and that next recv says so. Real nodes on loopback over tcp,
inproc and ucx (its staged path, and its path by pointer, which lands in the out= itself)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _device_paths import CHUNK, DEPTH, PATHS, small_rings
from _polling import eventually

from tensorwire import start
from tensorwire.errors import TransferError
from tensorwire.memory import HostEngine
from tensorwire.memory._engine import DeviceBuffer
from tensorwire.tensors import EngineArray
from tensorwire.testing import busy_stream, cancel_recv_at_every_step, connected_pair, host_engine_by_pointer
from tensorwire.transports import Limits

pytestmark = pytest.mark.timeout(60)

_PATHS = PATHS


class _Full(HostEngine):
    """A host engine standing in for a GPU whose memory is all taken: every buffer of
    tensorwire's (``empty``) fails as CuPy's allocator does, with a MemoryError."""

    def __init__(self) -> None:
        super().__init__(copy_delay=0.0002)  # copies slower than the wire: the landing takes turns
        self.refused = 0

    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        self.refused += 1
        with self.allocating(nbytes, "a buffer of tensorwire's"):
            raise MemoryError(f"Out of memory allocating {nbytes} bytes")


@pytest.fixture
def engine() -> Iterator[_Full]:
    yield from small_rings(_Full())


def _data(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize(("transport", "by_pointer"), _PATHS)
@pytest.mark.parametrize("nbytes", [CHUNK * 5 + 7, 3 << 20], ids=["eager", "rendezvous"])
async def test_a_device_recv_cancelled_at_every_step_with_no_device_memory_loses_nothing(
    engine: _Full, transport: str, by_pointer: bool, nbytes: int
) -> None:
    """A recv into device memory cancelled after 0..14 loop turns (before the header, as the
    bytes land, once they have), the device having no memory for a buffer of ours: the cancel
    raises CancelledError, its out= is never written after, and the next recv gets the whole
    message. Before, over tcp and ucx by pointer, the cancel raised TransferError ("out of
    memory on host-engine:0") and the message was lost: the next recv waited for good."""
    data = _data(nbytes)
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        if by_pointer:
            host_engine_by_pointer(a, b)
        cancelled = await cancel_recv_at_every_step(
            a,
            b,
            EngineArray(engine, data),
            lambda: EngineArray(engine, np.zeros_like(data)),
            lambda t: t.array.copy(),
        )
    assert cancelled >= 3, f"only {cancelled} of 10 recvs were cancelled before they completed"
    if transport == "tcp" or by_pointer:  # (the others never kept it on the device)
        assert engine.refused, "no recv was cancelled with bytes in its out="


def _held(peer: Any, tag: str) -> Any:
    """The message on ``tag`` that a recv of ``peer``'s holds, or None."""
    from tensorwire._peer import tag_id

    tid = tag_id(tag)
    return next((m for m in peer.channel.mailbox._held if m.tag == tid), None)


@pytest.mark.parametrize(("transport", "by_pointer"), [p for p in _PATHS if p.id in ("tcp", "ucx-pointer")])
@pytest.mark.parametrize("then", ["device", "host", "none"])
async def test_a_device_recv_cancelled_as_its_bytes_land_with_no_device_memory_keeps_them_on_the_host(
    engine: _Full, transport: str, by_pointer: bool, then: str
) -> None:
    """A recv into device memory cancelled once part of the message has landed in its out=
    (tcp: more frames to come; ucx: UCX writes the whole, and the cancel waits for it), with no
    device memory for a buffer of ours: what landed is copied to host memory of ours before the
    cancel returns, the rest lands there, and the next recv, into device memory, into host
    memory or without out=, gets the message whole. A message on the same tag after it follows
    it. Before, the cancel raised TransferError, and the message was lost."""
    data = _data(3 << 20)
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        if by_pointer:
            host_engine_by_pointer(a, b)
            # as where UCX had matched the payload receive and writes it (it cannot be taken back):
            # a cancel in the turns before it matched takes the receive back, nothing landed and
            # nothing to copy aside (test_ucx_edges' take_back tests), which is not this test
            b.channel.take_back = lambda arrival: False  # type: ignore[method-assign]
        out = EngineArray(engine, np.zeros_like(data))
        recv = asyncio.ensure_future(b.recv(tag="x", out=out))
        send = asyncio.ensure_future(a.send(EngineArray(engine, data), tag="x"))

        def landing() -> bool:  # tcp: its staging chunks began; ucx: its receive was posted
            m = _held(b, "x")
            return m is not None and (m.landing is not None or getattr(m, "transfer", None) is not None)

        await eventually(landing, pause=0)
        m = _held(b, "x")
        whole = m.done.done()
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        assert not whole, "the message had landed whole before the cancel"
        snapshot = out.array.copy()
        assert engine.refused
        async with asyncio.timeout(10):
            await send
            if then == "device":
                second = EngineArray(engine, np.zeros_like(data))
                assert await b.recv(tag="x", out=second) is second
                got = second.array
            elif then == "host":
                host = np.zeros_like(data)
                assert await b.recv(tag="x", out=host) is host
                got = host
            else:
                got = await b.recv(tag="x")
            assert isinstance(got, np.ndarray) and np.array_equal(got, data), "the message came back changed"
            await asyncio.gather(a.send(np.arange(7), tag="x"), b.recv(tag="x"))
        assert np.array_equal(out.array, snapshot), "out= was written after its recv was cancelled"


async def test_a_device_recv_cancelled_on_a_busy_stream_leaves_staging_chunks_to_other_channels(
    engine: _Full,
) -> None:
    """A recv into device memory on a consumer stream that stays busy, cancelled as its bytes
    land with no device memory for a buffer of ours: the copy of what landed down to the host
    comes after the copies into out=, which wait for that stream, and so does the cancel. A
    send of ready device memory on another channel, which takes staging chunks of the same
    process-wide pool, goes on meanwhile. Before, the copy down took those chunks at once, its
    copies queued behind the busy stream, and the other send waited for that stream."""
    data = _data(CHUNK * DEPTH * 4 + 5)  # more than the message parks before it waits for the stream
    # no room for overflow chunks, which would take the rest past the ring (the recv returning
    # at once, its copies queued behind the stream: tests/test_tcp_device.py); every message
    # rendezvous
    limits = Limits(recv_buffer_bytes=0)
    with busy_stream(engine) as (stream, gate):
        async with (
            connected_pair("tcp", limits=limits) as (a, b),
            connected_pair("tcp", limits=limits) as (c, d),
        ):
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            recv = asyncio.ensure_future(b.recv(tag="x", out=out))
            send = asyncio.ensure_future(a.send(data, tag="x"))
            await eventually(lambda: engine.max_queued >= 1)  # its copies up queued behind the stream
            recv.cancel()
            await eventually(lambda: engine.refused > 0)  # the cancel is copying what landed down
            await asyncio.sleep(0.05)
            assert not recv.done(), "the cancel returned before the copies into out= had run"
            small = _data(CHUNK + 5)
            async with asyncio.timeout(10):  # the stream stays busy all the while
                _, got = await asyncio.gather(c.send(EngineArray(engine, small), tag="y"), d.recv(tag="y"))
            assert np.array_equal(got, small)
            assert not gate.query() and not recv.done()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(10):
                    await recv
            snapshot = out.array.copy()
            async with asyncio.timeout(10):
                await send
                assert np.array_equal(await b.recv(tag="x"), data), "the message came back changed"
        assert np.array_equal(out.array, snapshot), "out= was written after its recv was cancelled"
    assert engine.pool("out").free == DEPTH


# -- a chunk under way -----------------------------------------------------------------------------
_SENDER = """
import asyncio, sys
import numpy as np
import tensorwire

async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        peer = await node.connect(sys.argv[1])
        data = np.random.default_rng(7).integers(0, 256, int(sys.argv[2]), dtype=np.uint8)
        for _ in range(int(sys.argv[3])):
            await peer.send(data, tag="x")
        await peer.send(np.arange(7), tag="x")
        await peer.recv(tag="bye")

asyncio.run(main())
"""


_TRIES = 4  # messages the sender sends: a try that misses its chunk lets the message land whole


async def _held_by(peer: Any, recv: asyncio.Future[Any]) -> Any:
    """The message on tag x that ``recv`` holds once it holds one; None where it ended first."""
    await eventually(lambda: _held(peer, "x") is not None or recv.done(), seconds=30)
    return _held(peer, "x")


async def _stopped_part_way(pid: int, m: Any) -> bool:
    """Stop the sender (SIGSTOP) while a staging chunk of ``m`` is part way read off the socket;
    False, the sender going on, where ``m`` landed whole first."""
    for _ in range(100):
        await eventually(lambda: (m.landed or 0) > m.written or m.done.done(), seconds=30, pause=0)
        if m.done.done():
            return False
        os.kill(pid, signal.SIGSTOP)
        landed = -1
        while landed != m.landed:  # until the socket is drained
            landed = m.landed
            await asyncio.sleep(0.02)
        if m.landed > m.written and not m.done.done():
            return True
        os.kill(pid, signal.SIGCONT)
    return False


@pytest.mark.multiprocess
@pytest.mark.parametrize("then", ["device", "host"])
async def test_a_tcp_recv_into_device_memory_cancelled_mid_chunk_with_no_device_memory_loses_nothing(
    then: str,
) -> None:
    """Over tcp a device out= takes its bytes through staging chunks. The sender (a process of
    its own) is stopped (SIGSTOP) while a chunk is part way read off the socket, the recv is
    cancelled then with no device memory for a buffer of ours, and the sender goes on: the
    chunk under way, and every byte after it, goes to the host memory of ours that took what
    had landed, and the next recv gets the message whole. Before, the cancel raised
    TransferError and the message was lost. The sender sends the message up to four times: a
    recv whose message landed whole before the sender was caught part way takes it, checked,
    and the next message is tried."""
    nbytes = 64 << 20
    data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    engine = _Full()
    engine.copy_delay = 0.0  # the chunks' copies keep up: the reader waits only for the socket
    engine.pool("in").configure(CHUNK, DEPTH)
    try:
        async with start("127.0.0.1:0", transports=("tcp",)) as node:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", textwrap.dedent(_SENDER), node.address, str(nbytes), str(_TRIES)
            )
            try:
                peer = await asyncio.wait_for(node.accept(), 30)
                for tried in range(1, _TRIES + 1):
                    out = EngineArray(engine, np.zeros(nbytes, np.uint8))
                    recv = asyncio.ensure_future(peer.recv(tag="x", out=out))
                    m = await _held_by(peer, recv)
                    if m is not None and await _stopped_part_way(proc.pid, m):
                        break
                    async with asyncio.timeout(30):
                        assert await recv is out
                    assert np.array_equal(out.array, data), f"message {tried} came back changed"
                else:
                    pytest.fail(f"the sender never stopped part way through a frame, in {_TRIES} messages")
                recv.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await recv
                snapshot = out.array.copy()
                os.kill(proc.pid, signal.SIGCONT)
                async with asyncio.timeout(30):
                    for _ in range(tried, _TRIES + 1):  # the cancelled message, then those after it
                        if then == "device":
                            second = EngineArray(engine, np.zeros(nbytes, np.uint8))
                            await peer.recv(tag="x", out=second)
                            got = second.array
                        else:
                            got = await peer.recv(tag="x", out=np.zeros(nbytes, np.uint8))
                        assert np.array_equal(got, data)
                    assert np.array_equal(await peer.recv(tag="x"), np.arange(7))
                    await peer.send(np.arange(1), tag="bye")
                    await proc.wait()
                assert engine.refused
                assert np.array_equal(out.array, snapshot), "out= was written after its recv was cancelled"
            finally:
                if proc.returncode is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                await proc.wait()
    finally:
        engine.close()


# -- no host memory either ------------------------------------------------------------------------
_CAPPED = """
import asyncio, json, resource, sys
import numpy as np
from tensorwire import start
from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray
from tensorwire.testing import connected_pair, host_engine_by_pointer
from tensorwire.transports import Limits
from tensorwire._peer import tag_id

transport, by_pointer, nbytes = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])

def report(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)

def cap(headroom):
    size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))

async def attempt(step, coro, check=lambda v: int(np.asarray(v).sum(dtype=np.uint64))):
    try:
        v = await asyncio.wait_for(coro, 30)
    except BaseException as exc:
        report(step, error=type(exc).__name__, text=str(exc))
    else:
        report(step, value=check(v))

async def main():
    engine = HostEngine(copy_delay=0.0002)
    engine.pool("out").configure(64 << 10, 3)
    engine.pool("in").configure(64 << 10, 3)
    src = EngineArray(engine, (np.arange(nbytes, dtype=np.uint32) % 251).astype(np.uint8))
    out = EngineArray(engine, np.zeros(nbytes, np.uint8))
    host = np.zeros(nbytes, np.uint8)
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        if by_pointer:
            host_engine_by_pointer(a, b)
        for o in (out, host):  # every path warmed up before the cap (lanes, staging chunks)
            await asyncio.gather(a.send(src, tag="warm"), b.recv(tag="warm", out=o))
        mailbox, tid = b.channel.mailbox, tag_id("d")
        recv = asyncio.ensure_future(b.recv(tag="d", out=out))
        send = asyncio.ensure_future(a.send(src, tag="d"))
        while not any(m.tag == tid and (m.landing is not None or m.written) for m in mailbox._held):
            await asyncio.sleep(0)
        cap(nbytes // 3)  # neither device memory (the host engine's is the host's) nor host memory
        try:
            np.empty(nbytes, np.uint8)
        except MemoryError:
            report("capped")
        recv.cancel()
        await attempt("cancelled", recv)
        await attempt("sent", send, lambda receipt: 0)
        await attempt("next", b.recv(tag="d", out=host))
        after = asyncio.gather(a.send(np.arange(7), tag="d"), b.recv(tag="d"))
        await attempt("after", after, lambda v: int(v[1].sum()))
    engine.close()

asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "by_pointer"), [p for p in _PATHS if p.id in ("tcp", "ucx-pointer")])
async def test_a_device_recv_cancelled_with_no_memory_anywhere_drops_its_message_alone(
    transport: str, by_pointer: bool
) -> None:
    """As above, in a process whose address space is capped as the bytes land, so that neither
    device memory (the host engine's is the host's) nor host memory can be had for the message:
    the cancel still raises CancelledError; the message is dropped alone, and the next recv on
    its tag raises TransferError saying so; the message after it arrives. Before, the cancel
    raised TransferError and the next recv waited for good (30 s), the message after taking its
    place."""
    nbytes = 48 << 20
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(_CAPPED),
        transport,
        "1" if by_pointer else "0",
        str(nbytes),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "MALLOC_ARENA_MAX": "1"},  # (see test_out_of_memory._child)
    )
    got: dict[str, Any] = {}
    try:
        assert proc.stdout is not None
        while line := await asyncio.wait_for(proc.stdout.readline(), 60):
            step = json.loads(line)
            got[step["step"]] = step
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert "capped" in got, got
    assert got["cancelled"].get("error") == "CancelledError", got["cancelled"]
    assert "error" not in got["sent"], got["sent"]
    assert got["next"].get("error") == "TransferError", got["next"]
    assert "dropped" in got["next"]["text"] and "out of memory" in got["next"]["text"], got["next"]
    assert got["after"].get("value") == 21, got["after"]


# -- checksums -------------------------------------------------------------------------------------
class _NoCopyDown(_Full):
    """``_Full`` whose copies from device memory to the host fail (a device error), so that
    what landed in a cancelled recv's device out= cannot be copied out and its message is lost."""

    def _new_lane(self) -> Any:
        from tensorwire.memory._engine import _HostLane

        class Lane(_HostLane):
            def to_host(self, *args: Any) -> None:
                raise RuntimeError("device error: the copy to the host failed")

        lane = Lane(self)
        self._all_lanes.append(lane)
        return lane


async def test_a_checksummed_tcp_message_lost_as_its_host_part_lands_fails_alone() -> None:
    """checksum=True over tcp: a message of a device tensor then a large host one, whose recv is
    cancelled while the host part is read off the socket, with no device memory for buffers of
    ours; the device part cannot be copied down, so the message is dropped and the rest of it
    lands in scratch. The recv that takes it raises TransferError and the next message comes:
    the channel lives. Before, the frame's crc32c was summed over the scratch buffer, each piece
    over the last, after the read, and the channel closed with IntegrityError."""
    dev, host = _data(CHUNK * 4), _data(64 << 20)
    sender, engine = HostEngine(), _NoCopyDown()
    engine.copy_delay = 0.0
    engine.pool("in").configure(CHUNK, DEPTH)
    engine.pool("out").configure(CHUNK, DEPTH)
    try:
        async with connected_pair("tcp", checksum=True) as (a, b):
            out = [EngineArray(engine, np.zeros_like(dev)), np.zeros_like(host)]
            recv = asyncio.ensure_future(b.recv(tag="x", out=out))
            send = asyncio.ensure_future(a.send([EngineArray(sender, dev), host], tag="x"))
            await eventually(lambda: _held(b, "x") is not None, pause=0)
            m = _held(b, "x")
            await eventually(lambda: (m.landed or 0) > dev.nbytes + CHUNK or m.done.done(), pause=0)
            assert not m.done.done(), "the message landed whole before the cancel"
            recv.cancel()
            with pytest.raises(asyncio.CancelledError):
                await recv
            async with asyncio.timeout(20):
                await send
                with pytest.raises(TransferError, match="dropped"):
                    await b.recv(tag="x")
                await asyncio.gather(a.send(np.arange(7), tag="x"), b.recv(tag="x"))
            assert b.channel.state.name == "OPEN"
    finally:
        sender.close()
        engine.close()
