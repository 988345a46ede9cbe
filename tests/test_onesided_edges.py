"""One-sided reads and writes at awkward moments: cancellations, late answers, revocations."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import tracemalloc
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire import _onesided
from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState
from tensorwire.transports._credit import OWN_TAGS, own_slots


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("op", ["read", "write"])
async def test_an_answer_that_comes_after_the_drain_gave_up_is_still_taken(
    transport: str, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner-assisted read or write cancelled while the owner's answer waits for one of the
    requester's message slots (the requester has left messages unread, tensorwire's own among
    them: the user's alone leave slots for the answer) is answered once a slot frees, however
    late. The requester's drain gave up after _DRAIN_SECONDS and left that answer unread for
    good: a read's (rendezvous) waited for a go-ahead that never came, and the owner's
    ``unexpose`` waited for it; a write's held a message slot for good."""
    monkeypatch.setattr(_onesided, "_DRAIN_SECONDS", 0.2)
    slots = 4
    limits = tensorwire.Limits(max_unexpected=slots, recv_buffer_bytes=4096)
    async with connected_pair(transport, limits=limits) as (a, b):
        n = 1 << 16  # past the credit: a read's answer waits for the reader's go-ahead
        dst = np.zeros(n, np.uint8)
        a.node.expose(dst, name="x")
        h = await b.lookup("x")
        for _ in range(slots):  # every slot of b's taken by a message b leaves unread for now
            await a.send(np.zeros(1, np.uint8), tag=5)
        for _ in range(own_slots(slots)):  # those kept for tensorwire's messages too (a tag none reads)
            await a._send_own(np.zeros(1, np.uint8), tag=OWN_TAGS[0])
        task = asyncio.ensure_future(b.read(h) if op == "read" else b.write(h, np.ones(n, np.uint8)))
        async with asyncio.timeout(10):
            while a.node.exposures.served < 1 or (op == "write" and not dst.all()):  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the owner's answer now waits for a slot of b's
        assert not task.done(), "the operation ended without its answer (the test's premise)"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # past the drain
        for _ in range(own_slots(slots)):  # the slots free: the owner's answer goes out
            await b._recv_own(tag=OWN_TAGS[0])
        for _ in range(slots):
            await b.recv(tag=5)
        async with asyncio.timeout(10):
            await a.node.unexpose("x")  # a read's answer, never pulled, held it up for good
        async with asyncio.timeout(10):
            while b.channel.mailbox._arrived or a.channel.mailbox._arrived:  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.01)
        a.node.expose(dst, name="y")
        assert np.array_equal(await b.read(await b.lookup("y")), dst)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["read", "write"])
