"""The ucx transport at its edges: cancellations at the step where a message has just matched,
a peer killed mid-rendezvous, resources after many cycles. Real UCX on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib.util
import json
import logging
import logging.handlers
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _children import end_child
from _polling import awhile, collected, eventually
from _procfs import listening_ports

import tensorwire
from tensorwire._peer import tag_id
from tensorwire.errors import PeerDisconnected, TransferError
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState
from tensorwire.transports.ucx import _ucp

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
    pytest.mark.timeout(30),
]

KiB = 1 << 10
MiB = 1 << 20


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_a_recv_cancelled_just_as_its_message_matched_gives_it_back_whole(tls: str) -> None:
    """An eager message (past the inline size) matches a waiting recv(out=), whose payload the
    control handler receives straight into that out=; the recv is cancelled before its task ran.
    The message goes back to the queue in a buffer of ours, and the next recv(out=) must get its
    bytes. It used to get its own out= untouched, with a receipt saying direct=True: the message
    still looked as if it had to be pulled, so the next recv took its out= for the destination
    of a payload that had already landed elsewhere (20 of 20 corrupt, sm and tcp)."""
    src = (np.arange(64 * KiB) % 251 + 1).astype(np.uint8)
    tag = tag_id("t")
    async with connected_pair("ucx", ucx_options={"TLS": tls}) as (a, b):
        mailbox = b.channel.mailbox
        for _ in range(5):
            recv = asyncio.ensure_future(b.recv(tag="t", out=np.zeros_like(src)))
            while not mailbox.has_posted(tag):  # noqa: ASYNC110 - the posted recv is the point
                await asyncio.sleep(0)
            send = asyncio.ensure_future(a.send(src, tag="t"))
            while mailbox.has_posted(tag):  # noqa: ASYNC110 - matched: its task has yet to run
                await asyncio.sleep(0)
            recv.cancel()
            (first,) = await asyncio.gather(recv, return_exceptions=True)
            await send
            assert isinstance(first, asyncio.CancelledError), "the recv ran before its cancel"
            out = np.zeros_like(src)
            got, receipt = await asyncio.wait_for(b.recv_with_receipt(tag="t", out=out), 5)
            assert got is out
            assert np.array_equal(out, src), f"the message was lost: {receipt}"
            assert receipt.staged, receipt  # copied from the buffer it was given back in


def _message(tag: int, seq: int, n: int) -> Any:
    """Message ``seq`` on ``tag``, ``n`` payload bytes that say which message they are."""
    if n < 8:
        return {"seq": np.array([seq], np.int64), "x": np.full(n, seq % 256, np.uint8)}
    a = ((np.arange(n, dtype=np.uint32) * 7 + (seq * 13 + tag) % 256) % 256).astype(np.uint8)
    a[:8] = np.frombuffer(np.int64(seq).tobytes(), np.uint8)
    return a


def _seq_of(tag: int, n: int, value: Any) -> int:
    """The message's number, after checking every byte of it."""
    if n < 8:
        seq = int(value["seq"][0])
        assert np.array_equal(value["x"], _message(tag, seq, n)["x"]), f"tag {tag}: message {seq} corrupt"
        return seq
    seq = int(np.frombuffer(value[:8].tobytes(), np.int64)[0])
    assert 0 <= seq <= _LAST and np.array_equal(value, _message(tag, seq, n)), f"tag {tag}: message corrupt"
    return seq


_LAST = 1 << 30  # the number of each tag's last message
# inline (up to 8 KiB in the control frame) and beyond: eager payloads, and rendezvous once the
# receiver's 3 MiB of credit is spent
_SIZES = [0, 1, 8, 100, 8184, 8192, 8200, 16 * KiB, 64 * KiB, 65 * KiB, 300 * KiB, 2048 * KiB]


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_random_cancellations_over_many_tags_lose_nothing(tls: str) -> None:
    """Fixed-seed stress: a sender and a receiver per tag, one operation at a time, sizes on
    both sides of the inline, eager and rendezvous limits; a quarter of the sends and recvs
    are cancelled at a random moment, recvs alternate between out= and none. Every send that
    returned arrives exactly once, in order, intact (a cancelled one arrives whole or not at
    all), and a cancelled recv's out= is not written after the cancel returned. It used to
    hand recvs corrupt messages in every run (see the test above)."""
    rng = random.Random(20261125)
    sent: dict[int, list[int]] = {t: [] for t in range(len(_SIZES))}
    maybe: dict[int, set[int]] = {t: set() for t in range(len(_SIZES))}
    got: dict[int, list[int]] = {t: [] for t in range(len(_SIZES))}
    limits = tensorwire.Limits(recv_buffer_bytes=3 << 20)

    async def sender(a: Any, t: int, r: random.Random) -> None:
        for seq in range(40):
            task = asyncio.ensure_future(a.send(_message(t, seq, _SIZES[t]), tag=t))
            if r.random() < 0.25:
                await asyncio.sleep(r.choice([0, 0, 1e-4, 1e-3]))
                task.cancel()
            try:
                await task
                sent[t].append(seq)
            except asyncio.CancelledError:
                maybe[t].add(seq)
        await a.send(_message(t, _LAST, _SIZES[t]), tag=t)

    async def receiver(b: Any, t: int, r: random.Random) -> None:
        n = _SIZES[t]
        while True:
            out = None
            if r.random() < 0.5:
                out = {"seq": np.empty(1, np.int64), "x": np.empty(n, np.uint8)} if n < 8 else np.empty(n, np.uint8)
            task = asyncio.ensure_future(b.recv(tag=t, out=out))
            if r.random() < 0.25:
                await asyncio.sleep(r.choice([0, 0, 1e-4, 1e-3]))
                task.cancel()
            try:
                value = await task
            except asyncio.CancelledError:
                if out is not None:
                    held = out["x"] if n < 8 else out
                    landed = held.copy()
                    await asyncio.sleep(0.005)
                    assert np.array_equal(held, landed), f"tag {t}: out= written after its recv was cancelled"
                continue
            assert out is None or value is out
            seq = _seq_of(t, n, value)
            if seq == _LAST:
                return
            got[t].append(seq)

    async with connected_pair("ucx", limits=limits, ucx_options={"TLS": tls}) as (a, b):
        async with asyncio.timeout(60):
            await asyncio.gather(
                *(sender(a, t, random.Random(rng.random())) for t in range(len(_SIZES))),
                *(receiver(b, t, random.Random(rng.random())) for t in range(len(_SIZES))),
            )
    for t, n in enumerate(_SIZES):
        assert got[t] == sorted(set(got[t])), f"{n}-byte messages reordered or doubled: {got[t]}"
        assert set(sent[t]) <= set(got[t]), f"{n}-byte messages lost: {sorted(set(sent[t]) - set(got[t]))}"
        assert set(got[t]) <= set(sent[t]) | maybe[t], f"{n}-byte messages never sent arrived"


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
@pytest.mark.parametrize("n", [100 * KiB, 4 * KiB * KiB])
async def test_closing_while_a_send_moves_its_payload_tells_the_send_what_happened(tls: str, n: int) -> None:
    """A peer closed while its send's payload is with UCX: UCX cannot take the payload back, so
    the message may arrive; the send must then not say it failed. It used to: the close failed
    the send with ClosedResourceError("channel closed") while the receiver got the message whole
    (10 of 10, 100 KiB over sm and tcp lanes, 4 MiB over sm), so a caller that retried sent it
    twice."""
    src = (np.arange(n) % 251).astype(np.uint8)
    for _ in range(3):
        async with connected_pair("ucx", ucx_options={"TLS": tls}) as (a, b):
            send = asyncio.ensure_future(a.send(src, tag="t"))
            await asyncio.sleep(0)  # posted: MSG frame and payload are with UCX
            close = asyncio.ensure_future(a.aclose())
            sent, got, _ = await asyncio.gather(
                asyncio.wait_for(send, 10), asyncio.wait_for(b.recv(tag="t"), 10), close, return_exceptions=True
            )
            arrived = isinstance(got, np.ndarray) and np.array_equal(got, src)
            if not arrived:
                assert isinstance(got, tensorwire.errors.TensorWireError), got
            assert isinstance(sent, tensorwire.Receipt) == arrived, f"send said {sent!r}, recv got {got!r}"


def _segment_ended(send: asyncio.Future[Any], futs: set[asyncio.Future[Any]]) -> bool:
    return send.done() or any(f.done() for f in futs)


@pytest.mark.parametrize("credit", [None, 16 * MiB])
async def test_closing_between_two_segments_of_a_send_tells_the_send_what_happened(credit: int | None) -> None:
    """The same, for a message of many tensors, the close coming as UCX has finished one
    segment's send and the send is about to wait for the next (eager, and rendezvous: a
    receiver whose credit is below the message). The close found no payload send in flight
    (the one that had ended was not waited for again) and went on: the send failed with
    ClosedResourceError("channel closed") at its next segment, whose payload UCX had taken
    with the others, and the receiver got the message whole."""
    src = [np.full(MiB, i + 1, np.uint8) for i in range(24)]
    limits = None if credit is None else tensorwire.Limits(recv_buffer_bytes=credit)
    for _ in range(3):
        async with connected_pair("ucx", limits=limits) as (a, b):
            got = asyncio.ensure_future(asyncio.wait_for(b.recv(tag="t"), 10))
            send = asyncio.ensure_future(a.send(src, tag="t"))
            # a payload send's wait stays in _futs until its send has gone on from it
            await eventually(functools.partial(_segment_ended, send, a.channel._futs), pause=0)
            close = asyncio.ensure_future(a.aclose())
            sent, value, _ = await asyncio.gather(asyncio.wait_for(send, 10), got, close, return_exceptions=True)
            arrived = isinstance(value, list) and all(np.array_equal(x, y) for x, y in zip(value, src, strict=True))
            if not arrived:
                assert isinstance(value, tensorwire.errors.TensorWireError), value
            assert isinstance(sent, tensorwire.Receipt) == arrived, f"send said {sent!r}, recv got {type(value)}"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
