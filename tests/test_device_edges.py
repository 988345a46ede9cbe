"""Device tensors at the edges, without a GPU (the host engine stands in for one): a channel that
closes while a producer's or consumer's stream is busy, and a device with no memory left for a
received tensor. Real nodes on loopback over tcp, inproc and ucx (its staged path, and its path
by pointer, which the host engine's memory takes as ucx takes CUDA memory)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _device_paths import CHUNK, DEPTH, PATHS, UCX, small_rings
from _polling import collected, eventually

from tensorwire.errors import ClosedResourceError, PeerDisconnected, TransferError
from tensorwire.memory import HostEngine, wait_event
from tensorwire.memory._engine import DeviceBuffer
from tensorwire.tensors import EngineArray
from tensorwire.testing import busy_stream, connected_pair, host_engine_by_pointer
from tensorwire.transports import Limits

pytestmark = pytest.mark.timeout(60)

_PATHS, _UCX = PATHS, UCX


@pytest.fixture
def engine() -> Iterator[HostEngine]:
    yield from small_rings(HostEngine())


def _data(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8)


def _waiting(transport: str, limits: Limits) -> Limits:
    """``limits`` for a recv into device memory that is to wait for its busy consumer stream past
    the staging ring: over tcp with no room for overflow memory (``recv_buffer_bytes=0``, every
    message rendezvous), which otherwise takes the rest of such a message, the recv returning with
    its copies queued behind the stream (tests/test_tcp_device.py)."""
    return Limits(recv_buffer_bytes=0) if transport == "tcp" else limits


def _holds(peer: Any, tag: str) -> bool:
    """Whether ``peer``'s mailbox has a message on ``tag`` (its header at least)."""
    from tensorwire._peer import tag_id

    mailbox, tid = peer.channel.mailbox, tag_id(tag)
    return bool(mailbox._arrived.get(tid)) or any(m.tag == tid for m in mailbox._held)


# -- a send waiting for its producer stream -------------------------------------------------------
@pytest.mark.parametrize(("transport", "by_pointer"), _PATHS)
@pytest.mark.parametrize("closer", ["peer", "peer-node", "own", "own-node"])
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
async def test_a_send_waiting_for_its_producer_stream_ends_with_its_channel(
    engine: HostEngine, transport: str, by_pointer: bool, closer: str, protocol: str
) -> None:
    """A send of device memory whose producer stream stays busy, when the peer, the peer's node,
    the sender's own peer or its node closes: the send raises what a send started after the
    close raises (PeerDisconnected for the peer's close, ClosedResourceError for our own),
    while the stream is still busy, and nothing of the message reaches the receiver once the
    stream frees. Before, the send waited for the stream (for good, were it stuck): the close
    returned, the send did not."""
    data = _data(CHUNK * DEPTH + 5)  # eager: within the receiver's credit
    limits = Limits(recv_buffer_bytes=1 << 20 if protocol == "eager" else 0)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair(transport, limits=limits) as (a, b):
            if by_pointer:
                host_engine_by_pointer(a, b)
            posted = None
            if protocol == "rendezvous":  # posted: the go-ahead comes at once, then the stream is waited for
                posted = asyncio.ensure_future(b.recv(tag="x", out=np.zeros_like(data)))
            send = asyncio.ensure_future(a.send(EngineArray(engine, data, stream=stream), tag="x"))
            # at the wait: its copies queued behind the stream, or (by pointer) its header out
            await eventually(lambda: engine.max_queued >= 1 or _holds(b, "x"))
            await asyncio.sleep(0.05)
            assert not send.done(), "a send moved device memory before its producer stream's work"
            await {"peer": b.aclose, "peer-node": b.node.aclose, "own": a.aclose, "own-node": a.node.aclose}[closer]()
            want = PeerDisconnected if closer.startswith("peer") else ClosedResourceError
            with pytest.raises(want):
                async with asyncio.timeout(10):  # the stream stays busy all the while
                    await send
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            # not delivered, then or later: the receiver has no whole message on the tag
            with pytest.raises((PeerDisconnected, ClosedResourceError)):
                async with asyncio.timeout(10):
                    await b.recv(tag="x")
            if posted is not None:
                with pytest.raises((PeerDisconnected, ClosedResourceError)):
                    await posted


