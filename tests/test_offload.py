"""Large host copies run in a copy thread, and the event loop goes on meanwhile.

Packing a strided tensor for a send or a write, and copying a message into a strided ``out=``
for a recv or a read, move every byte through the CPU (about a second for 256 MiB transposed).
These check that such copies leave the loop (a task awaiting one yields at least once, where
the old synchronous copy gave the loop no turn at all), that a cancelled caller returns only
once its copy has ended, and that the bytes are right whichever way they went.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import threading
from collections.abc import Awaitable
from typing import Any

import numpy as np
import pytest
from _polling import eventually

from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray, prepare, prepare_off_loop
from tensorwire.tensors._offload import OFF_LOOP_BYTES, copy_host, off_loop
from tensorwire.testing import busy_stream, connected_pair

_UCX = pytest.param(
    "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
)


async def _turns_while(work: Awaitable[Any]) -> tuple[Any, int]:
    """Await ``work`` in a task and count the loop turns another task got before it ended: 1
    when ``work`` never gave the loop up (it ran to its end in its first step)."""
    task = asyncio.ensure_future(work)
    turns = 0
    while not task.done():
        turns += 1
        await asyncio.sleep(0)
    return task.result(), turns


def _strided(nbytes: int) -> np.ndarray:
    """A transposed float64 array of ``nbytes`` bytes, with distinct values."""
    n = nbytes // 8
    rows = 256
    return np.arange(n, dtype=np.float64).reshape(rows, n // rows).T


async def test_off_loop_runs_in_a_copy_thread_and_gives_back_what_it_returns_or_raises() -> None:
    value, turns = await _turns_while(off_loop(lambda: threading.current_thread().name))
    assert value.startswith("tensorwire-copy")
    assert turns >= 2

    def fails() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await off_loop(fails)


async def test_a_cancelled_caller_returns_only_once_its_copy_has_ended() -> None:
    """Once the awaiting call raises, no thread touches the caller's tensors any more."""
    go, ended = threading.Event(), threading.Event()

    def copy() -> None:
        go.wait(10)
        ended.set()

    task = asyncio.ensure_future(off_loop(copy))
    await asyncio.sleep(0.05)
    task.cancel("the caller's reason")
    await asyncio.sleep(0.1)
    assert not task.done(), "the cancelled call returned while its copy still ran"
    task.cancel()  # a second cancellation changes nothing
    await asyncio.sleep(0.05)
    assert not task.done()
    go.set()
    with pytest.raises(asyncio.CancelledError, match="the caller's reason"):
        await task
    assert ended.is_set()