async def test_a_bye_that_overtakes_the_payload_loses_neither_the_message_nor_the_send() -> None:
    """Two processes over UCX's tcp lanes, one 16 MiB message per channel, each side closing as
    soon as it is done with it. UCX carries the payload on other lanes than the control frames,
    so a BYE can overtake the end of a transfer that had finished at its sender's end. The
    message must still be delivered, and the send must still succeed. They used to fail with
    "peer closed the channel": the send in about 1 of 5 channels here (its receiver had the
    message and closed), the recv in about 1 of 40 (its sender's send had returned)."""
    cycles, size = 30, 16 * MiB
    opts = {"TLS": "tcp"}
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=opts) as node:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import asyncio, numpy as np, tensorwire
                async def main():
                    src = np.resize(np.arange(251, dtype=np.uint8), {size})  # 0..250, 0..250, ...
                    failed = []
                    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options={opts!r}) as n:
                        for i in range({cycles}):
                            p = await n.connect({node.address!r})
                            await asyncio.sleep(0.01)
                            try:
                                await p.send(src, tag=1)
                            except Exception as exc:
                                failed.append(f"send {{i}}: {{exc!r}}")
                            await p.aclose()
                    print(failed)
                asyncio.run(main())
                """
            ),
            stdout=asyncio.subprocess.PIPE,
        )
        # the sender's bytes; (np.arange(size) % 251).astype(np.uint8), the same, took 0.8 CPU-s
        # on each side (a 128 MiB int64 temporary), np.resize of the first 251 0.01 s
        want = np.resize(np.arange(251, dtype=np.uint8), size)
        lost = []
        try:
            async with asyncio.timeout(80):
                for i in range(cycles):
                    peer = await node.accept()
                    await asyncio.sleep(0.02)  # the message comes before its recv
                    try:
                        got = await peer.recv(tag=1)
                        assert np.array_equal(got, want), f"message {i} corrupt"
                    except tensorwire.TensorWireError as exc:
                        lost.append(f"recv {i}: {exc!r}")
                    await peer.aclose()
                out, _ = await child.communicate()
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
        assert child.returncode == 0
        failed = out.decode().strip()
        assert not lost and failed == "[]", f"lost: {lost}; sends failed: {failed}"


def _before_data_connect(node: tensorwire.Node, first: Callable[[], Awaitable[None]]) -> None:
    """Make ``node``'s ucx connects run ``first()`` once the control-plane handshake is done,
    before they send their HELLO."""
    transport: Any = node.transports["ucx"]
    connect = transport.connect

    async def connect_after(*args: Any) -> Any:
        await first()
        return await connect(*args)

    transport.connect = connect_after


async def test_a_server_closing_before_it_takes_the_hello_fails_the_connect_at_once() -> None:
    """The server answers the handshake, then closes before the client's HELLO reaches it. Over
    tcp the data listener's refusal fails the connect at once; over ucx nothing answered (the
    endpoint has no peer error handling), and the connect waited out handshake_seconds (10 s by
    default, 30 s here: the test gives up long before). It now sees the control connection shut
    and fails at once, saying so; or, where the closed server's UCX worker is already freed, UCX
    cannot create the endpoint, and that says the server went away. The client node is unharmed:
    it connects elsewhere, closes."""
    limits = tensorwire.Limits(handshake_seconds=30)
    async with asyncio.timeout(10):
        server = await tensorwire.start(transports=("ucx",), limits=limits)
        async with tensorwire.start(transports=("ucx",), limits=limits, connect_timeout=30) as client:
            _before_data_connect(client, server.aclose)
            with pytest.raises(tensorwire.ConnectError, match=r"ucx data connection.* failed: .*the server went away"):
                await client.connect(server.address)
            async with tensorwire.start(transports=("ucx",)) as other:
                peer = await client.connect(other.address)  # (its server.aclose() does nothing more)
                await peer.send(np.arange(3), tag=1)
                assert np.array_equal(await (await other.accept()).recv(tag=1), np.arange(3))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_server_dying_before_it_takes_the_hello_fails_the_connect_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As above, the server's process killed between its answer to the handshake and taking the
    client's HELLO (stopped as the data connection begins, so that the endpoint to it is made
    and the HELLO posted; killed then): the connect fails at once, not after handshake_seconds
    (30 s here). The error, which a program may keep (a retry loop's last one; pytest.raises
    here), does not keep the client node's UCX worker once the node has closed: its traceback
    held the connect's endpoint and requests, and with them the worker's 2 listening sockets and
    2 shared-memory mappings."""
    # (a failure shows how the endpoint and the worker went: tensorwire's debug log of the ucx
    # transport, and what still refers to a UCX worker; see the re-count below)
    caplog.set_level(logging.DEBUG, logger="tensorwire.transports.ucx")
    code = (
        "import asyncio, tensorwire\n"
        "async def main():\n"
        '    async with tensorwire.start(transports=("ucx",)) as n:\n'
        "        print(n.address, flush=True)\n"
        "        await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        address = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
        limits = tensorwire.Limits(handshake_seconds=30)
        gc.collect()  # (an earlier test's garbage may hold a UCX worker: freed by the collections below)
        before = _ucx_footprint()
        async with tensorwire.start(transports=("ucx",), limits=limits, connect_timeout=30) as client:
            started = asyncio.Event()

            async def stop() -> None:
                os.kill(child.pid, signal.SIGSTOP)
                started.set()

            _before_data_connect(client, stop)
            async with asyncio.timeout(10):
                connect = asyncio.ensure_future(client.connect(address))
                await started.wait()  # the connect ran on to its first wait: its HELLO is posted
                child.kill()
                await child.wait()
                with pytest.raises(tensorwire.ConnectError, match="the server went away during the connect") as failed:
                    await connect
        assert failed.value is not None

        # (collected and counted again for a while. About once in five runs of the whole suite
        # this failed with fewer sockets and mappings after than before, (0, 6) against (2, 8):
        # the UCX worker of an earlier test, kept by a reference cycle, was freed by the first
        # collection here: test_ucx's wedged-worker test kept its real worker in the closure of
        # a class (gone; as in test_wakeups). Hence also the collection before counting)
        def released() -> bool:
            gc.collect()
            kept = _ucx_footprint()
            return (kept[0], kept[2]) == (before[0], before[2])

        await awhile(released, 10, pause=0.05)  # (said below, with what kept the worker)
        kept = _ucx_footprint()
        assert (kept[0], kept[2]) == (before[0], before[2]), (
            f"(listening sockets, /dev/shm mappings) before and after; {_what_keeps_ucx_workers()}"
        )
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def test_a_connect_cancelled_after_its_hello_leaves_the_server_no_peer(caplog: pytest.LogCaptureFixture) -> None:
    """A connect cancelled once its HELLO is out (the caller's deadline): the server takes the
    HELLO and makes a peer of the client, which nobody holds. Over tcp the shut socket ends it
    at once; over ucx the server kept it until its lease ran out (30 s here; the test gives up
    after 10). The given-up connect now answers the WELCOME with a BYE, which ends it."""
    caplog.set_level(logging.INFO, logger="tensorwire")
    async with (
        tensorwire.start(transports=("ucx",), lease_seconds=30) as server,
        tensorwire.start(transports=("ucx",)) as client,
    ):
        started = asyncio.Event()

        async def start() -> None:
            started.set()

        _before_data_connect(client, start)
        connect = asyncio.ensure_future(client.connect(server.address))
        await started.wait()  # the connect ran on to its first wait: its HELLO is posted
        connect.cancel()
        with pytest.raises(asyncio.CancelledError):
            await connect
        accepted = f"(node {client.node_id[:12]})"
        await eventually(lambda: any(accepted in r.getMessage() for r in caplog.records), 10)
        await eventually(lambda: not server.peers, 10)


async def test_a_peer_aborted_over_ucx_leaves_its_remote_at_once() -> None:
    """``abort()`` drops the connection at once; the remote side sees it end, as a tcp peer
    sees the shut socket. Over ucx it saw nothing until the lease ran out (30 s here): a peer
    that connected as its caller gave up is aborted so, and its server kept it meanwhile."""
    async with (
        tensorwire.start(transports=("ucx",), lease_seconds=30) as server,
        tensorwire.start(transports=("ucx",), lease_seconds=30) as client,
    ):
        peer = await client.connect(server.address)
        other = await server.accept()
        recv = asyncio.ensure_future(other.recv(tag=1))
        peer.abort()
        async with asyncio.timeout(10):
            with pytest.raises(tensorwire.PeerDisconnected):
                await recv
        await eventually(lambda: not server.peers, 10)


def _what_keeps_ucx_workers() -> str:
    """The ucxx workers still alive in this process and, for each, the kinds of object that refer
    to it (two steps back): none alive, and the footprint still there, means UCX itself kept the
    worker (a request of it that never ended holds its endpoint, which holds the worker)."""
    alive = [o for o in gc.get_objects() if type(o).__name__ == "UCXWorker"]
    if not alive:
        return "no ucxx UCXWorker object is alive: UCX keeps the worker, not Python"
    here = sys._getframe()

    def name(o: object) -> str:  # (a frame by its function: a kept traceback's frames hold their locals)
        return f"frame of {o.f_code.co_name}" if isinstance(o, types.FrameType) else type(o).__name__

    said = []
    for w in alive:
        paths = []
        for r in gc.get_referrers(w):
            if r is here or r is alive:
                continue
            back = [name(rr) for rr in gc.get_referrers(r) if rr is not alive and rr is not here][:4]
            paths.append(f"{name(r)} <- {', '.join(back) or '?'}")
        said.append("UCXWorker held by: " + "; ".join(paths[:8]))
    return " | ".join(said)


def _ucx_footprint() -> tuple[int, int, int]:
    """This process's listening tcp sockets, open descriptors and shared-memory mappings."""
    listening = len(listening_ports())
    with open("/proc/self/maps") as f:
        shm = sum("/dev/shm/" in line for line in f)
    return listening, len(os.listdir("/proc/self/fd")), shm


@pytest.fixture
async def grpc_kept() -> AsyncIterator[None]:
    """A node that stays open through the test, so that gRPC's shared event engine does too: it
    goes with the last gRPC user, or a while after it, and takes 2 descriptors (an epoll and an
    eventfd) with it. Between the closed pairs of a footprint test there was none, and 1 sweep
    in about 300 under load counted 2 descriptors more after the pairs than after the first."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)):
        yield


@pytest.mark.usefixtures("grpc_kept")
async def test_closed_ucx_nodes_leave_no_listeners_descriptors_or_shared_memory_behind() -> None:
    """A closed node frees its UCX worker and context even while the program still holds the
    node (a list, an attribute, a traceback). The transport kept its hello receive, and a ucxx
    request holds its worker: each closed node that was still referenced kept two listening
    tcp sockets, 11 descriptors and 2 shared-memory mappings (a connected pair: 4, 22, 6), so
    they piled up with every node a process started and closed. A closed channel let go of its
    endpoint only with the channel itself, so a peer still held kept them too; and the messages
    nobody received kept the receives that had landed them (b's mailbox, here)."""
    held: list[object] = []

    async def pair_with_a_transfer() -> None:
        async with (
            tensorwire.start("127.0.0.1:0", transports=("ucx",)) as a,
            tensorwire.start("127.0.0.1:0", transports=("ucx",)) as b,
        ):
            peer = await a.connect(b.address)
            other = await b.accept()
            for _ in range(2):
                await peer.send(np.ones(64 * KiB, np.uint8), tag="unread")  # (landed in buffers of b's)
            await asyncio.gather(peer.send(np.arange(MiB, dtype=np.uint8), tag="t"), other.recv(tag="t"))
        held.extend((a, b, peer, other))

    await pair_with_a_transfer()  # the first also starts what stays for the process (gRPC's threads)
    gc.collect()
    first = _ucx_footprint()
    for _ in range(3):
        await pair_with_a_transfer()
    gc.collect()
    assert _ucx_footprint() == first, "(listening sockets, descriptors, /dev/shm mappings) after 1 and 4 pairs"


@pytest.mark.usefixtures("grpc_kept")
@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
async def test_the_error_of_a_bad_control_frame_kept_in_a_log_does_not_keep_the_closed_nodes_ucx_worker(
    bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad control frame's ProtocolError is raised inside a UCX completion callback, and its
    traceback holds the frames that ran that callback: the dispatch's, with the request that
    completed (through ucxx: the control receive itself) and the progress run's, with the
    worker. The channel logged and kept that very error, so a log handler that keeps its records
    (logging's MemoryHandler, a queue; pytest's own capture) kept the node's UCX worker, its 2
    listening sockets and 2 shared-memory mappings, after the node closed. It is logged and
    told as a copy without the traceback now (``fresh``), as the channel tells its failure."""
    from test_ucx import recv_after_raw_frame, without_libucp

    from tensorwire.transports._frames import HEADER, FrameType

    if bindings == "ucxx":  # the control receive through ucxx
        without_libucp(monkeypatch)
    keeper = logging.handlers.BufferingHandler(10_000)  # (keeps every record: never flushed here)
    kept = keeper.buffer
    logger = logging.getLogger("tensorwire.transports.ucx")
    frame = HEADER.pack(b"EVIL", int(FrameType.CREDIT), 0, 0, 0, 0, 0, 0, 0, 0)
    gc.collect()
    before = _ucx_footprint()
    logger.addHandler(keeper)
    try:
        async with connected_pair("ucx") as (a, b):
            assert (b.channel._ucp is None) == (bindings == "ucxx")
            failed = await recv_after_raw_frame(a, b, frame)
        assert isinstance(failed, tensorwire.ProtocolError), repr(failed)
        assert any("closing ucx channel" in r.getMessage() for r in kept), [r.getMessage() for r in kept]
        gc.collect()
        after = _ucx_footprint()
        assert (after[0], after[2]) == (before[0], before[2]), (
            f"(listening sockets, /dev/shm mappings) before and after, the log kept; {_what_keeps_ucx_workers()}"
        )
    finally:
        logger.removeHandler(keeper)


async def test_a_ucx_close_cancelled_while_it_waits_for_endpoint_closes_still_frees_the_worker() -> None:
    """Cancelled while it waited for its endpoint closes (a gone peer's takes up to a second),
    the transport's close still frees its UCX worker; a second close returns at once (as when
    a loop's shutdown cancels a node's closing and runs it again). It used to leave the worker
    open: its descriptor still watched by the loop, its listening sockets bound."""
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
        transport: Any = node.transports["ucx"]
        worker = transport.worker
        slow = asyncio.ensure_future(asyncio.sleep(30))  # an endpoint close that takes its time
        worker.track(slow)
        closing = asyncio.ensure_future(transport.aclose())
        await eventually(lambda: transport._closed)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await transport.aclose()
        slow.cancel()
        assert worker._closed
        assert not hasattr(worker, "worker"), "the UCX worker is still open"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_raw_ucxx_baseline_of_the_ucx_benchmark_closes_without_ucx_errors() -> None:
    """benchmarks/ucx_p2p.py's raw ucxx turn over tcp, briefly. Its server dropped its endpoint only
    after the client process had exited, and over tcp that endpoint's closing flush failed: every
    turn printed "UCX ERROR ... error during flush: Connection reset by remote peer" twice and
    "UCXX ERROR ... Error while closing endpoint" once (9 lines in a full run), which read as
    tensorwire failing. The two endpoints now close in order, the server's first."""
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import ucx_p2p\n"
        "ucx_p2p.OS_ARG = [4096]\n"
        "ucx_p2p.RTT_ITERS = 200\n"  # (not 3000: 2 CPU-s less; the median is taken past the first 100)
        "out = ucx_p2p.raw_server('tcp', [1])\n"
        "print('TWB', sorted(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("UCX_TLS", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=100, env=env)
    output = run.stdout + run.stderr  # (UCX logs to stdout)
    assert run.returncode == 0, output
    assert "TWB ['bw', 'get', 'put', 'rtt_us']" in run.stdout, output
    assert "ERROR" not in output, output


# A hub whose peer is SIGKILLed with operations in flight to it, closing after the peer's lease
# ran out, in a process of its own (UCX prints on that process's stdout). argv: the hub's UCX
# options (JSON), the tests folder. Prints one JSON line: the hub's listening sockets and /dev/shm
# mappings before the node and after it closed, and what became of each operation.
_KILLED_PEER_HUB = r"""
import asyncio, gc, json, os, signal, subprocess, sys
import numpy as np
import tensorwire

sys.path.insert(0, sys.argv[2])
from _procfs import listening_ports

WORKER = '''
import asyncio, json, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=json.loads(sys.argv[2])) as n:
        n.expose(np.zeros(8 << 20, np.uint8), name="mem")
        p = await n.connect(sys.argv[1])
        await p.send(np.arange(3), tag="ready")
        await asyncio.Event().wait()
asyncio.run(main())
'''


def footprint():
    with open("/proc/self/maps") as f:
        return [len(listening_ports()), sum("/dev/shm/" in line for line in f)]


async def main():
    before = footprint()
    options = json.loads(sys.argv[1])
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options, lease_seconds=1.0) as hub:
        worker = subprocess.Popen([sys.executable, "-c", WORKER, hub.address, sys.argv[1]])
        try:
            peer = await hub.accept()
            await peer.recv(tag="ready")
            handle = await peer.lookup("mem")
            await peer.read(handle, out=np.empty(8 << 20, np.uint8))  # (the lanes for it are up)
            os.kill(worker.pid, signal.SIGSTOP)  # nothing it is sent is taken from here on
            ops = [peer.send(np.ones(6000, np.uint8), tag="inline") for _ in range(3)]
            ops += [peer.read(handle, out=np.empty(8 << 20, np.uint8)), peer.write(handle, np.ones(8 << 20, np.uint8))]
            ops.append(peer.recv(tag="never"))  # fails once the lease has run out
            ops = [asyncio.ensure_future(op) for op in ops]
            await asyncio.sleep(0.2)
        finally:
            worker.kill()
            worker.wait()
        results = await asyncio.gather(*ops, return_exceptions=True)
        del ops
    gc.collect()
    print(json.dumps({"before": before, "after": footprint(), "ops": [type(r).__name__ for r in results]}), flush=True)


asyncio.run(main())
"""


def _quiet_hub(script: str, options: dict[str, str], *args: str) -> dict[str, Any]:
    """Run a hub child (``script``, with these UCX options and ``args`` after them) to its end: it
    must exit 0 and print no line of UCX's own (UCX logs to stdout); its report, the last line it
    printed."""
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(options), str(Path(__file__).parent), *args],
        capture_output=True,
        text=True,
        timeout=80,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    ucx_lines = [line for line in output.splitlines() if "UCX  WARN" in line or "UCX  ERROR" in line]
    assert not ucx_lines, "\n".join(ucx_lines)
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return report


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [{}, {"TLS": "tcp"}], ids=["default", "tcp-lanes"])
def test_a_node_whose_peer_was_killed_mid_operation_closes_without_ucx_warnings(options: dict[str, str]) -> None:
    """A hub's peer is stopped, sent messages, read and written, then SIGKILLed; its lease runs
    out and the hub closes. Nothing of UCX's own may reach the output (tensorwire did what it
    should, and said so: the lease warning, PeerDisconnected), and the hub's UCX worker is freed.

    Default lanes: control frames carrying 6000 bytes went rendezvous, which never completes to
    a dead peer. Their requests kept the BYE behind them from completing, and with it the
    worker: 2 listening sockets and 3 /dev/shm mappings stayed after the close; where the worker
    was freed, UCX printed three 'mpool.c WARN object ... tag_send ... rendezvous zero-copy read
    from remote cma/memory ... was not returned to mpool ucp_requests' and three 'rcache.c WARN
    ucp_rcache: destroying inuse region'. tcp lanes: the dead peer's endpoint closing printed
    'flush.c ERROR ... error during flush: Connection reset by remote peer' twice, and (the
    owner's worker having served a read before) an mpool warning for the read UCX emulates,
    which its dead owner never answered: UCX cannot fail it without peer error handling."""
    report = _quiet_hub(_KILLED_PEER_HUB, options)
    assert report["ops"][-1] == "PeerDisconnected", report  # the lease ran out before the close
    assert report["after"] == report["before"], f"(listening sockets, /dev/shm mappings): {report}"


# A hub that sends 56 MiB to a peer which never takes it (stopped, then SIGKILLed) and closes
# once the peer's lease ran out, in a process of its own (UCX prints on that process's stdout).
# argv: the hub's UCX options (JSON), the tests folder, "warm" (a rendezvous each way first) or
# "first" (the 56 MiB is the first rendezvous to the peer), and how the hub's node ends (see
# ENDINGS). Prints one JSON line: the hub's listening sockets, descriptors and /dev/shm mappings
# before the node and after it closed, whether the payload was with UCX when the peer was
# stopped, and what became of the send. (56 MiB: the most that goes eager, its payload straight
# to UCX, within the default 64 MiB of credit, whose last eighth is kept for small messages.)
_KILLED_RECEIVER_HUB = r"""
import asyncio, faulthandler, gc, json, os, signal, subprocess, sys
import numpy as np
import tensorwire

faulthandler.dump_traceback_later(45, exit=True)  # (a close that hangs says where)
# "lease": the peer is killed and the hub closes once its lease has run out; "killed": the hub
# closes right after the kill; "stopped": the hub closes with the peer alive but stopped (killed
# after the close); "cut": the peer is killed, the hub's close begins and, while an endpoint's
# flush is waited for, the program returns: asyncio.run cancels the close with every other task,
# and the node closes as its loop ends (the footprint after is taken after asyncio.run); "shut":
# the peer is killed, and the hub's UCX worker is shut while an endpoint's flush is waited for
ENDING = sys.argv[4]

sys.path.insert(0, sys.argv[2])
from _polling import eventually
from _procfs import listening_ports

WORKER = '''
import asyncio, json, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=json.loads(sys.argv[2])) as n:
        p = await n.connect(sys.argv[1])
        if sys.argv[3] == "warm":
            await p.recv(tag="warm")
        await p.send(np.arange(3), tag="ready")
        await asyncio.Event().wait()
asyncio.run(main())
'''


def footprint():
    with open("/proc/self/maps") as f:
        shm = sum("/dev/shm/" in line for line in f)
    return [len(listening_ports()), len(os.listdir("/proc/self/fd")), shm]


def flushing(hub):
    # an endpoint's flush before its close is in flight (Worker._flushed)
    worker = hub.transports["ucx"].worker
    return any(entry[3] == "ucx endpoint flush" for entry in getattr(worker, "_raw", {}).values())


async def pair(options):
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options) as a,
        tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options) as b,
    ):
        await a.connect(b.address)  # (what stays for the process: gRPC's threads and descriptors)
    gc.collect()
    report.setdefault("before", footprint())


async def main():
    options = json.loads(sys.argv[1])
    await pair(options)
    hub = await tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options, lease_seconds=1.0)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, hub.address, sys.argv[1], sys.argv[3]])
    try:
        peer = await hub.accept()
        if sys.argv[3] == "warm":  # a rendezvous each way first: UCX has the peer's endpoint id
            await peer.send(np.ones(4 << 20, np.uint8), tag="warm")
        await peer.recv(tag="ready")
        os.kill(worker.pid, signal.SIGSTOP)  # nothing it is sent is taken from here on
        send = asyncio.ensure_future(peer.send(np.ones(56 << 20, np.uint8), tag="big"))
        channel = peer.channel
        await eventually(lambda: bool(channel._futs) or send.done(), pause=0)  # its payload is with UCX
        report["posted"] = not send.done()
        if ENDING != "stopped":
            worker.kill()
            worker.wait()
        if ENDING == "lease":
            await asyncio.gather(send, return_exceptions=True)
        if ENDING == "shut":
            closing = asyncio.ensure_future(hub.aclose())
            await eventually(lambda: flushing(hub), pause=0.005)
            hub.transports["ucx"].worker.close()  # (as a cancelled transport close does)
            await closing
        if ENDING == "cut":
            send.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its end is not looked at)
            closing = asyncio.ensure_future(hub.aclose())
            give_up = asyncio.get_running_loop().time() + 3
            while not flushing(hub) and asyncio.get_running_loop().time() < give_up:
                await asyncio.sleep(0.005)
            report["cut"] = "flush" if flushing(hub) else "late"
            return  # (asyncio.run cancels the close, the send, and the rest)
        await hub.aclose()
        results = await asyncio.gather(send, return_exceptions=True)
        report["ops"] = [type(r).__name__ for r in results]
        del send, channel, peer, hub
    finally:
        worker.kill()
        worker.wait()
    gc.collect()
    report["after"] = footprint()


report = {}
if ENDING == "cut":  # (the footprint after a loop has ended, to be compared with the one after)
    asyncio.run(pair(json.loads(sys.argv[1])))
    gc.collect()
    report["before"] = footprint()
asyncio.run(main())
if ENDING == "cut":
    gc.collect()
    report["after"] = footprint()
print(json.dumps(report), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [{}, {"TLS": "tcp"}], ids=["default", "tcp-lanes"])
@pytest.mark.parametrize("rendezvous", ["warm", "first"])
def test_a_node_whose_peer_died_with_a_large_send_to_it_in_flight_frees_its_ucx_worker(
    options: dict[str, str], rendezvous: str
) -> None:
    """A hub's 56 MiB send is with UCX (rendezvous: it completes once the receiver has read it)
    when its receiver is SIGKILLed; the peer's lease runs out and the hub closes. Its UCX worker
    must be freed, and nothing of UCX's own printed. The payload went through ucxx's tag_send,
    whose request its endpoint keeps until it completes, and which keeps that endpoint (and so
    the worker): to a dead peer, never. Every such node kept its 2 listening sockets, 16-20
    descriptors and (shared memory) 3 /dev/shm mappings after its close.

    "first": the 56 MiB is the first rendezvous to that peer, so UCX has yet to learn the peer's
    endpoint id, which only the dead peer's answer brings. The send, the BYE posted behind it
    and the endpoint's closing flush all waited for that answer for good; ucxx's BYE request and
    close request held the endpoint and it held them, and the worker with them: [2, 29, 3]
    against [0, 13, 0] over shared memory (over tcp lanes the reset failed them all)."""
    report = _quiet_hub(_KILLED_RECEIVER_HUB, options, rendezvous, "lease")
    assert report["posted"], report
    assert report["ops"] == ["PeerDisconnected"], report  # the lease ran out before the close
    assert report["after"] == report["before"], f"(listening sockets, descriptors, /dev/shm mappings): {report}"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("options", "ending"),
    [({}, "killed"), ({}, "stopped"), ({"TLS": "tcp"}, "stopped"), ({}, "cut"), ({}, "shut")],
    ids=["default-killed", "default-stopped", "tcp-lanes-stopped", "default-cut", "default-shut"],
)
def test_a_node_closed_with_a_first_large_send_to_a_dead_or_stopped_peer_in_flight_frees_its_ucx_worker(
    options: dict[str, str], ending: str
) -> None:
    """As the test above ("first"), the node closed other ways; each must free its UCX worker.

    "killed": closed right after the peer was SIGKILLed, its lease still running; "stopped":
    closed with the peer SIGSTOPped, alive but never answering. The BYE and ucxx's close waited
    for the peer's endpoint id as after a lost lease: [2, 27, 3] listening sockets, descriptors
    and /dev/shm mappings against [0, 11, 0] over shared memory, both; [2, 25, 0] over tcp lanes
    to a stopped peer (nothing resets its connection), where a killed one's reset freed all.

    "cut": the peer killed, the node's close was cancelled (asyncio.run ending the program, the
    close under way) while it waited for an endpoint's flush. The cancelled close left ucxx's
    endpoint to its destructor, which progresses the worker until its close ends: for ever, and
    the process hung as asyncio.run shut its loop down. (Before the flush was, ucxx's close
    request and its endpoint held each other and the worker: [2, 20, 3] against [0, 4, 0].)

    "shut": the node's UCX worker shut while that flush was waited for (a transport close that
    was cancelled shuts it so). The flush's wait failed, and ucxx's close followed, on a worker
    nothing progressed any more: its request and the endpoint held each other, [2, 27, 3]."""
    report = _quiet_hub(_KILLED_RECEIVER_HUB, options, "first", ending)
    assert report["posted"], report
    assert report["after"] == report["before"], f"(listening sockets, descriptors, /dev/shm mappings): {report}"
    if ending == "cut":
        assert report["cut"] == "flush", report  # (cut while the endpoint's flush was waited for)
    else:
        assert report["ops"] == ["ClosedResourceError"], report  # (closed before the lease ran out)


def test_a_peer_process_is_gone_only_once_it_has_certainly_ended() -> None:
    """What lets a hub free a send's payload: the peer's process has ended (pid gone, or reused
    by a process started at another time, or a zombie), never while it is only stopped."""
    from tensorwire.transports.ucx._process import ProcessId, gone, me, visible

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            start = int(f.read().rsplit(b")", 1)[1].split()[19]) & 0xFFFFFFFF
        peer = ProcessId(child.pid, start, me().host)
        assert visible(peer) == peer and not gone(peer)
        assert visible(peer._replace(start=start + 1)) is None  # (not what that pid runs)
        assert gone(peer._replace(start=start + 1))  # (that pid runs another process)
        assert not gone(peer._replace(host=me().host ^ 1))  # (another machine or pid namespace)
        os.kill(child.pid, signal.SIGSTOP)
        assert not gone(peer)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # (dead, not reaped: a zombie)
        assert gone(peer)
        child.wait()
        assert gone(peer)
    finally:
        child.kill()
        child.wait()


# An echo peer for the CPU-sharing tests below, in a process of its own pinned to CPU argv[2]:
# connects a ucx node (tcp lanes: the answer needs this process to run) to argv[1], then answers
# each 8-byte "ping" with a "pong"
_ECHO = r"""
import asyncio, os, sys, numpy as np, tensorwire
os.sched_setaffinity(0, {int(sys.argv[2])})
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options={"TLS": "tcp"}) as n:
        p = await n.connect(sys.argv[1])
        buf = np.zeros(8, np.uint8)
        try:
            while True:
                await p.recv(tag="ping", out=buf)
                await p.send(buf, tag="pong")
        except tensorwire.TensorWireError:
            pass
