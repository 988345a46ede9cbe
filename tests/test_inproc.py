"""The in-process transport's own behaviour beyond the conformance suite: where a payload is
copied by the sender's task, what a failure does to a copy under way, and whose turn it is to
hand a message over while a send before it still stages device memory."""

import asyncio
import types

import numpy as np
import pytest

import tensorwire
from tensorwire.errors import PeerDisconnected
from tensorwire.memory import HostEngine
from tensorwire.metrics import snapshot
from tensorwire.tensors import EngineArray
from tensorwire.testing import busy_stream, connected_pair
from tensorwire.testing._conformance import _counted, _labels
from tensorwire.transports import inproc

MiB = 1 << 20


@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_fail_during_an_eager_copy_stops_it(side: str) -> None:
    """``Channel.fail`` (a lost lease or session) on either side while an eager payload is being
    copied into a posted recv's out= stops the copy: the failed side's operation fails with the
    failure, the other side's with PeerDisconnected, and out= is not written after."""
    async with connected_pair("inproc") as (a, b):
        src = np.full(32 * MiB, 7, np.uint8)  # eager (64 MiB of credit), copied in 4 MiB chunks
        out = np.zeros_like(src)
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        await asyncio.sleep(0.01)  # posted: the copy goes straight into out=
        send = asyncio.ensure_future(a.send(src, tag="t"))
        for _ in range(100):
            if out[0]:
                break  # the copy is under way
            await asyncio.sleep(0)
        assert out[0] and not send.done(), "the copy was not caught under way"
        why = PeerDisconnected("lease ran out")
        (a if side == "sender" else b).channel.fail(why)
        async with asyncio.timeout(1):
            (received,) = await asyncio.gather(recv, return_exceptions=True)
            landed = out.copy()
            (sent,) = await asyncio.gather(send, return_exceptions=True)
        for _ in range(20):
            await asyncio.sleep(0)
        assert np.array_equal(out, landed), "out= was written after its recv had failed"
        assert not np.array_equal(landed, src), "the copy was not stopped part way"
        mine, other = (sent, received) if side == "sender" else (received, sent)
        assert type(mine) is type(why) and str(mine) == str(why), f"the failed side's operation gave {mine!r}"
        assert isinstance(other, PeerDisconnected), f"the other side's operation gave {other!r}"


async def test_a_send_goes_after_a_device_send_started_before_it() -> None:
    """A send started while an earlier one on the tag still stages device memory through host
    memory (its producer stream is busy) waits for that one to hand its message over: the
    turn is taken when send is entered, not once the bytes are ready."""
    async with connected_pair("inproc") as (a, b):
        engine = HostEngine()
        try:
            with busy_stream(engine) as (stream, gate):
                dev = EngineArray(engine, np.full(1000, 1, np.uint8), stream=stream)
                first = asyncio.ensure_future(a.send({"i": 0, "x": dev}, tag="d"))
                await asyncio.sleep(0)
                second = asyncio.ensure_future(a.send({"i": 1, "x": np.full(10, 2, np.uint8)}, tag="d"))
                await asyncio.sleep(0.02)
                assert not first.done(), "a device send went before its producer stream's work"
                assert not second.done(), "a send went ahead of one started before it"
                gate.set()
            got = [(await asyncio.wait_for(b.recv(tag="d"), 5))["i"] for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(first, second), 5)
            assert got == [0, 1]
        finally:
            engine.close()


async def test_a_send_waiting_for_its_turn_fails_when_the_channel_closes() -> None:
    """A send waiting behind one that stages device memory (its stream busy) fails as soon as
    the peer closes, rather than when the staging ends."""
    async with connected_pair("inproc") as (a, b):
        engine = HostEngine()
        try:
            with busy_stream(engine) as (stream, gate):
                dev = EngineArray(engine, np.full(1000, 1, np.uint8), stream=stream)
                first = asyncio.ensure_future(a.send(dev, tag="d"))
                await asyncio.sleep(0)
                second = asyncio.ensure_future(a.send(np.full(10, 2, np.uint8), tag="d"))
                await asyncio.sleep(0.02)
                await b.aclose()
                with pytest.raises(PeerDisconnected):
                    await asyncio.wait_for(second, 1)
                gate.set()
            with pytest.raises(PeerDisconnected):
                await asyncio.wait_for(first, 5)
        finally:
            engine.close()