async def test_a_large_strided_message_is_packed_off_the_loop_into_the_same_bytes() -> None:
    big = _strided(16 << 20)
    small = _strided(OFF_LOOP_BYTES // 2)
    obj = {"big": big, "small": small, "flat": np.ones(3), "s": 1.5}
    msg, turns = await _turns_while(_awaited(prepare_off_loop(obj)))
    assert turns >= 2, "the 16 MiB packing copy ran on the event loop"
    want = prepare(obj)
    assert msg.header == want.header and msg.packed and msg.nbytes == want.nbytes
    assert [bytes(s) for s in msg.segments()] == [bytes(s) for s in want.segments()]
    # below OFF_LOOP_BYTES the copy is cheaper than the hop: it is made at once
    _, turns = await _turns_while(_awaited(prepare_off_loop({"small": small})))
    assert turns == 1


@pytest.mark.parametrize("bit", ["conj", "neg"])
async def test_a_large_torch_view_with_the_conj_or_neg_bit_is_resolved_off_the_loop(bit: str) -> None:
    """Such a view has no memory that holds its values: it is sent from a copy, as a strided
    tensor is from a packed one. That copy was made on the event loop at the call, whatever its
    size (a send of a 256 MiB conj view held the loop for 165-940 ms, a transposed one 25-40 ms)."""
    torch = pytest.importorskip("torch")
    base = torch.arange(2 << 20, dtype=torch.float32).to(torch.complex64) * (1 + 2j)  # 16 MiB
    x = base.conj() if bit == "conj" else base.conj().imag  # (the imaginary part of a conj view: neg bit)
    assert x.is_conj() or x.is_neg()
    obj = {"x": x, "flat": np.ones(3), "s": 1.5}

    async def prepared() -> Any:
        return await prepare_off_loop(obj)  # (called inside the task: the call's own work counts)

    msg, turns = await _turns_while(prepared())
    assert turns >= 2, f"the {x.nbytes >> 20} MiB copy resolving the {bit} bit ran on the event loop"
    want = prepare(obj)
    assert msg.header == want.header and msg.packed and msg.nbytes == want.nbytes
    assert [bytes(s) for s in msg.segments()] == [bytes(s) for s in want.segments()]
    assert bytes(msg.segments()[0]) == x.resolve_conj().resolve_neg().numpy().tobytes()
    async with connected_pair("inproc") as (a, b), asyncio.timeout(20):
        sent = await a.send(obj, tag=1)
        got = await b.recv(tag=1)
    assert sent.packed and not sent.direct
    assert torch.equal(got["x"], x) and not got["x"].is_conj() and not got["x"].is_neg()


async def test_copies_into_large_strided_buffers_run_off_the_loop() -> None:
    src = np.arange(4 << 20, dtype=np.float32).reshape(1024, -1)
    dst = np.zeros((src.shape[1], src.shape[0]), np.float32).T  # strided, src's shape
    tiny = np.zeros(4, np.float32)
    _, turns = await _turns_while(copy_host([(dst, src), (tiny, np.arange(4, dtype=np.float32))]))
    assert turns >= 2
    assert np.array_equal(dst, src) and np.array_equal(tiny, np.arange(4))


async def _arrived(peer: Any, tag: int) -> None:
    """Wait until a message on ``tag`` waits whole at ``peer``, unreceived."""
    await eventually(lambda: any(a.done.done() for a in peer.channel.mailbox._arrived.get(tag, ())), 10, 0.005)


async def _awaited(x: Awaitable[Any]) -> Any:
    return await x


@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_strided_tensors_past_the_threshold_travel_whole_every_way(transport: str) -> None:
    """send of a strided tensor, recv into out= of a message that arrived first, rpc arguments
    and results, one-sided write from a strided source and read into a strided out=: all past
    OFF_LOOP_BYTES."""
    src = _strided(8 << 20)
    async with connected_pair(transport) as (a, b):
        await a.send(src, tag=1)
        await _arrived(b, 1)
        out = np.zeros(src.shape)
        got = await b.recv(tag=1, out=out)
        assert got is out and np.array_equal(out, src)

        @b.node.method("flip")
        async def flip(x: np.ndarray) -> np.ndarray:
            return x.T  # strided: the result is packed for its reply

        assert np.array_equal(await a.call("flip", src), src.T)

        owned = np.zeros(src.shape)
        b.node.expose(owned, name="w")
        h = await a.lookup("w")
        await a.write(h, src)
        assert np.array_equal(owned, src)
        back = np.zeros((src.shape[1], src.shape[0])).T
        await a.read(h, out=back)
        assert np.array_equal(back, src)


@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_a_recv_cancelled_at_any_point_of_its_copy_loses_nothing(transport: str) -> None:
    """A recv into out= cancelled while the copy of a message that arrived first runs in a
    thread puts the message back: the next recv gets it whole, and no message is lost or taken
    twice."""
    src = _strided(8 << 20)
    out = np.zeros(src.shape)
    async with connected_pair(transport) as (a, b):
        for k in range(12):
            await a.send(src + k, tag=2)
            await _arrived(b, 2)
            task = asyncio.ensure_future(b.recv(tag=2, out=out))
            await asyncio.sleep(0.004 * k)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled():
                out[...] = 0
                await b.recv(tag=2, out=out)  # the message went back to the queue
            assert np.array_equal(out, src + k), f"message {k} damaged or lost"
        async with asyncio.timeout(1):
            await a.send(np.zeros(1), tag=3)
            assert (await b.recv(tag=3)).shape == (1,)  # and none is left over on tag 2
        assert not b.channel.mailbox._arrived.get(2)


@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_sends_on_a_tag_arrive_in_the_order_they_were_called_whichever_packing_ends_first(
    transport: str,
) -> None:
    """Messages match per tag in FIFO order, also when the large strided ones are packed in copy
    threads: a small send called after a packing one went first (it entered the channel while
    the other packed), and of several packing at once the first packed went first. A send
    cancelled while it packs sends nothing and lets those behind it go, still in order."""
    msgs = [
        _strided(8 << 20) + 1,
        np.full(3, 2.0),
        _strided(4 << 20) + 3,  # cancelled while it packs
        _strided(OFF_LOOP_BYTES // 2) + 4,  # packed at once, on the loop
        _strided(16 << 20) + 5,
        np.full(2, 6.0),
    ]
    async with connected_pair(transport) as (a, b):
        sends = [asyncio.ensure_future(a.send(m, tag=7)) for m in msgs]
        await asyncio.sleep(0)  # every send called, the large strided ones packing
        sends[2].cancel()
        went = [m for k, m in enumerate(msgs) if k != 2]
        try:
            async with asyncio.timeout(30):
                for k, m in enumerate(went):
                    got = await b.recv(tag=7)
                    assert got.shape == m.shape and np.array_equal(got, m), f"message {k} out of order"
        finally:
            await asyncio.gather(*sends, return_exceptions=True)
        assert sends[2].cancelled() and all(s.exception() is None for s in sends if s is not sends[2])
        assert not a._packing  # and nothing is kept for the tag once its sends have gone
        await a.send(np.zeros(1), tag=8)
        await b.recv(tag=8)
        assert not b.channel.mailbox._arrived.get(7)  # nothing more came on the tag


@pytest.mark.parametrize("op", ["send", "write"])
@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_device_sources_are_read_after_the_work_queued_before_the_call_not_after_the_packing(
    transport: str, op: str
) -> None:
    """A device source (host-engine memory on its producer's stream) goes with a large strided
    host source: its event is recorded at the call, so work the producer queues on that stream
    while the host source packs in a copy thread is not waited for. Over ucx a write_many sends
    the device source one-sided (into a host tensor) and the strided one through its owner (into
    a device tensor, which ucx does not register here); the one-sided source's event was
    recorded after the packing, behind the work queued meanwhile, and the write waited for it."""
    engine = HostEngine()
    try:
        async with connected_pair(transport) as (a, b):
            big = _strided(4 << 20)
            stream = engine.stream()
            src = EngineArray(engine, np.arange(1024, dtype=np.float32), stream=stream)
            into = np.zeros(1024, np.float32)
            dev = EngineArray(engine, np.zeros(big.shape))
            if op == "write":
                b.node.expose(into, name="h")
                b.node.expose(dev, name="d")
                hh, hd = await a.lookup("h"), await a.lookup("d")
                assert hh.direct == (transport == "ucx") and not hd.direct
                task = asyncio.ensure_future(a.write_many([hh, hd], [src, big]))
            else:
                task = asyncio.ensure_future(a.send({"d": src, "h": big}, tag=9))
                got = asyncio.ensure_future(b.recv(tag=9, out={"d": into, "h": dev.array}))
            await asyncio.sleep(0)  # the call
            with busy_stream(engine, stream):  # the producer's work queued after the call
                done, _ = await asyncio.wait([task], timeout=5)
            await task
            assert done, f"the {op} waited for work queued on its source's stream after the call"
            if op == "send":
                await got
            assert np.array_equal(into, src.array) and np.array_equal(dev.array, big)
    finally:
        engine.close()