asyncio.run(main())
"""


@contextlib.contextmanager
def _pinned(cpu: int) -> Iterator[None]:
    """This thread (the loop's) runs on ``cpu`` alone for a while."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _yields(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts this process's ``os.sched_yield`` calls (each still gives the CPU up)."""
    calls = [0]
    real = os.sched_yield

    def counted() -> None:
        calls[0] += 1
        real()

    monkeypatch.setattr(os, "sched_yield", counted)
    return calls


def _process_of(pid: int) -> Any:
    """The ProcessId of ``pid``, as its handshake would describe it."""
    from tensorwire.transports.ucx._process import ProcessId, me

    with open(f"/proc/{pid}/stat", "rb") as f:
        start = int(f.read().rsplit(b")", 1)[1].split()[19]) & 0xFFFFFFFF
    return ProcessId(pid, start, me().host)


async def _ping_pong(cpu: int, peer_cpu: int, rounds: int) -> None:
    """``rounds`` 8-byte round trips over tcp lanes with an echo process pinned to ``peer_cpu``,
    this thread pinned to ``cpu``."""
    with _pinned(cpu):
        async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options={"TLS": "tcp"}) as node:
            child = await asyncio.create_subprocess_exec(sys.executable, "-c", _ECHO, node.address, str(peer_cpu))
            try:
                async with asyncio.timeout(20):
                    peer = await node.accept()
                    x, back = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
                    for _ in range(rounds):
                        await peer.send(x, tag="ping")
                        await peer.recv(tag="pong", out=back)
                    assert np.array_equal(back, x)
                    await peer.aclose()
                    await child.wait()
            finally:
                if child.returncode is None:
                    child.kill()
                    await child.wait()


@pytest.mark.multiprocess
async def test_a_ucx_node_gives_its_cpu_up_to_a_peer_process_waiting_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes that talk over ucx pinned to one CPU: the one spinning for an answer holds
    the CPU the answer has to be computed on, and the other ran only when the spinner was
    preempted (about 4 ms every round trip, read and call). The spinning loop looks whether the
    peer's process waits for its CPU and gives the CPU up to it (it never did: 0 yields)."""
    calls = _yields(monkeypatch)
    await _ping_pong(cpu := min(os.sched_getaffinity(0)), cpu, 200)
    assert calls[0] > 0


@pytest.mark.multiprocess
async def test_a_ucx_node_keeps_its_cpu_from_a_busy_process_that_is_not_its_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same spinning loop with an unrelated busy process waiting for its CPU and the peer on
    another CPU: it never gives the CPU up (a yield to any process that wanted the CPU made each
    such call cost about 4 ms)."""
    from tensorwire.transports.ucx._process import this_cpu, waiting_on

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    code = f"import os; os.sched_setaffinity(0, {{{cpus[0]}}})\nwhile True: pass"
    busy = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    try:
        other = _process_of(busy.pid)
        with _pinned(cpus[0]):
            # (what the worker would see of it, were it a peer: it waits for this CPU)
            await eventually(lambda: waiting_on(other, this_cpu()), pause=0)
        calls = _yields(monkeypatch)
        await _ping_pong(cpus[0], cpus[1], 200)
        assert calls[0] == 0
    finally:
        busy.kill()
        await busy.wait()


# A receiver for the hub tests below, in a process of its own: connects a ucx node to argv[1] and
# sends its pid and whether it is "warm" on tag "ready"; warm, it then has a rendezvous each way
# with the hub (UCX learns the peer's endpoint id, and the endpoint's closing flush ends), else
# none ("first"). Then it receives on tag "big", printing a digest of each message, or the error
# that ended it. Here, as in the hub tests, what is sent is made (its pages touched) before the
# session: fresh memory faults in slowly on a loaded machine (4 MiB took over 0.3 s, 16 MiB
# more), long enough for a 1 s lease's renewals to go unanswered.
_RECEIVER = r"""
import asyncio, hashlib, os, sys, numpy as np, tensorwire
async def main():
    warm_payload = np.ones(4 << 20, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as n:
        p = await n.connect(sys.argv[1])
        warm = sys.argv[2] == "warm"
        await p.send(np.array([os.getpid(), warm]), tag="ready")
        if warm:
            await p.recv(tag="warm")
            await p.send(warm_payload, tag="warm")
        while True:
            try:
                x = await p.recv(tag="big")
            except Exception as exc:
                print("error", type(exc).__name__, flush=True)
                return
            print("got", hashlib.sha256(x).hexdigest(), flush=True)
asyncio.run(main())
"""


async def _receiver(hub: tensorwire.Node, rendezvous: str) -> tuple[asyncio.subprocess.Process, Any]:
    """A receiver process (see _RECEIVER) and its peer at ``hub``."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _RECEIVER, hub.address, rendezvous, stdout=subprocess.PIPE
    )
    try:
        async with asyncio.timeout(30):
            return child, await hub.accept()
    except BaseException:
        child.kill()
        await child.wait()
        raise


@functools.cache
def _warm_payload() -> np.ndarray:
    """The 4 MiB each warm receiver gets, made once, on the first test that sends it (see _RECEIVER)."""
    return np.ones(4 * MiB, np.uint8)


async def _stop_when_ready(peer: Any) -> int:
    """Stop ``peer``'s receiver (SIGSTOP) once it is ready; its pid. What it is sent from then on
    stays with UCX."""
    pid, warm = (int(v) for v in await peer.recv(tag="ready"))
    if warm:
        await peer.send(_warm_payload(), tag="warm")
        await peer.recv(tag="warm")
    os.kill(pid, signal.SIGSTOP)
    return pid


async def _send_to_stopped(peer: Any, data: np.ndarray) -> asyncio.Future[None]:
    """Send ``data`` to ``peer``, whose process is stopped; returns once UCX has its payload."""
    send = asyncio.ensure_future(peer.send(data, tag="big"))
    channel = peer.channel
    await eventually(lambda: bool(channel._futs) or send.done(), pause=0)
    assert not send.done(), send  # (with UCX: a rendezvous, which the receiver has to read)
    return send


def _held(hub: tensorwire.Node) -> tuple[int, int]:
    """The sends of closed channels whose memory the hub's UCX worker keeps, and those bytes."""
    graveyard = hub.transports["ucx"].worker._raw_graveyard  # type: ignore[attr-defined]
    kept = [keep for keep in graveyard.values() if keep is not None]
    return len(kept), sum(getattr(keep, "nbytes", 0) for keep in kept)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
async def test_a_hub_lets_go_of_sends_to_peers_killed_mid_send() -> None:
    """A long-lived hub sends 16 MiB (a rendezvous) to each of 4 peers, each SIGKILLed while
    the payload is with UCX; the peers' leases run out and the hub goes on. UCX never completes
    such a send (without peer error handling nothing fails it, and it refuses the forced close
    that would), and each payload stayed in the worker's graveyard for as long as the node
    lived: 10 of 10, 160 MiB, with 10 peers (a churn of 30 kills: 22, hub RSS 77 -> 252 MiB).
    Once a peer's process has certainly ended its payloads go, and the metrics say so. Half the
    peers had a rendezvous with the hub before (the endpoint's closing flush ends), half not (it
    never does, and the endpoint is closed raw). (4 peers, not the 10 of the first version: the
    leak took every payload, and each peer is a process, 0.4 CPU-s.)"""
    modes = ["warm", "first"] * 2
    # made before the session (see _RECEIVER): np.full of 16 MiB on the hub's loop took over
    # 0.3 s under load, and its receivers, waiting their turn, gave up on it (1 s lease)
    payloads = [np.full(16 * MiB, i, np.uint8) for i in range(len(modes))]
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=1.0) as hub:
        children = []
        try:
            pairs = await asyncio.gather(*(_receiver(hub, mode) for mode in modes))
            children = [child for child, _ in pairs]
            sends = []
            for _, peer in pairs:
                pid = await _stop_when_ready(peer)
                sends.append(await _send_to_stopped(peer, payloads[len(sends)]))
                os.kill(pid, signal.SIGKILL)
            results = await asyncio.gather(*sends, return_exceptions=True)
            assert all(isinstance(r, PeerDisconnected) for r in results), results  # (their leases ran out)
            for child in children:
                await child.wait()
            # each goes once its peer is known gone: two sweeps (a second apart) after its close
            await eventually(lambda: _held(hub) == (0, 0), seconds=15, pause=0.1)
            assert hub.transports["ucx"].worker.released[0] >= len(modes)  # type: ignore[attr-defined]
            assert tensorwire.metrics.snapshot().stranded["ucx"] == (0, 0)
            async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as other:  # (the hub serves on)
                p = await other.connect(hub.address)
                q = await hub.accept()
                await p.send(np.arange(4), tag="x")
                assert np.array_equal(await q.recv(tag="x"), np.arange(4))
        finally:
            for child in children:
                if child.returncode is None:
                    child.kill()
                    await child.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_hub_keeps_a_send_to_a_stopped_peer_until_it_reads_it(caplog: pytest.LogCaptureFixture) -> None:
    """The peer of a hub's 16 MiB send is stopped (SIGSTOP) while the payload is with UCX, its
    lease runs out and the hub closes its channel. It may only be slow: when it runs again it
    reads the payload (over cma, from the hub's memory, without asking the hub) and delivers it
    as a good message (in half the runs here). So the hub keeps that memory, sweep after
    sweep, warning of it, though nothing else holds it, while it fills fresh memory of its own;
    then the peer runs again (SIGCONT). It receives the message whole or fails, never other
    bytes; having read it, UCX completes the send and the memory goes. (Taking a peer whose
    lease ran out for dead, the sweep let the payload go before the peer ran again.)"""
    caplog.set_level(logging.WARNING, logger="tensorwire.transports.ucx._worker")
    data = ((np.arange(16 * MiB, dtype=np.uint64) * 2654435761) >> 13).astype(np.uint8)
    digest = hashlib.sha256(data).hexdigest()
    async with (
        tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=1.0) as hub,
        tensorwire.start("127.0.0.1:0", transports=("ucx",)) as other,
    ):
        # a peer that stays: the hub's lease watch holds the last peer it looked at, and moves on
        await other.connect(hub.address)
        await hub.accept()
        child, peer = await _receiver(hub, "warm")
        try:
            pid = await _stop_when_ready(peer)
            send = await _send_to_stopped(peer, data)
            payload = weakref.ref(data)
            del data
            (result,) = await asyncio.gather(send, return_exceptions=True)
            assert isinstance(result, PeerDisconnected), result  # (its lease ran out)
            del send, result, peer  # (the failure's traceback holds the send's frames, and the array)
            await eventually(lambda: "never completed by UCX" in caplog.text, seconds=10, pause=0.1)
            gc.collect()
            assert payload() is not None, "the payload was let go while its peer still ran"
            assert _held(hub) == (1, 16 * MiB)
            assert tensorwire.metrics.snapshot().stranded["ucx"] == (1, 16 * MiB)
            fresh = [np.full(16 * MiB, 0xEE, np.uint8) for _ in range(8)]  # (memory let go would be reused)
            os.kill(pid, signal.SIGCONT)
            assert child.stdout is not None
            async with asyncio.timeout(20):
                said = (await child.stdout.readline()).decode().split()
            del fresh
            print("the receiver, run again:", *said)
            assert said == ["got", digest] or said[:1] == ["error"], said  # (never other bytes)
            if said[0] == "got":  # (UCX completed the send: its memory goes)
                await eventually(lambda: _held(hub) == (0, 0), seconds=10, pause=0.05)
        finally:
            if child.returncode is None:
                child.kill()
            await child.wait()