@pytest.mark.parametrize(("transport", "by_pointer"), _PATHS)
async def test_sends_cut_short_by_their_channel_let_go_of_their_tensors(
    engine: HostEngine, transport: str, by_pointer: bool
) -> None:
    """Sends of device memory whose producer stream stays busy, cut short by the peer's abort, let
    go of their tensors once their callers do (and the stream has run what was queued from them).
    Before, each wait raised the one exception its channel's ``ended`` holds: its traceback grew
    by every raiser's frames, and the channel kept the tensors alive for as long as it lived."""
    limits = Limits(recv_buffer_bytes=1 << 20)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair(transport, limits=limits) as (a, b):
            if by_pointer:
                host_engine_by_pointer(a, b)
            datas = [_data(CHUNK + 5), _data(CHUNK + 7)]
            gone = [weakref.ref(d) for d in datas]
            sends = [
                asyncio.ensure_future(a.send(EngineArray(engine, d, stream=stream), tag=f"x{i}"))
                for i, d in enumerate(datas)
            ]
            await eventually(lambda: engine.max_queued >= 1 or _holds(b, "x0"))
            await asyncio.sleep(0.05)
            assert not any(s.done() for s in sends), "a send moved device memory before its producer stream's work"
            b.abort()
            for s in sends:
                with pytest.raises(PeerDisconnected):
                    async with asyncio.timeout(10):  # the stream stays busy all the while
                        await s
            del datas, sends, s
            gate.set()
            await wait_event(engine, engine.record_on(stream))

            await collected(*gone)
            assert a.channel.ended.done()  # (the channel, and its failure, still live)


_STAGED = [p for p in _PATHS if not p.values[1]]  # the paths whose sends take staging chunks


@pytest.mark.parametrize(("transport", "by_pointer"), _STAGED)
async def test_a_send_cut_short_by_its_channel_leaves_no_chunk_to_the_busy_stream(
    engine: HostEngine, transport: str, by_pointer: bool
) -> None:
    """A send ended by its channel's close while its producer stream stays busy leaves copies
    queued behind that stream, into staging chunks of the process-wide pool: a send of ready
    device memory on another channel, whose peer is up, goes on all the same. Before, those
    chunks went back to the pool as any other, and the other send waited for the busy stream
    (for good, were it stuck), even after its own channel closed."""
    limits = Limits(recv_buffer_bytes=1 << 20)
    with busy_stream(engine) as (stream, gate):
        async with (
            connected_pair(transport, limits=limits) as (a, b),
            connected_pair(transport, limits=limits) as (c, d),
        ):
            send = asyncio.ensure_future(a.send(EngineArray(engine, _data(CHUNK * DEPTH + 5), stream=stream), tag="x"))
            await eventually(lambda: engine.max_queued >= DEPTH)  # the whole ring behind the stream
            await b.aclose()
            with pytest.raises(PeerDisconnected):
                async with asyncio.timeout(10):
                    await send
            small = _data(1000)
            async with asyncio.timeout(10):  # the stream stays busy all the while
                _, got = await asyncio.gather(c.send(EngineArray(engine, small), tag="y"), d.recv(tag="y"))
            assert np.array_equal(got, small)
            assert not gate.query()
        gate.set()
        await wait_event(engine, engine.record_on(stream))
        assert engine.pool("out").free == DEPTH