@pytest.mark.parametrize("closer", ["sender", "receiver"])
async def test_a_close_at_any_turn_of_a_rendezvous_send_ends_both_sides(closer: str) -> None:
    """Either side closing at any loop turn of a rendezvous send into a posted recv(out=) ends
    the send and the recv at once, both delivered or both failed (the closing side's as closed),
    and out= is not written after its recv failed. A close after the recv had taken the
    message but before its copy had begun left the send waiting for good."""
    src = np.full(8 * MiB, 7, np.uint8)  # rendezvous (no credit), copied in two chunks
    for spins in range(12):
        async with connected_pair("inproc", limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
            out = np.zeros_like(src)
            recv = asyncio.ensure_future(b.recv(tag="r", out=out))
            await asyncio.sleep(0)  # posted
            send = asyncio.ensure_future(a.send(src, tag="r"))
            for _ in range(spins):
                await asyncio.sleep(0)
            await (a if closer == "sender" else b).aclose()
            async with asyncio.timeout(1):
                (received,) = await asyncio.gather(recv, return_exceptions=True)
                landed = out.copy()
                (sent,) = await asyncio.gather(send, return_exceptions=True)
            for _ in range(10):
                await asyncio.sleep(0)
            if isinstance(received, np.ndarray):
                assert isinstance(sent, tensorwire.Receipt) and np.array_equal(out, src), spins
                continue
            ours, theirs = (sent, received) if closer == "sender" else (received, sent)
            assert isinstance(ours, tensorwire.ClosedResourceError), (spins, ours)
            assert isinstance(theirs, PeerDisconnected), (spins, theirs)
            assert np.array_equal(out, landed), f"out= written after its recv failed ({spins} turns)"


@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
async def test_a_copy_into_slow_memory_lets_the_loop_run_part_way(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy gives the loop a turn after ``_YIELD_SECONDS`` as well as after 4 MiB: a recv into
    memory never touched pays a page fault per 4 KiB, and in a VM 4 MiB of those took 90-150
    ms, so a 1 GiB recv() without out= held its loop that long at every 4 MiB chunk (its lease
    renewals, calls and reads waited). Here inproc's clock moves 10 ms at each reading, as if
    every piece landed in such memory: the loop must run while one 4 MiB message is part
    copied, by the sender's task (eager) or the receiver's pull (rendezvous)."""
    clock = iter(range(1 << 30))
    monkeypatch.setattr(inproc, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) * 0.01))
    limits = tensorwire.Limits(recv_buffer_bytes=0 if protocol == "rendezvous" else 64 * MiB)
    async with connected_pair("inproc", limits=limits) as (a, b):
        src = np.full(4 * MiB, 7, np.uint8)
        out = np.zeros_like(src)
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="t", out=out))
        await asyncio.sleep(0)  # posted
        send = asyncio.ensure_future(a.send(src, tag="t"))
        part_copied = 0
        async with asyncio.timeout(10):
            while not recv.done():
                part_copied += bool(out[0]) and not out[-1]
                await asyncio.sleep(0)
            _, receipt = await recv
            await send
        assert receipt.protocol == protocol
        assert np.array_equal(out, src)
        # before: 0 (the message was copied in one piece, the loop held throughout)
        assert part_copied >= 4, part_copied


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
@pytest.mark.parametrize("layout", ["swapped", "shifted"])
async def test_an_out_that_is_the_memory_being_sent_gets_the_values_sent(protocol: str, layout: str) -> None:
    """In one process a recv's out= may be the very memory a send reads: the payload is copied
    tensor by tensor and in 512 KiB pieces, so bytes were read after earlier ones had landed
    over them (swapped: out=[y, x] of [x, y] gave x's values to both, 10 elements or 100,000;
    shifted by one element, 2,000,000 float64: 30 wrong, one per piece boundary)."""
    n = 400_000  # 3.2 MB a tensor: several pieces
    limits = tensorwire.Limits(recv_buffer_bytes=64 * MiB if protocol == "eager" else MiB)
    async with connected_pair("inproc", limits=limits) as (a, b), asyncio.timeout(30):
        x, y = np.arange(n, dtype=np.float64), -np.arange(n, dtype=np.float64)
        if layout == "swapped":
            src, out = [x, y], [y, x]
            want = [x.copy(), y.copy()]
        else:
            buf = np.arange(n + 1, dtype=np.float64)
            src, out = [buf[:-1]], [buf[1:]]
            want = [buf[:-1].copy()]
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="t", out=out))
        await asyncio.sleep(0.01)  # posted: the payload is copied straight into out=
        sent = await a.send(src, tag="t")
        got, receipt = await recv
        assert got is out and sent.protocol == receipt.protocol == protocol
        for landed, expected in zip(out, want, strict=True):
            np.testing.assert_array_equal(landed, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
@pytest.mark.parametrize("layout", ["swapped", "shifted"])
async def test_receipts_of_a_payload_copied_aside_from_its_out_do_not_say_direct(protocol: str, layout: str) -> None:
    """The payload of a send whose recv's out= is the memory being sent is copied aside first
    (above), and lands from that copy of tensorwire's: neither end's receipt, nor the metrics,
    may say ``direct`` (no copy of tensorwire's between the tensor and the wire). Both said
    direct, as for a payload copied straight from the sent tensor into out=."""
    n = 400_000
    limits = tensorwire.Limits(recv_buffer_bytes=64 * MiB if protocol == "eager" else MiB)
    async with connected_pair("inproc", limits=limits) as (a, b), asyncio.timeout(30):
        x, y = np.arange(n, dtype=np.float64), -np.arange(n, dtype=np.float64)
        if layout == "swapped":
            src, out = [x, y], [y, x]
        else:
            buf = np.arange(n + 1, dtype=np.float64)
            src, out = [buf[:-1]], [buf[1:]]
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="t", out=out))
        await asyncio.sleep(0.01)  # posted: the payload is copied straight into out=
        before = snapshot()
        sent = await a.send(src, tag="t")
        _, received = await recv
        after = snapshot()
    assert sent.protocol == received.protocol == protocol
    assert not sent.direct and not received.direct, (sent, received)
    for op, r in (("send", sent), ("recv", received)):
        assert _counted(before, after, op) == {_labels(r, "messages"): (1, r.nbytes)}, op
    # a send to an out= of other memory stays direct at both ends
    async with connected_pair("inproc", limits=limits) as (a, b), asyncio.timeout(30):
        recv = asyncio.ensure_future(b.recv_with_receipt(tag="t", out=[np.empty(n), np.empty(n)]))
        await asyncio.sleep(0.01)
        sent = await a.send([np.ones(n), np.ones(n)], tag="t")
        _, received = await recv
    assert sent.direct and received.direct, (sent, received)


async def test_nodes_on_two_event_loops_of_one_process_are_not_joined_in_process() -> None:
    """Two nodes of one process whose event loops differ (one in a thread of its own) cannot
    share inproc channels, whose futures and mailboxes belong to one loop: they connect over the
    next transport they share, and the path says why not inproc. Before, they were joined in
    process: each side set the other loop's futures from its own thread (in asyncio's debug mode
    connect raised RuntimeError "Non-thread-safe operation"; without it, wake-ups were lost: a
    100 MiB message took about 1 s instead of tens of ms)."""
    import threading

    ready, stop = threading.Event(), threading.Event()
    address: list[str] = []
    failure: list[BaseException] = []

    async def serve() -> None:
        async with tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as node:
            address.append(node.address)
            ready.set()
            peer = await node.accept()
            got = await asyncio.wait_for(peer.recv(tag="x"), 10)
            await peer.send(got, tag="back")
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    def run() -> None:
        try:
            asyncio.run(serve(), debug=True)  # (debug: a call from another thread raises)
        except BaseException as exc:
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10) and address, failure
        async with tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as node:
            peer = await node.connect(address[0])
            assert peer.path.transport == "tcp", peer.path
            assert "another event loop" in str(peer.path), peer.path
            x = np.arange(MiB, dtype=np.uint8)
            await peer.send(x, tag="x")
            np.testing.assert_array_equal(await asyncio.wait_for(peer.recv(tag="back"), 10), x)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
    assert not failure, failure