# A hub whose receiver is SIGKILLed once it has posted a recv (its grant with the hub), then sent
# 56 MiB (eager: see _KILLED_RECEIVER_HUB), in a process of its own (UCX prints on that process's
# stdout). argv: the hub's UCX options (JSON), the tests folder, "engine" (HostEngine device
# memory, staged) or "host".
# Prints one JSON line: what became of the send, and the peer segments found missing.
_DEAD_RECEIVER_HUB = r"""
import asyncio, json, subprocess, sys
import numpy as np
import tensorwire
from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray
from tensorwire.transports.ucx import _ucp

WORKER = '''
import asyncio, json, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=json.loads(sys.argv[2])) as n:
        p = await n.connect(sys.argv[1])
        recv = asyncio.ensure_future(p.recv(tag="big"))
        await asyncio.sleep(0)  # (the recv is posted)
        await p.send(np.arange(3), tag="ready")
        await recv
asyncio.run(main())
'''


async def main():
    engine = HostEngine()
    engine.pool("out").configure(1 << 20, 3)
    report = {}
    options = json.loads(sys.argv[1])
    # (a lease far longer than the send may take: a PeerDisconnected is the send's own)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), ucx_options=options, lease_seconds=60) as hub:
        worker = subprocess.Popen([sys.executable, "-c", WORKER, hub.address, sys.argv[1]])
        try:
            peer = await hub.accept()
            await peer.recv(tag="ready")
        finally:
            worker.kill()
            worker.wait()
        data = np.full(56 << 20, 3, np.uint8)
        try:
            async with asyncio.timeout(20):
                await peer.send(EngineArray(engine, data) if sys.argv[3] == "engine" else data, tag="big")
            report["send"] = ["done", ""]
        except Exception as exc:
            report["send"] = [type(exc).__name__, str(exc)]
    engine.close()
    report["missing_segments"] = _ucp.peer_segment_attach_failures
    print(json.dumps(report), flush=True)


asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("options", "memory"),
    [({}, "engine"), ({}, "host"), ({"TLS": "posix,self"}, "engine")],
    ids=["default-engine", "default-host", "posix-engine"],
)
def test_a_send_to_a_receiver_that_was_killed_is_peer_disconnected_not_a_shared_memory_error(
    options: dict[str, str], memory: str
) -> None:
    """A send to a receiver SIGKILLed after it posted its recv (the hub holds its grant) makes
    UCX attach a segment of the receiver's, which went with its process. The send raised
    TransferError 'ucp_tag_send_nbx failed: Shared memory error (-17)' (staged device memory;
    host memory: 'ucx payload send failed: ...', the request's status), and UCX printed
    'mm_sysv.c:61 UCX ERROR shmat(shmid=...) failed: Invalid argument' (posix lanes:
    'mm_posix.c UCX ERROR open(file_name=/proc/<pid>/fd/<fd> flags=0x0) failed: No such file or
    directory'). It is PeerDisconnected, and the line goes to tensorwire's log."""
    report = _quiet_hub(_DEAD_RECEIVER_HUB, options, memory)
    kind, message = report["send"]
    assert kind == "PeerDisconnected", report
    assert "shared memory is gone" in message, report
    assert report["missing_segments"] == 1, report


def test_only_a_peers_missing_segment_makes_a_shared_memory_error_a_disconnect(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """UCX returns UCS_ERR_SHMEM_SEGMENT both where attaching a peer's segment failed and where
    creating one of its own did; only the line it logs tells them apart. Its lines from UCX
    1.21's sites, dispatched to the log handlers as UCX dispatches them: the attach failures
    are taken (each makes one such error a PeerDisconnected), the creation failure is UCX's."""
    ucp = _ucp.load()
    path = _ucp.loaded_library("libucs.so")
    assert path is not None
    dispatch = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).ucs_log_dispatch
    fields = [("log_level", ctypes.c_int), ("name", ctypes.c_char * 16), ("file_filter", ctypes.c_char_p)]
    component = type("ucs_log_component_config_t", (ctypes.Structure,), {"_fields_": fields})(1, b"UCX", b"*")

    def log_error(file: bytes, function: bytes, fmt: bytes, *args: object) -> None:
        dispatch(b"/ucx/src/uct/sm/mm/" + file, 61, function, 1, ctypes.byref(component), fmt, *args)

    def shm_error() -> Exception:
        return ucp.error(-17, "ucp_tag_send_nbx")  # UCS_ERR_SHMEM_SEGMENT

    shm_error()  # (takes any line an earlier test left)
    opened = (b"%s(file_name=%s flags=0x%x) failed: %m", b"open")
    log_error(b"posix/mm_posix.c", b"uct_posix_open_check_result", *opened, b"/dev/shm/ucx_shm_posix_1f", 0xC2)
    assert type(shm_error()) is TransferError  # creating our own
    log_error(b"sysv/mm_sysv.c", b"uct_sysv_mem_attach_common", b"shmat(shmid=%d) failed: %m", 4321)
    error = shm_error()
    assert type(error) is PeerDisconnected, error
    assert "shared memory is gone" in str(error), error
    assert type(shm_error()) is TransferError  # (that line was taken)
    log_error(b"posix/mm_posix.c", b"uct_posix_open_check_result", *opened, b"/proc/4321/fd/15", 0)
    assert type(shm_error()) is PeerDisconnected
    printed = capfd.readouterr().out
    assert "UCX  ERROR open(file_name=/dev/shm/ucx_shm_posix_1f flags=0xc2) failed" in printed, printed
    assert "shmat" not in printed, printed
    assert "/proc/4321" not in printed, printed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shmat(shmid=4321) failed" in m for m in warned), warned
    assert any("open(file_name=/proc/4321/fd/15 flags=0x0) failed" in m for m in warned), warned


@pytest.mark.usefixtures("grpc_kept")
async def test_a_cancelled_send_the_program_keeps_does_not_keep_closed_nodes_ucx_workers() -> None:
    """A send cancelled while UCX moves its payload finishes first, then raises CancelledError;
    a program may keep that error (or a task's, a retry loop's last one). Its traceback held the
    payload's requests, each of which holds the node's UCX worker: every closed pair kept the
    sending node's 2 listening sockets, 11 descriptors and 3 shared-memory mappings."""
    kept: list[BaseException] = []

    async def pair_with_a_cancelled_send() -> None:
        async with (
            tensorwire.start("127.0.0.1:0", transports=("ucx",)) as a,
            tensorwire.start("127.0.0.1:0", transports=("ucx",)) as b,
        ):
            peer = await a.connect(b.address)
            await b.accept()  # (the message lands there, never received)
            # (56 MiB: eager, its payload with UCX at once; see _KILLED_RECEIVER_HUB)
            send = asyncio.ensure_future(peer.send(np.ones(56 * MiB, np.uint8), tag="x"))
            channel: Any = peer.channel
            await eventually(lambda: bool(channel._futs), pause=0)  # its payload is with UCX
            send.cancel()
            try:
                await send
            except asyncio.CancelledError as exc:
                kept.append(exc)

    await pair_with_a_cancelled_send()  # (the first also starts what stays for the process)
    gc.collect()
    first = _ucx_footprint()
    for _ in range(2):
        await pair_with_a_cancelled_send()
    gc.collect()
    assert len(kept) == 3, kept
    assert _ucx_footprint() == first, "(listening sockets, descriptors, /dev/shm mappings) after 1 and 3 pairs"


async def test_each_send_failed_by_a_ucx_channels_end_gets_a_failure_of_its_own() -> None:
    """Two sends wait for their receiver's go-ahead when the peer aborts; each fails with a
    PeerDisconnected of its own (``transports._base.fresh``). The channel's shutdown handed its
    one exception to both, so a caller that kept its send's failure (to log it, say) kept the
    other send's frames with it, through the traceback the other raise gave that object, and so
    the other send's 64 MiB array after its caller had let go of it."""
    # (recv_buffer_bytes=0: a send waits for its receiver's go-ahead, before UCX holds any of it;
    # a payload UCX was given is kept until UCX is done with it, see Worker.sweep)
    async with connected_pair("ucx", limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
        mine = asyncio.ensure_future(a.send(np.ones(64 * MiB, np.uint8), tag="mine"))
        x = np.ones(64 * MiB, np.uint8)
        gone = weakref.ref(x)
        theirs = asyncio.ensure_future(a.send(x, tag="theirs"))
        for _ in range(3):  # (they start: their frames hold their arrays)
            await asyncio.sleep(0)
        b.abort()
        await eventually(lambda: a.channel.state is not ChannelState.OPEN)
        errors = []
        for send in (mine, theirs):
            with pytest.raises(tensorwire.PeerDisconnected) as caught:
                await send
            errors.append(caught.value)
        kept = errors[0]  # the first caller keeps its failure
        assert kept is not errors[1], "both sends failed with one exception object"
        del x, theirs, send, caught, errors

        await collected(gone)
        assert isinstance(kept, tensorwire.PeerDisconnected)


_STOPPING_SENDER = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    # made before the session, as _STOPPING_EAGER_SENDER's: its pages, first touched on the loop
    # after "go", kept it from answering its receiver's renewals for 3 s on a loaded machine
    x = np.ones(256 << 20, np.uint8)
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}) as n:
        print(n.address, flush=True)
        p = await n.accept()
        await p.recv(tag="go")
        await p.send(x, tag="big")
        await asyncio.sleep(30)