@pytest.mark.parametrize(("transport", "by_pointer"), _STAGED)
async def test_a_send_waiting_for_a_staging_chunk_ends_with_its_channel(
    engine: HostEngine, transport: str, by_pointer: bool
) -> None:
    """A send that waits for a staging chunk, all of them held by another channel's send whose
    producer stream stays busy, ends when its own channel closes, as a send waiting for its own
    producer stream does. Before, it waited for the other send's stream."""
    limits = Limits(recv_buffer_bytes=1 << 20)
    with busy_stream(engine) as (stream, gate):
        async with (
            connected_pair(transport, limits=limits) as (a, b),
            connected_pair(transport, limits=limits) as (c, d),
        ):
            held = asyncio.ensure_future(a.send(EngineArray(engine, _data(CHUNK * DEPTH + 5), stream=stream), tag="x"))
            await eventually(lambda: engine.max_queued >= DEPTH)
            send = asyncio.ensure_future(c.send(EngineArray(engine, _data(1000)), tag="y"))
            await asyncio.sleep(0.05)
            assert not send.done(), "a send found a staging chunk while another send held them all"
            await d.aclose()
            with pytest.raises(PeerDisconnected):
                async with asyncio.timeout(10):  # the stream stays busy all the while
                    await send
            assert not held.done() and not gate.query()
            gate.set()
            async with asyncio.timeout(10):
                await asyncio.gather(held, b.recv(tag="x"))


@pytest.mark.parametrize(("transport", "by_pointer"), _STAGED)
@pytest.mark.parametrize("op", ["recv", "read"])
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
async def test_a_recv_on_a_busy_stream_leaves_staging_chunks_to_other_channels(
    engine: HostEngine, transport: str, by_pointer: bool, op: str, closed: bool
) -> None:
    """A recv (or a one-sided read: staged over ucx, a recv of the owner's answer elsewhere) into
    device memory whose consumer stream stays busy queues its copies up behind that stream, from
    staging chunks of the process-wide pool: a recv into ready device memory on another channel
    goes on all the same, while the first recv waits for its stream and once its channel has
    closed (``closed``). Before, those chunks went back to the pool with their copies still
    queued, and the other recv waited for the busy stream (for good, were it stuck). The first
    recv gets its message whole once the stream frees, unless the close ended it: over tcp
    (still landing it), and a read on every path (a read ends with its channel, even one whose
    answer inproc had whole in host memory of its own); inproc's and ucx's recv had it whole in
    host memory of theirs."""
    data = _data(CHUNK * DEPTH * 2 + 5)  # twice the staging ring
    limits = _waiting(transport, Limits(recv_buffer_bytes=1 << 20))
    with busy_stream(engine) as (stream, gate):
        async with (
            connected_pair(transport, limits=limits) as (a, b),
            connected_pair(transport, limits=limits) as (c, d),
        ):
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            if op == "read":
                a.node.expose(data, name="t")
                first = asyncio.ensure_future(b.read(await b.lookup("t"), out=out))
            else:
                first = asyncio.ensure_future(b.recv(tag="x", out=out))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                await a.send(data, tag="x")
            await eventually(lambda: engine.max_queued >= 1)  # its copies up queued behind the stream
            await asyncio.sleep(0.05)  # (and as many more as it queues)
            assert not first.done(), f"the {op} did not wait for its consumer stream"
            ended = closed and (transport == "tcp" or op == "read")
            if closed:
                await b.aclose()
            if ended:
                with pytest.raises(ClosedResourceError):
                    async with asyncio.timeout(10):
                        await first
            small = _data(CHUNK + 5)
            got = EngineArray(engine, np.zeros_like(small))
            async with asyncio.timeout(10):  # the stream stays busy all the while
                _, back = await asyncio.gather(c.send(small, tag="y"), d.recv(tag="y", out=got))
            assert back is got and np.array_equal(got.array, small)
            assert not gate.query()
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            if not ended:
                async with asyncio.timeout(10):
                    assert await first is out
                await wait_event(engine, engine.record_on(stream))
                assert np.array_equal(out.array, data)
        assert engine.pool("in").free == DEPTH