async def test_a_cancelled_write_the_owner_holds_lands_before_the_next_operation(
    then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tcp write cancelled once its payload was whole at the owner, before the owner's service
    posted its receive: the owner keeps the payload (its read-ahead) and copies it into the
    tensor later, after the cancel returned. The next read was served first and saw the tensor
    as before the write (then the tensor changed under it); the next write was overwritten by
    it. Both now wait until the cancelled write has landed (or was dropped)."""
    real = _onesided._serve_one
    release, entered = asyncio.Event(), asyncio.Event()
    data_tags: list[int] = []

    async def held(peer: Any, table: Any, req: dict[str, Any]) -> None:
        if req.get("op") == "write" and not data_tags:  # the first write's service waits
            data_tags.append(req["data"])
            entered.set()
            await release.wait()
        await real(peer, table, req)

    monkeypatch.setattr(_onesided, "_serve_one", held)
    async with connected_pair("tcp") as (a, b):
        n = 1 << 16
        region = np.zeros(n, np.uint8)
        a.node.expose(region, name="x")
        h = await b.lookup("x")
        task = asyncio.ensure_future(b.write(h, np.ones(n, np.uint8)))
        async with asyncio.timeout(10):
            await entered.wait()
        mailbox = a.channel.mailbox
        await eventually(lambda: bool(q := mailbox._arrived.get(data_tags[0])) and q[0].done.done())
        task.cancel()  # the payload is whole in the owner's read-ahead, its write not yet served
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()
        after = asyncio.ensure_future(b.read(h) if then == "read" else b.write(h, np.full(n, 2, np.uint8)))
        await asyncio.wait({after}, timeout=0.5)  # old code: served (and done) here, before the write landed
        release.set()
        async with asyncio.timeout(10):
            result = await after
        snap = region.copy()
        await eventually(lambda: a.node.exposures.served >= 2 and not mailbox._arrived)
        await asyncio.sleep(0.1)  # anything still to land at the owner would have landed
        if then == "read":
            assert result.all(), "the read ran before the cancelled write (whole at the owner) landed"
            assert np.array_equal(region, result), "the tensor changed after the read returned"
        else:
            assert (region == 2).all(), "the cancelled write landed over the write after it"
        assert np.array_equal(region, snap)


class _CopiesUpFail(HostEngine):
    """A device whose copies to it fail as they are queued (on a GPU: a CUDA error)."""

    def _new_lane(self) -> Any:
        lane = super()._new_lane()

        def refuse(*_: object) -> None:
            raise RuntimeError("copy refused")

        lane.to_device = refuse  # type: ignore[method-assign]
        return lane


_UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc", pytest.param("ucx", marks=_UCX)])
async def test_a_read_whose_answer_fails_here_gives_its_place_back_at_once(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner-assisted read whose answer came whole but could not be copied into its device
    out= fails with the channel up. The owner sent all of it and answers nothing more, but the
    read's place among the channel's unanswered requests (``_MAX_ASKED``, 1 here) went to a drain
    of an error answer that never comes, for _DRAIN_SECONDS (60 s): the next read waited that
    long. Over tcp such a copy failed the channel's reader, and the channel with it; it now
    fails that answer alone. Over ucx the owner serves device memory (ucx registers no
    host-engine memory without cuda lanes)."""
    monkeypatch.setattr(_onesided, "_MAX_ASKED", 1)
    failing, owners = _CopiesUpFail(), HostEngine()
    try:
        async with connected_pair(transport) as (a, b):
            src = np.arange(1 << 16, dtype=np.uint8)
            a.node.expose(EngineArray(owners, src) if transport == "ucx" else src, name="x")
            h = await b.lookup("x")
            assert not h.direct, h
            async with asyncio.timeout(10):
                with pytest.raises(tensorwire.TransferError, match="copy refused"):
                    await b.read(h, out=EngineArray(failing, np.zeros_like(src)))
                assert b.channel.state is ChannelState.OPEN
                assert np.array_equal(await b.read(h), src)  # its place was free
            assert _onesided._askings(b).asked == 0
            assert not b.channel.mailbox._arrived and not a.channel.mailbox._arrived
    finally:
        failing.close()
        owners.close()


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_write_whose_payload_is_refused_leaves_the_owner_waiting_for_nothing(transport: str) -> None:
    """An owner-assisted write whose payload its channel refuses after the request went out
    (past the owner's max_message_bytes: MessageRefused at the writer) left the owner waiting
    for that payload for good, the tensor busy: ``await node.unexpose()`` never returned."""
    limit = 1 << 20
    async with connected_pair(transport, limits=tensorwire.Limits(max_message_bytes=limit)) as (a, b):
        dst = np.zeros(4 * limit, np.uint8)
        a.node.expose(dst, name="x")
        h = await b.lookup("x")
        with pytest.raises(tensorwire.MessageRefused):
            await b.write(h, np.ones(4 * limit, np.uint8))
        with pytest.raises(tensorwire.MessageRefused):
            await b.write_many([h[:limit], h[limit:]], [np.ones(limit, np.uint8), np.ones(3 * limit, np.uint8)])
        await b.write(h[:limit], np.full(limit, 2, np.uint8))  # what fits still goes
        assert (dst[:limit] == 2).all() and not dst[limit:].any()
        async with asyncio.timeout(10):
            await a.node.unexpose("x")
        async with asyncio.timeout(10):
            while b.channel.mailbox._arrived or a.channel.mailbox._arrived:  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("transport", "checksum"), [("tcp", False), ("tcp", True), ("inproc", False)])