asyncio.run(main())
"""


@pytest.mark.multiprocess
async def test_a_recv_cancelled_while_a_stopped_sender_holds_its_payload_says_its_out_may_still_be_written() -> None:
    """Over UCX's tcp lanes the sender of a 256 MiB message is frozen (SIGSTOP) while its
    payload lands in the recv's out=; UCX cannot take back a receive that has matched. The recv,
    under a 0.5 s deadline, ends only once the lease declares the sender dead and the landing
    grace has passed, and UCX may still write into out= then. It raised a plain TimeoutError
    (the failure that said so went to a log line only), as if out= were the caller's again; now
    it raises that failure."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _STOPPING_SENDER, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    try:
        async with asyncio.timeout(15):
            address = (await child.stdout.readline()).decode().strip()
        out = np.full(256 << 20, 0, np.uint8)  # its pages touched before the session (as the sender's)
        async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}, lease_seconds=1.5) as node:
            peer = await node.connect(address)
            await peer.send(None, tag="go")
            recv = asyncio.ensure_future(peer.recv(tag="big", out=out))
            await eventually(lambda: out[0] == 1 or recv.done(), pause=0)  # the payload is landing
            os.kill(child.pid, signal.SIGSTOP)
            assert not recv.done(), recv  # (256 MiB over tcp lanes: 0.1 s or more here)
            with pytest.raises(PeerDisconnected, match="may still be written"):
                async with asyncio.timeout(0.5):
                    await recv
    finally:
        await end_child(child)