# -- a one-sided read or write waiting for its stream ------------------------------------------
_ONE_SIDED_CASES = [
    # owner-assisted over tcp and inproc, and over ucx for device memory its owner serves
    # ("served-read": ucx registers no host-engine memory, as it registers no CUDA memory
    # without cuda lanes): a write goes as a send does; a read receives the owner's answer
    *(pytest.param(t, False, op, id=f"{t}-{op}") for t in ("tcp", "inproc") for op in ("read", "write")),
    *(
        pytest.param("ucx", by_pointer, op, id=f"ucx-{'pointer' if by_pointer else 'staged'}-{op}", marks=_UCX)
        for by_pointer in (False, True)
        for op in ("read", "write", "served-read")
    ),
]


@pytest.mark.parametrize(("transport", "by_pointer", "op"), _ONE_SIDED_CASES)
@pytest.mark.parametrize("closer", ["peer", "peer-node", "own", "own-node"])
async def test_a_one_sided_operation_waiting_for_its_stream_ends_with_its_channel(
    engine: HostEngine, transport: str, by_pointer: bool, op: str, closer: str
) -> None:
    """A write from device memory whose producer stream stays busy, or a one-sided read into
    device memory whose consumer stream does, when the owner, its node, the requester's own
    peer or its node closes: the operation raises what one started after the close raises,
    while the stream is still busy, and a write's bytes never reach the owner's tensor. Over
    ucx it used to wait for the stream (for good, were it stuck): by pointer before posting,
    staged before its copies down (a write) or before reusing a chunk whose copies up wait for
    the consumer's stream (a read of more than the staging ring). An owner-assisted read (its
    answer more than the staging ring) waited for the stream over inproc and ucx whoever
    closed, and then returned the answer whole; over tcp, our own close ended it. Over tcp with
    no room for overflow memory the owner's close was seen at the lease (3 s): the reader,
    landing the answer, waits for the stream before it can read the close behind it (it
    watches the socket's hang-up meanwhile now: tests/test_tcp_device.py)."""
    n = CHUNK * DEPTH * 2 + 5
    served = op == "served-read"
    with busy_stream(engine) as (stream, gate):
        async with connected_pair(transport, limits=_waiting(transport, Limits())) as (a, b):
            if by_pointer:
                host_engine_by_pointer(b)
            target = np.zeros(n, np.uint8)
            a.node.expose(EngineArray(engine, target) if served else target, name="t")
            h = await b.lookup("t")
            assert h.direct == (transport == "ucx" and not served), h
            dev = EngineArray(engine, _data(n), stream=stream)
            task = asyncio.ensure_future(b.write(h, dev) if op == "write" else b.read(h, out=dev))
            await asyncio.sleep(0.05)
            assert not task.done(), f"a {op} did not wait for its stream's earlier work"
            await {"peer": a.aclose, "peer-node": a.node.aclose, "own": b.aclose, "own-node": b.node.aclose}[closer]()
            want = PeerDisconnected if closer.startswith("peer") else ClosedResourceError
            with pytest.raises(want):
                async with asyncio.timeout(10):  # the stream stays busy all the while
                    await task
            gate.set()
            await wait_event(engine, engine.record_on(stream))
            await asyncio.sleep(0.05)
            if op == "write":
                assert not target.any(), "a write's bytes reached the owner after its channel closed"