@pytest.mark.parametrize("when", ["asked", "landing"])
async def test_a_cancelled_read_lets_its_answer_go_without_a_buffer_of_its_size(
    transport: str, checksum: bool, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner-assisted read cancelled once it was asked for (``asked``), or part way through
    its answer (``landing``), still receives the answer, to take it off the channel. It took it
    into a buffer of its own of the answer's size: a 32 MiB read cancelled took 32 MiB more
    (the part that had landed in out= copied over as well). Now the rest lands piece by piece
    in a small scratch buffer and is dropped, with tcp's checksums not checked against it; out=
    is not written after the cancel, and the channel goes on (the owner's unexpose returns, a
    read works)."""
    tags: list[int] = []
    real_tags = _onesided._tags

    def spied() -> tuple[int, int]:
        tags.append(real_tags()[0])
        return tags[-1], tags[-1] + 1

    monkeypatch.setattr(_onesided, "_tags", spied)
    n = 32 << 20
    # (tcp's 4 MiB frames each span several pieces of the scratch buffer: a checksum of one read
    # back from there failed, and broke the channel)
    async with connected_pair(transport, checksum=checksum) as (a, b):
        # no byte 0 (what landed is counted), none the same 1 MiB on (scratch pieces differ)
        a.node.expose(np.random.default_rng(0).integers(1, 256, n, np.uint8), name="x")
        h = await b.lookup("x")
        out = np.zeros(n, np.uint8)
        mailbox = b.channel.mailbox
        tracemalloc.start()
        try:
            task = asyncio.ensure_future(b.read(h, out=out))
            if when == "asked":
                await asyncio.sleep(0)  # the request is on its way
            else:
                await eventually(lambda: bool(out[0]) or task.done(), 10, pause=0)
            assert not task.done(), "the read ended before its cancel (the test's premise)"
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            landed = np.count_nonzero(out)  # (the answer's bytes land in order)
            assert landed < n, "the answer landed whole before the cancel (the test's premise)"
            reply = tags[-1]
            async with asyncio.timeout(10):
                await a.node.unexpose("x")  # the owner has sent its answer whole

            def drained() -> bool:  # by the task the cancel left (the answer's header came long before)
                held = reply in mailbox._posted or reply in mailbox._arrived or mailbox._held
                return not held and not getattr(b.channel, "_incoming", None)  # (tcp: a payload on its way)

            await eventually(drained, 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - before < n // 4, f"draining the answer took {(peak - before) >> 20} MiB"
        assert np.count_nonzero(out) == landed, "out= was written after the cancel returned"
        a.node.expose(np.full(n, 2, np.uint8), name="y")
        got = await asyncio.wait_for(b.read(await b.lookup("y")), 10)
        assert (got == 2).all()


@pytest.mark.timeout(60)
async def test_a_cancelled_write_the_owner_refused_leaves_no_note_behind() -> None:
    """An owner-assisted write the owner refuses (the name unexposed, or exposed again since
    the lookup) whose writer is cancelled while its payload is going out: tcp finishes the
    frame, so the payload reaches the owner whole, and the writer then sends its note that no
    payload comes. The owner's refusal had drained one message of the write (the payload) and
    the note stayed on the owner's data tag for good, each holding one of the writer's message
    slots there (with Limits(max_unexpected=4), eight such writes and every owner-assisted
    read or write to that owner waited for good). A refusal that took the payload now says so,
    and the writer asks the owner to drop the note, as after a write that landed."""
    import socket

    async with connected_pair("tcp", limits=tensorwire.Limits(max_unexpected=4)) as (a, b):
        n = 4 << 20
        # small socket buffers: the payload's one frame goes out over many loop turns
        b.channel._io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        a.channel._io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        cancelled = 0
        for r in range(3):
            a.node.expose(np.zeros(n, np.uint8), name=f"x{r}")
            h = await b.lookup(f"x{r}")
            await a.node.unexpose(f"x{r}")  # the owner refuses the write from now on
            served = a.node.exposures.served
            task = asyncio.ensure_future(b.write(h, np.ones(n, np.uint8)))
            # the owner has refused the request; the payload is on its way
            await eventually(lambda: a.node.exposures.served > served or task.done(), 10, pause=0)  # noqa: B023
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                cancelled += 1
            except tensorwire.HandleNotFound:
                pass  # (it went out whole and was answered before the cancel)
        assert cancelled, "no write was cancelled while its payload went out (the test's premise)"
        # old code: a note per cancelled write, left unread at the owner for good
        await eventually(lambda: not a.channel.mailbox._arrived, 10)
        a.node.expose(np.arange(10), name="y")
        async with asyncio.timeout(10):
            assert np.array_equal(await b.read(await b.lookup("y")), np.arange(10))


@pytest.mark.timeout(60)
async def test_a_read_beside_a_write_of_the_same_rows_keeps_a_checksummed_channel_open() -> None:
    """Reads and writes of the same bytes at the same time are neither ordered nor atomic (a
    read may see parts of both), checksums or not. With checksum=True the owner's answer to a
    read left in frames whose crc32c it took as each frame was built, and a frame the socket
    took only part of went on from the exposed memory over later loop turns, while a peer's
    write landed in it: the reader found a crc32c mismatch in bytes the wire had not changed,
    its channel broke with IntegrityError ('its out= buffer may hold corrupted bytes'), and the
    write and every other operation on it failed. The crc32c now covers the bytes as the socket
    takes them."""
    import socket

    async with connected_pair("tcp", checksum=True) as (a, b):
        # small socket buffers: each of the answer's frames goes out over many loop turns
        a.channel._io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        b.channel._io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        n = 16 << 20
        region = np.zeros(n, np.uint8)
        a.node.expose(region, name="x")
        h = await b.lookup("x")
        stop = asyncio.Event()

        async def writes() -> int:
            k = 0
            while not stop.is_set():
                k += 1
                await b.write(h[: 1 << 20], np.full(1 << 20, k % 250 + 1, np.uint8))
            return k

        writing = asyncio.ensure_future(writes())
        try:
            async with asyncio.timeout(30):
                for _ in range(4):
                    got = await b.read(h)
                    assert not got[1 << 20 :].any()  # (rows nobody wrote)
        finally:
            stop.set()
            written = await writing
        assert written > 1, "no write went beside the reads (the test's premise)"
        assert b.channel.state is ChannelState.OPEN and a.channel.state is ChannelState.OPEN


@pytest.mark.timeout(60)
async def test_two_peers_writing_the_same_rows_keep_their_checksummed_channels_open() -> None:
    """Two peers writing the same rows at once leave rows holding parts of both, checksums or
    not. With checksum=True the owner summed each payload frame once it had landed, reading it
    back from the exposed tensor, where the other peer's write had landed meanwhile: a crc32c
    mismatch in bytes the wire had not changed broke the owner's channel to that writer
    (IntegrityError), and the write failed with PeerDisconnected. The owner now sums the bytes
    as they land."""
    import socket

    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=True) as owner,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=True) as first,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=True) as second,
    ):
        n = 16 << 20
        region = np.zeros(n, np.uint8)
        owner.expose(region, name="x")
        writers = [await first.connect(owner.address), await second.connect(owner.address)]
        for p in owner.peers:  # small socket buffers: each frame lands over many loop turns
            p.channel._io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        handles = [await w.lookup("x") for w in writers]

        async def writes(w: tensorwire.Peer, h: Any, value: int) -> None:
            for _ in range(6):
                await w.write(h, np.full(n, value, np.uint8))

        async with asyncio.timeout(30):
            await asyncio.gather(*[writes(w, h, v) for w, h, v in zip(writers, handles, (1, 2), strict=True)])
        assert set(np.unique(region)) <= {1, 2}
        assert all(p.channel.state is ChannelState.OPEN for p in [*writers, *owner.peers])


async def test_a_reader_whose_node_closes_under_its_read_is_no_failure_at_the_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reader's node that closes while the owner serves its read (inproc: its goodbye is heard
    at once, before the channel closes) went away, as the owner's channel says: the owner's
    service ends quietly. It logged a warning that the read "failed at the owner" (5 of 5 such
    closes, found by tests/test_model_onesided.py) and tried to send that peer an error answer."""
    async with tensorwire.start("127.0.0.1:0", transports=("inproc",)) as owner:
        node = await tensorwire.start("127.0.0.1:0", transports=("inproc",))
        try:
            reader = await node.connect(owner.address)
            await owner.accept()
            owner.expose(np.arange(1 << 20, dtype=np.float32), name="x")
            h = await reader.lookup("x")
            reading = asyncio.ensure_future(reader.read(h))
            await asyncio.sleep(0)  # the request is on its way
        finally:
            await node.aclose()
        with pytest.raises(tensorwire.ClosedResourceError):
            await reading
        await asyncio.sleep(0.05)  # (the owner's service of the read has ended)
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not failures, failures


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_big_endian_source_or_out_is_refused_as_send_refuses_it(transport: str) -> None:
    """A big-endian write source or read ``out=`` (of the handle's dtype and shape, byte-swapped)
    was a ShapeMismatchError, "the source is >i4[5] but 'arr' is int32[5]", where send, call and
    ``_out`` raise UnsupportedTensorError naming the byte order: one-sided now says the same, in
    the batches too, and nothing is read or written."""
    async with connected_pair(transport) as (a, b), asyncio.timeout(20):
        b.node.expose(np.arange(5, dtype=np.int32), name="arr")
        h = await a.lookup("arr")
        swapped = np.full(5, 7, dtype=">i4")
        with pytest.raises(tensorwire.UnsupportedTensorError) as sent:
            await a.send(swapped, tag=1)
        said = str(sent.value)
        assert said == "big-endian dtype int32 (>i4) is not supported; convert to native order", said
        for refused in (
            lambda: a.write(h, swapped),
            lambda: a.write_many([h], [swapped]),
            lambda: a.read(h, out=np.empty(5, ">i4")),
            lambda: a.read_many([h], outs=[np.empty(5, ">i4")]),
        ):
            with pytest.raises(tensorwire.UnsupportedTensorError) as info:
                await refused()
            assert str(info.value) == said
        assert np.array_equal(await a.read(h), np.arange(5))  # nothing was written