@pytest.mark.multiprocess
async def test_a_send_cancelled_while_a_stopped_receiver_holds_its_payload_says_it_may_still_be_read() -> None:
    """A 16 MiB send (within the receiver's credit: its payload goes to UCX at once) to a
    receiver frozen (SIGSTOP), under a 0.3 s deadline: UCX cannot take the send back, so it ends
    only when the lease declares the receiver dead, and the receiver, if it only stopped, may
    still read the payload from the sender's memory when it runs again (docs/ucx.md, "Sends to
    a peer that died"). It raised a plain TimeoutError then, as if the tensor were the caller's
    to change again; now the failure says that the peer may still read it."""
    payload = np.ones(16 * MiB, np.uint8)  # (made before the 0.3 s: fresh pages are slow under load)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=1.0) as hub:
        child, peer = await _receiver(hub, "warm")
        try:
            await _stop_when_ready(peer)
            with pytest.raises(PeerDisconnected, match="may still read"):
                async with asyncio.timeout(0.3):
                    await peer.send(payload, tag="big")
        finally:
            await end_child(child)


_FROZEN_RENDEZVOUS_SENDER = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}, lease_seconds=30) as n:
        print(n.address, flush=True)
        p = await n.accept()
        # (its receiver grants no credit: rendezvous)
        await p.send((np.arange(1 << 20, dtype=np.uint32), np.full(1 << 16, 7, np.uint8)), tag="big")
        await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)  # (the old code's recv ended at the 30 s lease)