# -- a recv into a tensor of a busy consumer stream ---------------------------------------------
@pytest.mark.parametrize(("transport", "by_pointer"), _PATHS)
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
async def test_a_message_whole_before_its_peer_closed_reaches_a_recv_on_a_busy_stream(
    engine: HostEngine, transport: str, by_pointer: bool, order: str
) -> None:
    """A recv into a tensor whose consumer stream is busy, its peer closing meanwhile: a message
    that arrived whole (its send returned) is the receiver's, and the recv returns it once the
    stream frees, on every transport (README: messages that had fully arrived are still
    delivered). Over ucx by pointer a recv posts its receive only once its stream is free
    (UCX writes outside every stream), so a message sent after the recv is not received
    before the close: its send and the recv both fail, and neither side thinks it went."""
    data = _data(CHUNK * DEPTH + 5)  # more than the staging ring: the landing waits for the stream
    limits = Limits(recv_buffer_bytes=1 << 20)  # (sent first, the message waits for its recv here)
    if order == "recv-first":
        limits = _waiting(transport, limits)
    with busy_stream(engine) as (stream, gate):
        async with connected_pair(transport, limits=limits) as (a, b):
            if by_pointer:
                host_engine_by_pointer(a, b)
            out = EngineArray(engine, np.zeros_like(data), stream=stream)
            recv = None
            if order == "recv-first":
                recv = asyncio.ensure_future(b.recv(tag="x", out=out))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
            send = asyncio.ensure_future(a.send(EngineArray(engine, data), tag="x"))
            delivered = not (by_pointer and order == "recv-first")
            if delivered:
                async with asyncio.timeout(10):
                    await send
            else:
                await eventually(lambda: _holds(b, "x"))
                await asyncio.sleep(0.05)
                assert not send.done()
            if recv is None:
                await eventually(lambda: _holds(b, "x"))
                recv = asyncio.ensure_future(b.recv(tag="x", out=out))
            await asyncio.sleep(0.05)
            assert not recv.done(), "the recv did not wait for its consumer stream"
            await a.aclose()
            await asyncio.sleep(0.05)
            gate.set()
            async with asyncio.timeout(10):
                if delivered:
                    assert await recv is out
                    await wait_event(engine, engine.record_on(stream))
                    assert np.array_equal(out.array, data)
                else:
                    with pytest.raises(PeerDisconnected):
                        await recv
                    with pytest.raises(ClosedResourceError):
                        await send


def _tid(tag: str) -> int:
    from tensorwire._peer import tag_id

    return tag_id(tag)