@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
async def test_a_recv_whose_sender_froze_before_its_payload_moved_ends_at_its_deadline(
    bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rendezvous message's header is here and its sender is frozen (SIGSTOP) before it got the
    CTS: the recv posts its payload receives, which nothing matches, and sends its CTS. Under a
    1.5 s deadline that recv waited for the whole 30 s lease (a cancel waited for UCX to land a
    payload that had not begun to move), then raised TimeoutError. A receive that has not matched
    can be taken back: the recv ends near its deadline, out= untouched, and the message stays
    queued; once the sender runs again a later recv gets it whole (no second CTS: the first
    one's payload is what it receives)."""
    from test_ucx import without_libucp

    if bindings == "ucxx":  # the payload receives through ucxx
        without_libucp(monkeypatch)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FROZEN_RENDEZVOUS_SENDER, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    limits = tensorwire.Limits(recv_buffer_bytes=0)  # every message waits for its recv (rendezvous)
    try:
        async with asyncio.timeout(15):
            address = (await child.stdout.readline()).decode().strip()
        async with tensorwire.start(
            transports=("ucx",), ucx_options={"TLS": "tcp"}, lease_seconds=30, limits=limits
        ) as node:
            peer = await node.connect(address)
            assert (peer.channel._ucp is None) == (bindings == "ucxx")  # type: ignore[attr-defined]
            mailbox = peer.channel.mailbox  # type: ignore[attr-defined]
            await eventually(lambda: mailbox.oldest(tag_id("big")) is not None, 10)  # its header came
            os.kill(child.pid, signal.SIGSTOP)
            out = (np.zeros(1 << 20, np.uint32), np.zeros(1 << 16, np.uint8))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    await peer.recv(tag="big", out=out)
            took = loop.time() - t0
            assert took < 10, f"a 1.5 s deadline ended the recv after {took:.1f} s"
            assert not any(o.any() for o in out)  # nothing landed in it
            os.kill(child.pid, signal.SIGCONT)
            again = (np.zeros(1 << 20, np.uint32), np.zeros(1 << 16, np.uint8))
            async with asyncio.timeout(10):
                got, receipt = await peer.recv_with_receipt(tag="big", out=again)
            assert got is again
            np.testing.assert_array_equal(again[0], np.arange(1 << 20, dtype=np.uint32))
            assert (again[1] == 7).all()
            assert not any(o.any() for o in out)  # the message went to its second recv's out=, not the first's
            assert receipt.protocol == "rendezvous" and receipt.direct, receipt
    finally:
        await end_child(child)


@pytest.mark.multiprocess
@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
async def test_a_send_cancelled_while_its_channel_closes_says_its_stopped_receiver_may_still_read_it(
    bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB send to a stopped receiver (SIGSTOP) is with UCX when its channel begins to close
    (aclose waits BYE_GRACE for the sends UCX has taken), and the send is cancelled then. UCX
    cannot take a send back: the send ends when the close has shut the channel, with the error
    that says the peer may still read its tensor. Through ucxx (no libucp bindings) the cancel was
    raised at once, bare, while UCX still held the payload (and the close no longer waited for it)."""
    from test_ucx import without_libucp

    if bindings == "ucxx":  # the payload sends through ucxx
        without_libucp(monkeypatch)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=30) as hub:
        child, peer = await _receiver(hub, "warm")
        try:
            channel = peer.channel
            assert (channel._ucp is None) == (bindings == "ucxx")
            await _stop_when_ready(peer)
            send = await _send_to_stopped(peer, np.ones(16 * MiB, np.uint8))
            closing = asyncio.ensure_future(channel.aclose())
            await eventually(lambda: channel.state is ChannelState.CLOSING, pause=0)
            send.cancel()
            (result,) = await asyncio.gather(send, return_exceptions=True)
            assert channel.state is not ChannelState.CLOSING, "the send ended before its channel's close shut it"
            assert isinstance(result, tensorwire.TensorWireError), repr(result)
            assert "may still read" in str(result), result
            await closing
        finally:
            await end_child(child)


_STOPPING_EAGER_SENDER = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    # made before the session: its pages, first touched on the loop, took 3-7 s on a loaded
    # machine here, and the 1.5 s lease of its receiver ran out meanwhile (nothing landed)
    x = np.ones(256 << 20, np.uint8)
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}) as n:
        print(n.address, flush=True)
        p = await n.accept()
        await p.recv(tag="go")
        await p.send(x, tag="big")  # (within its receiver's credit: eager)
        await asyncio.sleep(30)
asyncio.run(main())
"""


@pytest.mark.multiprocess
async def test_a_recv_cancelled_as_its_message_matched_while_a_stopped_sender_holds_it_says_out_may_be_written() -> (
    None
):
    """A 256 MiB eager message matches a waiting recv(out=), whose payload the control handler
    receives straight into that out=; the recv is cancelled before its task ran, and its sender
    is frozen (SIGSTOP) while the payload lands. The cancel waits for UCX's write, which ends
    only once the lease declares the sender dead and the landing grace has passed, and UCX may
    still write into out= then. The recv raised a plain CancelledError (the failure that said so
    went to a log line only), as if out= were the caller's again; now it raises that failure, as
    a recv cancelled once its task ran does."""
    # the sender is frozen once the payload has begun to land; on a loaded machine all 256 MiB
    # may land before the test's loop gets to freeze it (UCX's worker moves it meanwhile), and
    # then there is nothing in flight to test: such a try is made again, up to three times
    for _ in range(3):
        if await _cancel_a_matched_recv_and_stop_its_sender():
            return
    pytest.fail("each of three 256 MiB payloads landed whole before its sender could be stopped")


async def _cancel_a_matched_recv_and_stop_its_sender() -> bool:
    """One try of the test above: False where the payload landed whole before the freeze."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STOPPING_EAGER_SENDER, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    limits = tensorwire.Limits(recv_buffer_bytes=1 << 30)  # (256 MiB goes eager)
    tag = tag_id("big")
    out = np.full(256 << 20, 0, np.uint8)  # its pages touched before the session (as the sender's)
    try:
        async with asyncio.timeout(15):
            address = (await child.stdout.readline()).decode().strip()
        async with tensorwire.start(
            transports=("ucx",), ucx_options={"TLS": "tcp"}, lease_seconds=1.5, limits=limits
        ) as node:
            peer = await node.connect(address)
            mailbox = peer.channel.mailbox  # type: ignore[attr-defined]
            # as when its payload receive has matched at the cancel (UCX's rendezvous request
            # came with the header, or before): whether it has is a matter of timing here, and
            # one that has not is taken back (see the next test)
            peer.channel.take_back = lambda arrival: False  # type: ignore[attr-defined]
            recv = asyncio.ensure_future(peer.recv(tag="big", out=out))
            await eventually(lambda: mailbox.has_posted(tag), 10, pause=0)
            await peer.send(None, tag="go")
            async with asyncio.timeout(10):
                while mailbox.has_posted(tag):  # noqa: ASYNC110 - matched: its task has yet to run
                    await asyncio.sleep(0)
            recv.cancel()
            await eventually(lambda: out[0] == 1 or recv.done(), 10, pause=0)  # the payload is landing
            os.kill(child.pid, signal.SIGSTOP)
            if recv.done() and out[-1] == 1:
                return False  # it all landed first (a plain cancel then: out= holds the message)
            assert not recv.done() and not out[-1], recv  # (256 MiB over tcp lanes: 0.1 s or more here)
            async with asyncio.timeout(15):
                (result,) = await asyncio.gather(recv, return_exceptions=True)
            assert isinstance(result, PeerDisconnected), repr(result)
            assert "may still be written" in str(result), result
            return True
    finally:
        await end_child(child)


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_a_recv_cancelled_as_its_message_matched_before_its_payload_moved_ends_at_once(tls: str) -> None:
    """An eager message matches a waiting recv(out=), whose payload receive the control handler
    posts straight into that out=; its sender has not sent the payload yet (held here, as a
    stopped process holds it), and the recv is cancelled before its task ran. The cancel waited
    for that payload to land (a stopped sender: its whole lease). A receive that has not matched
    can be taken back: the cancel ends at once, out= untouched, and the message, once its payload
    comes, goes to the next recv whole."""
    src = (np.arange(1 * MiB) % 251 + 1).astype(np.uint8)  # (past the inline size: eager)
    tag = tag_id("t")
    async with connected_pair("ucx", ucx_options={"TLS": tls}) as (a, b):
        gate = asyncio.Event()
        send_payload = a.channel._send_payload

        async def held(*args: Any) -> Any:
            await gate.wait()  # the sender's payload waits here, its header gone
            return await send_payload(*args)

        a.channel._send_payload = held
        mailbox = b.channel.mailbox
        out = np.zeros_like(src)
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        while not mailbox.has_posted(tag):  # noqa: ASYNC110 - the posted recv is the point
            await asyncio.sleep(0)
        send = asyncio.ensure_future(a.send(src, tag="t"))
        while mailbox.has_posted(tag):  # noqa: ASYNC110 - matched: its task has yet to run
            await asyncio.sleep(0)
        recv.cancel()
        done, _ = await asyncio.wait([recv], timeout=5)
        gate.set()
        assert done, "the cancelled recv waited for a payload that had not begun to move"
        (first,) = await asyncio.gather(recv, return_exceptions=True)
        assert isinstance(first, asyncio.CancelledError), repr(first)
        assert not out.any()
        await asyncio.wait_for(send, 5)
        again = np.zeros_like(src)
        got = await asyncio.wait_for(b.recv(tag="t", out=again), 5)
        assert got is again and np.array_equal(again, src)
        assert not out.any()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_send_through_ucxx_whose_channel_shut_between_two_segments_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A two-tensor send through ucxx (no libucp bindings) to a stopped receiver (SIGSTOP): its
    first, small segment has gone, and the channel is aborted before the send waits for the
    second, 8 MiB one, which UCX holds for the stopped peer. The libucp path looks at the
    channel before each wait and raises its failure; through ucxx the send registered a wait
    for a request the shutdown had already let go of, and hung until the node closed. Now it
    ends at once with the channel's failure, saying that the peer may still read the payload."""
    from test_ucx import without_libucp

    without_libucp(monkeypatch)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=30) as hub:
        child, peer = await _receiver(hub, "warm")
        try:
            channel = peer.channel
            assert channel._ucp is None
            await _stop_when_ready(peer)
            gate = asyncio.Event()
            at_second = asyncio.Event()
            wait = channel._wait
            calls = 0

            async def gated(req: Any, keep: object, what: str) -> bool:
                nonlocal calls
                calls += 1
                cancelled = await wait(req, keep, what)
                if calls == 1:  # between the two segments: the first one's wait has ended
                    at_second.set()
                    await gate.wait()
                return cancelled

            channel._wait = gated
            send = asyncio.ensure_future(peer.send((np.ones(4 * KiB, np.uint8), np.ones(8 * MiB, np.uint8)), tag="big"))
            async with asyncio.timeout(10):
                await at_second.wait()
            channel.abort()
            gate.set()
            done, _ = await asyncio.wait([send], timeout=5)
            if not done:  # (let the send go, and the hub close: nothing else ends that wait)
                for fut in channel._futs:
                    fut.cancel()
            assert done, "the send waited on a request its channel's shutdown had let go of"
            (result,) = await asyncio.gather(send, return_exceptions=True)
            assert isinstance(result, tensorwire.TensorWireError), repr(result)
            assert "may still read" in str(result), result
        finally:
            await end_child(child)


def _discard_receives(channel: Any) -> int:
    """The scratch receives of messages ``channel`` dropped unread (``discard``) still posted."""
    worker = channel._w
    return sum(1 for w in worker._watch.values() if getattr(w.callback, "func", None) == channel._discarded)


async def test_a_message_taken_back_then_dropped_unread_then_aborted_leaves_no_receive_posted() -> None:
    """A rendezvous message is pulled (its payload receives posted, its CTS sent) and its recv
    cancelled at once: the receives are taken back (``take_back``), the message unread again. It
    is then dropped unread (``discard``: no memory for it), which posts a receive of one byte of
    scratch per tensor for the payload the CTS asked for, and its sender, cancelled as that CTS
    came, sends ABORT instead of the payload. The ABORT cancels the scratch receives of a
    message discarded before its CTS went, but these were recorded only when ``discard`` sent
    the CTS itself: they stayed posted, with their watches, until the channel closed."""
    from tensorwire.transports._frames import FrameType, unpack_fields

    src = (np.ones(64 * KiB, np.uint8), np.full(128 * KiB, 2, np.uint8))
    limits = tensorwire.Limits(recv_buffer_bytes=0)  # every message waits for its recv (rendezvous)
    tag = tag_id("t")
    async with connected_pair("ucx", limits=limits) as (a, b):
        mailbox = b.channel.mailbox
        out = tuple(np.zeros_like(s) for s in src)
        send = asyncio.ensure_future(a.send(src, tag="t"))
        await eventually(lambda: mailbox.oldest(tag) is not None, pause=0)  # its header came
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        dropped: list[bool] = []
        handle, send_frame = a.channel._handle_frame, a.channel._send_frame

        def on_frame(length: int | None = None) -> None:
            cts = unpack_fields(a.channel._ctrl_mv)[0] is FrameType.CTS
            if cts:
                recv.cancel()  # (its task runs first: it takes its receives back)
            handle(length)
            if cts:
                send.cancel()  # (as the CTS came: the send sends ABORT, not its payload)

        def on_send(frame: Any) -> bool:
            if unpack_fields(memoryview(frame))[0] is FrameType.ABORT and not dropped:
                # the recv was cancelled, its message unread again: no memory for it here
                dropped.append(b.channel.discard(mailbox.oldest(tag)))
            return send_frame(frame)

        a.channel._handle_frame = on_frame
        a.channel._send_frame = on_send
        for op in (recv, send):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(op, 5)
        assert dropped == [True]
        assert not any(o.any() for o in out)
        await eventually(lambda: _discard_receives(b.channel) == 0, 5)
        assert not b.channel._discarding


async def _a_send_taken_back_after_its_cts(
    tls: str,
    bindings: str,
    monkeypatch: pytest.MonkeyPatch,
    end: Callable[[Any, Any], Awaitable[None] | None],
    then: Callable[[Any], Awaitable[None]] | None = None,
) -> None:
    """A send whose receiver took back its 8 MiB message after the CTS went (its recv cancelled
    before the payload came, the payload then handed to UCX), then ended (``end(nb, b)``: the
    receiver's node and peer) and lived on: the send must return its receipt, the sender's
    worker keep nothing of it; ``then(b)`` checks more while both nodes are still up."""
    from test_ucx import without_libucp

    if bindings == "ucxx":  # (the payload's send and receives through ucxx)
        without_libucp(monkeypatch)
    src = np.ones(8 * MiB, np.uint8)
    options: dict[str, Any] = {
        "transports": ("ucx",),
        "limits": tensorwire.Limits(recv_buffer_bytes=0),  # (every message waits for its recv's CTS)
        "lease_seconds": 30.0,
        "ucx_options": {"TLS": tls},
    }
    async with (
        tensorwire.start("127.0.0.1:0", **options) as na,
        tensorwire.start("127.0.0.1:0", **options) as nb,
    ):
        a = await na.connect(nb.address)
        b = await nb.accept()
        gate = asyncio.Event()
        send_payload = a.channel._send_payload

        async def held(*args: Any) -> Any:
            await gate.wait()  # the payload waits here, the CTS come
            return await send_payload(*args)

        a.channel._send_payload = held
        recv = asyncio.ensure_future(b.recv(tag="t", out=np.zeros_like(src)))
        await eventually(lambda: b.channel.mailbox.has_posted(tag_id("t")), pause=0)
        send = asyncio.ensure_future(a.send(src, tag="t"))
        await eventually(lambda: bool(b.channel._incoming), pause=0)  # pulled: its CTS went
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(recv, 5)
        ((arrival, needs_cts),) = b.channel._waiting.values()  # taken back, unread
        assert arrival.go_ahead and not needs_cts
        gate.set()
        await eventually(lambda: bool(a.channel._futs), pause=0)  # the payload is with UCX
        ending = end(nb, b)
        if ending is not None:
            await ending
        (result,) = await asyncio.gather(asyncio.wait_for(send, 10), return_exceptions=True)  # (a lease is 30 s)
        assert isinstance(result, tensorwire.Receipt), repr(result)
        assert result.nbytes == src.nbytes
        assert _held(na) == (0, 0)
        if then is not None:
            await then(b)


@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
@pytest.mark.parametrize("closer", ["peer", "node"])
@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_a_send_taken_back_after_its_cts_ends_at_once_when_its_receiver_closes(
    tls: str, closer: str, bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rendezvous message is pulled (its CTS sent) and its recv cancelled before its sender's
    payload came (held here, as a slow sender holds it): the receives are taken back, and the
    payload the sender then hands to UCX waits in the receiver's UCX for a receive. The receiver
    closes (its peer, or its node) and lives on. Its close posted no receive for that payload,
    so the send ended only when its own channel shut a second after the BYE (``BYE_GRACE``),
    with PeerDisconnected saying the receiver "may still read" the tensor, and the sender's
    worker kept those 8 MiB, warning that UCX never completed the send, until its node closed.
    Now the close receives the message into scratch (``_drop_unread``) and the send returns its
    receipt, as one whose message was buffered there and dropped unread: its memory is the
    caller's again, nothing of it kept."""
    await _a_send_taken_back_after_its_cts(
        tls, bindings, monkeypatch, lambda nb, b: b.aclose() if closer == "peer" else nb.aclose()
    )


@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
@pytest.mark.parametrize("aborter", ["peer", "node", "failure"])
@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_a_send_taken_back_after_its_cts_ends_at_once_when_its_receiver_aborts(
    tls: str, aborter: str, bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``test_a_send_taken_back_after_its_cts_ends_at_once_when_its_receiver_closes``, but
    the receiver aborts (its peer or its node) or its channel fails (a lost lease), and lives
    on. Only a graceful close received the unread payload into scratch: the send ended a second
    after the BYE (``BYE_GRACE``) with PeerDisconnected saying the receiver "may still read"
    the tensor, and the sender's worker kept those 8 MiB until its node closed. Now the abort
    drops it unread too (``_drop_unread``), and its endpoint's close waits for those receives
    (over shared memory the RTS came after the endpoint had gone, and UCX cancelled the receive
    without answering the sender): the send returns its receipt, nothing of it kept."""

    def end(nb: Any, b: Any) -> None:
        if aborter == "peer":
            b.abort()
        elif aborter == "node":
            nb.abort()
        else:
            b.channel.fail(PeerDisconnected("lease lost"))

    async def none_left_posted(b: Any) -> None:
        await eventually(lambda: _discard_receives(b.channel) == 0, 5)

    await _a_send_taken_back_after_its_cts(tls, bindings, monkeypatch, end, none_left_posted)


def _hold_after_first_segment(peer: Any) -> asyncio.Event:
    """``peer``'s payload sends send their first segment, then wait for the event returned
    before the rest (as a process stopped between two tensors)."""
    gate = asyncio.Event()
    send_payload = peer.channel._send_payload

    async def held(msg_id: int, segs: list[Any]) -> Any:
        await send_payload(msg_id, segs[:1])
        await gate.wait()  # the second segment waits here, the first one sent
        return await send_payload(msg_id, segs[1:])

    peer.channel._send_payload = held
    return gate


@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
@pytest.mark.parametrize("credit", [None, 0], ids=["eager", "rendezvous"])
async def test_a_recv_cancelled_after_its_first_tensor_landed_before_the_rest_moved_ends_at_once(
    tls: str, credit: int | None, bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-tensor message: its first tensor has landed in the recv's out=, and its sender holds
    the second back (a gate between its segments, as a process stopped between them, or whose
    UCX still queues the later sends, holds them), when the recv is cancelled. The second
    tensor's receive has not matched, but the first's has completed, so nothing was taken back:
    the cancel waited for the second payload (a stopped sender: its whole lease). Now the later
    receives are taken back, what landed is copied to a buffer of ours, the rest is received
    there, and the cancel ends at once: out= is not written after it, and once the sender goes
    on the next recv gets the message whole."""
    from test_ucx import without_libucp

    if bindings == "ucxx":  # the payload receives through ucxx
        without_libucp(monkeypatch)
    src = (np.arange(1 * MiB, dtype=np.uint8) | 1, np.full(1 * MiB, 7, np.uint8))  # (past the inline size)
    limits = None if credit is None else tensorwire.Limits(recv_buffer_bytes=credit)
    async with connected_pair("ucx", ucx_options={"TLS": tls}, limits=limits) as (a, b):
        assert (b.channel._ucp is None) == (bindings == "ucxx")
        gate = _hold_after_first_segment(a)
        out = tuple(np.zeros_like(s) for s in src)
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        send = asyncio.ensure_future(a.send(src, tag="t"))
        try:
            await eventually(lambda: bool(out[0][-1]) or recv.done(), 10, pause=0)  # the first one landed
            assert not recv.done(), recv
            recv.cancel()
            done, _ = await asyncio.wait([recv], timeout=5)
        finally:
            gate.set()
        assert done, "the cancelled recv waited for a tensor whose payload had not begun to move"
        (first,) = await asyncio.gather(recv, return_exceptions=True)
        assert isinstance(first, asyncio.CancelledError), repr(first)
        await asyncio.wait_for(send, 5)
        again = tuple(np.zeros_like(s) for s in src)
        got = await asyncio.wait_for(b.recv(tag="t", out=again), 5)
        assert got is again
        for g, s in zip(again, src, strict=True):
            np.testing.assert_array_equal(g, s)
        assert not out[1].any()  # the rest went to the next recv, not into the cancelled one's out=


@pytest.mark.parametrize("bindings", ["libucp", "ucxx"])
@pytest.mark.parametrize("credit", [None, 0], ids=["eager", "rendezvous"])
async def test_a_recv_cancelled_after_its_first_tensor_landed_copies_what_landed_off_the_loop(
    credit: int | None, bindings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with a large first tensor: the cancel took the rest back and copied what had
    landed in out= to a buffer of ours with ``np.copyto`` on the event loop, in one go (a 512 MiB
    tensor stalls every channel of the process for the whole copy), where a recv cancelled as
    its bytes land (``Arrival.detach``) hands such a copy to a copy thread. Every large copy made
    while the cancel runs is watched: none may run on the loop's thread. The cancel still ends
    only once the copy has (out= is the caller's again: garbage written into it then does not
    reach the next recv), and nothing is lost: the copy thread is held, and the cancel may not
    end before it is let go."""
    from test_ucx import without_libucp

    from tensorwire.tensors._offload import OFF_LOOP_BYTES

    if bindings == "ucxx":
        without_libucp(monkeypatch)
    src = (np.arange(4 * MiB, dtype=np.uint8) | 1, np.full(1 * MiB, 7, np.uint8))
    limits = None if credit is None else tensorwire.Limits(recv_buffer_bytes=credit)
    async with connected_pair("ucx", ucx_options={"TLS": "sm,self"}, limits=limits) as (a, b):
        gate = _hold_after_first_segment(a)
        copies: list[tuple[int, int]] = []  # (thread, bytes) of each large copy while the cancel runs
        copyto = np.copyto
        loop = threading.get_ident()
        started, released = threading.Event(), threading.Event()

        def watched(dst: Any, src: Any, *args: Any, **kwargs: Any) -> None:
            if np.asarray(dst).nbytes >= OFF_LOOP_BYTES:
                copies.append((threading.get_ident(), np.asarray(dst).nbytes))
                if threading.get_ident() != loop:
                    started.set()
                    released.wait(10)  # (held: the cancel must wait for it)
            copyto(dst, src, *args, **kwargs)

        out = tuple(np.zeros_like(s) for s in src)
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        send = asyncio.ensure_future(a.send(src, tag="t"))
        try:
            await eventually(lambda: bool(out[0][-1]) or recv.done(), 10, pause=0)  # the first one landed
            assert not recv.done(), recv
            monkeypatch.setattr(np, "copyto", watched)
            recv.cancel()
            await eventually(lambda: started.is_set() or recv.done(), 5, pause=0)
            assert [n for t, n in copies if t == loop] == [], "what landed was copied on the event loop"
            assert not recv.done(), "the cancelled recv ended while a copy still read its out="
            released.set()
            done, _ = await asyncio.wait([recv], timeout=5)
            monkeypatch.setattr(np, "copyto", copyto)
            assert done, "the cancelled recv waited for a tensor whose payload had not begun to move"
            out[0][:] = 0  # (the caller's again)
        finally:
            released.set()
            gate.set()
        (first,) = await asyncio.gather(recv, return_exceptions=True)
        assert isinstance(first, asyncio.CancelledError), repr(first)
        assert copies == [(copies[0][0], 4 * MiB)]
        await asyncio.wait_for(send, 5)
        again = tuple(np.zeros_like(s) for s in src)
        got = await asyncio.wait_for(b.recv(tag="t", out=again), 5)
        assert got is again
        for g, s in zip(again, src, strict=True):
            np.testing.assert_array_equal(g, s)
        assert not out[1].any()


@pytest.mark.usefixtures("grpc_kept")
async def test_a_channel_shut_with_a_dropped_messages_receives_posted_does_not_keep_closed_nodes_ucx_workers() -> None:
    """A rendezvous message dropped unread (``discard``: a receive of one byte of scratch per
    tensor posted, and its CTS sent) whose sender aborted its channel as the CTS came: the
    payload never comes, and the receiving channel shuts on the sender's goodbye. Its shutdown
    cancelled those receives but kept them listed (``_discarding``), and each ucxx request holds
    the node's UCX worker: a program that kept the peer after the nodes closed kept that
    worker's listening sockets, descriptors and shared-memory mappings."""
    from tensorwire.transports._frames import FrameType, unpack_fields

    held: list[object] = []
    limits = tensorwire.Limits(recv_buffer_bytes=0)  # (rendezvous: the message waits for its recv)
    tag = tag_id("t")

    async def pair_with_a_dropped_message() -> None:
        async with (
            tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as a,
            tensorwire.start("127.0.0.1:0", transports=("ucx",), limits=limits) as b,
        ):
            peer = await a.connect(b.address)
            other = await b.accept()
            channel = peer.channel
            handle = channel._handle_frame

            def on_frame(length: int | None = None) -> None:
                if unpack_fields(channel._ctrl_mv)[0] is FrameType.CTS:
                    channel.abort()  # (its payload never goes)
                    return
                handle(length)

            channel._handle_frame = on_frame
            send = asyncio.ensure_future(peer.send((np.ones(MiB, np.uint8), np.ones(MiB, np.uint8)), tag="t"))
            mailbox = other.channel.mailbox
            await eventually(lambda: mailbox.oldest(tag) is not None)
            assert other.channel.discard(mailbox.oldest(tag))
            await eventually(lambda: other.channel.state is not ChannelState.OPEN)
            (result,) = await asyncio.gather(send, return_exceptions=True)
            assert isinstance(result, tensorwire.TensorWireError), repr(result)
        held.extend((a, b, peer, other))

    await pair_with_a_dropped_message()  # (the first also starts what stays for the process)
    gc.collect()
    first = _ucx_footprint()
    for _ in range(2):
        await pair_with_a_dropped_message()
    gc.collect()
    after = _ucx_footprint()
    assert (after[0], after[2]) == (first[0], first[2]), (
        f"(listening sockets, /dev/shm mappings) after 1 and 3 pairs; {_what_keeps_ucx_workers()}"
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_send_whose_channel_shut_between_two_segments_says_its_stopped_receiver_may_still_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A two-segment send (4 MiB + 256 MiB, rendezvous: beyond the receiver's credit) through the
    libucp bindings: the receiver has read the first segment and is then stopped (SIGSTOP), and
    the channel is aborted before the send waits for the second, which UCX still holds for it.
    The send raised the channel's plain failure ("channel aborted"), as if its tensors were the
    caller's to change again, while the stopped peer may still read the second one when it runs
    again; now the failure says so, as it does for a send the shutdown caught in its wait."""
    from tensorwire.transports.ucx import _channel

    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=30) as hub:
        child, peer = await _receiver(hub, "first")
        try:
            channel = peer.channel
            assert channel._ucp is not None
            pid, _ = (int(v) for v in await peer.recv(tag="ready"))
            gate = asyncio.Event()
            at_second = asyncio.Event()
            wait_out = _channel.wait_out
            calls = 0

            async def gated(fut: Any) -> Any:
                nonlocal calls
                calls += 1
                result = await wait_out(fut)
                if calls == 1:  # between the two segments: the first one's wait has ended
                    at_second.set()
                    await gate.wait()
                return result

            monkeypatch.setattr(_channel, "wait_out", gated)
            big = (np.ones(4 * MiB, np.uint8), np.ones(256 * MiB, np.uint8))
            send = asyncio.ensure_future(peer.send(big, tag="big"))
            async with asyncio.timeout(20):
                await at_second.wait()
            os.kill(pid, signal.SIGSTOP)
            channel.abort()
            gate.set()
            async with asyncio.timeout(10):
                (result,) = await asyncio.gather(send, return_exceptions=True)
            assert isinstance(result, tensorwire.TensorWireError), repr(result)
            assert "may still read" in str(result), result
        finally:
            await end_child(child)