# -- no device memory for a received tensor -----------------------------------------------------
class _CupyOutOfMemory(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError`` (a MemoryError), raised by its memory pool."""


_CupyOutOfMemory.__name__ = _CupyOutOfMemory.__qualname__ = "OutOfMemoryError"
_CupyOutOfMemory.__module__ = "cupy.cuda.memory"


class _CudaRuntimeError(RuntimeError):
    """CuPy's ``CUDARuntimeError``: a CUDA call's status, 2 being cudaErrorMemoryAllocation."""

    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


_CudaRuntimeError.__name__ = _CudaRuntimeError.__qualname__ = "CUDARuntimeError"
_CudaRuntimeError.__module__ = "cupy_backends.cuda.api.runtime"


def _torch_oom() -> BaseException:
    torch = pytest.importorskip("torch")
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


_ERRORS: dict[str, Callable[[], BaseException]] = {
    "cupy": lambda: _CupyOutOfMemory("Out of memory allocating 4,000 bytes (allocated so far: 0 bytes)."),
    "torch": _torch_oom,
    "cuda-runtime": lambda: _CudaRuntimeError(2),
}


def test_out_of_memory_errors_of_cupy_and_torch_are_told_apart_by_name() -> None:
    """What ``out_of_memory`` takes for no memory, without importing either framework: CuPy's
    OutOfMemoryError (a MemoryError), torch's (a RuntimeError, module torch; torch.cuda before
    2.5), CUDA's cudaErrorMemoryAllocation; not another CUDA error, nor a message that merely
    mentions memory."""
    from tensorwire.memory._engine import out_of_memory

    assert all(out_of_memory(make()) for make in (MemoryError, _ERRORS["cupy"], _ERRORS["cuda-runtime"]))
    old_torch = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch.cuda"})
    assert out_of_memory(old_torch("CUDA out of memory"))
    assert not out_of_memory(_CudaRuntimeError(700))  # cudaErrorIllegalAddress
    assert not out_of_memory(RuntimeError("CUDA out of memory"))
    assert not out_of_memory(type("OutOfMemoryError", (RuntimeError,), {"__module__": "mylib"})())
    if importlib.util.find_spec("torch") is not None:
        assert out_of_memory(_torch_oom())


class _Starved(HostEngine):
    """A host engine standing in for a CUDA device with no memory left: every allocation fails
    with the error its framework raises (``error``)."""

    def __init__(self, error: Callable[[], BaseException]) -> None:
        super().__init__()
        self.error = error
        self.refused = 0

    def empty(self, nbytes: int, stream: int | None = None) -> DeviceBuffer:
        self.refused += 1
        raise self.error()


@contextlib.contextmanager
def _a_starved_gpu(monkeypatch: pytest.MonkeyPatch, error: Callable[[], BaseException]) -> Iterator[_Starved]:
    """One CUDA device here, ``cuda:0``, whose memory comes from a starved host engine through a
    stand-in for CuPy (its ``empty``; CuPy itself cannot run without a GPU)."""
    from tensorwire.tensors import _device

    engine = _Starved(error)

    def empty(shape: tuple[int, ...], dtype: Any) -> Any:
        return engine.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize).owner

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda n: contextlib.nullcontext()), empty=empty)
    monkeypatch.setattr(_device, "_device_count", lambda: 1)
    monkeypatch.setattr(_device, "_current_device", lambda: 0)
    monkeypatch.setattr(_device, "_cp", lambda: cp)
    monkeypatch.setattr(_device, "_engine", lambda device: engine)
    monkeypatch.setattr(_device, "_stream", lambda framework, device: None)
    try:
        yield engine
    finally:
        engine.close()


_NO_MEMORY_CASES = [
    *(pytest.param("tcp", when, "cupy", id=f"tcp-{when}") for when in ("posted", "queued", "rendezvous")),
    pytest.param("tcp", "posted", "torch", id="tcp-posted-torch"),
    pytest.param("tcp", "queued", "cuda-runtime", id="tcp-queued-cuda-runtime"),
    pytest.param("inproc", "posted", "torch", id="inproc-posted-torch"),
    pytest.param("inproc", "rendezvous", "cupy", id="inproc-rendezvous"),
    pytest.param("ucx", "queued", "torch", id="ucx-queued-torch", marks=_UCX),
    pytest.param("ucx", "rendezvous", "cupy", id="ucx-rendezvous", marks=_UCX),
]


@pytest.mark.parametrize(("transport", "when", "error"), _NO_MEMORY_CASES)
async def test_no_device_memory_for_a_received_tensor_keeps_the_message(
    monkeypatch: pytest.MonkeyPatch, transport: str, when: str, error: str
) -> None:
    """A recv with device="cuda:0" whose tensor the device has no memory for (CuPy's or torch's
    out-of-memory error, or CUDA's cudaErrorMemoryAllocation), posted before the message came
    ("posted": tcp places device tensors as the header arrives), after ("queued"), or for a
    rendezvous message: the recv raises TransferError "out of memory", the message stays for
    a recv with out=, and the channel goes on. Before, the framework's error came out raw: from
    tcp's reader, which broke the channel (BrokenResourceError); or as "could not be rebuilt",
    with the message taken and lost (the recv(out=) after it waited for good)."""
    data = _data(4000)
    credit = 0 if when == "rendezvous" else 1 << 20
    with _a_starved_gpu(monkeypatch, _ERRORS[error]) as engine:
        async with connected_pair(transport, limits=Limits(recv_buffer_bytes=credit)) as (a, b):
            if when == "posted":
                recv = asyncio.ensure_future(b.recv(tag="x", device="cuda:0"))
                await eventually(lambda: b.channel.mailbox.has_posted(_tid("x")))
                send = asyncio.ensure_future(a.send(data, tag="x"))
            else:
                send = asyncio.ensure_future(a.send(data, tag="x"))
                await eventually(lambda: _holds(b, "x"))
                recv = asyncio.ensure_future(b.recv(tag="x", device="cuda:0"))
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match="out of memory on host-engine:0"):
                    await recv
                assert engine.refused
                out = np.zeros_like(data)
                assert await b.recv(tag="x", out=out) is out
                assert np.array_equal(out, data)
                await send
                await asyncio.gather(a.send(np.arange(7), tag="y"), b.recv(tag="y"))
