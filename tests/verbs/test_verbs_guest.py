"""The verbs transport on a real verbs stack (Soft-RoCE inside the guest): GID choice, one-sided
access with real rkeys, the registration cache, completion errors and dead peers as tree errors.

The guest is emulated (qemu TCG), so control-plane wall-clock limits are scaled (EMULATED).
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from _polling import eventually
from _verbs_reads import watch_post_reads

import tensorwire
from tensorwire.errors import PeerDisconnected, ProtocolError, RegistrationError, TensorWireError, TransferError
from tensorwire.tensors import prepare
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState, Limits
from tensorwire.transports._credit import OWN_TAGS
from tensorwire.transports._remote import unpack_remote_key
from tensorwire.transports.verbs import RemoteKey, VerbsChannel, VerbsTransport, choose_port, dmabuf_status
from tensorwire.transports.verbs._channel import RESERVE, _Out
from tensorwire.transports.verbs._wire import Flag, Kind

MiB = 1 << 20
EMULATED = {"lease_seconds": 30.0, "connect_timeout": 60.0, "goodbye_seconds": 5.0}
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _pair():  # type: ignore[no-untyped-def]
    return connected_pair("verbs", **EMULATED)


def _transport(peer: tensorwire.Peer) -> VerbsTransport:
    t = peer.node.transports["verbs"]
    assert isinstance(t, VerbsTransport)
    return t


def _mapped(fragment: str) -> list[str]:
    """Paths of the files mapped into this process whose name contains ``fragment``."""
    paths = {line.split(None, 5)[5] for line in Path("/proc/self/maps").read_text().splitlines() if fragment in line}
    return sorted(p.strip() for p in paths)


def test_the_verbs_stack_in_use() -> None:
    """Which pyverbs, libibverbs and provider this run uses, from the process itself: printed
    (the host-side tests read it), and where TW_VERBS_STACK names a prefix, all from there."""
    from importlib import metadata

    from tensorwire.transports.verbs._verbs import pv

    v = pv()
    port = choose_port(os.environ.get("RXE_IP", ""))
    assert not isinstance(port, str), port
    ctx = v.device.Context(name=port.device)  # the provider is loaded by now
    try:
        pyverbs_file = sys.modules["pyverbs"].__file__ or ""
        try:
            version = metadata.version("pyverbs")
        except metadata.PackageNotFoundError:
            version = "(no package metadata)"
        libibverbs, provider = _mapped("/libibverbs.so"), _mapped("/librxe-")
        print(f"VERBS_STACK pyverbs {version} {pyverbs_file}")
        print(f"VERBS_STACK libibverbs {' '.join(libibverbs)}")
        print(f"VERBS_STACK provider {' '.join(provider)}")
    finally:
        ctx.close()
    assert len(libibverbs) == 1 and len(provider) == 1, (libibverbs, provider)
    prefix = os.environ.get("TW_VERBS_STACK")
    if prefix:
        for path in (pyverbs_file, libibverbs[0], provider[0]):
            assert path.startswith(prefix + "/"), f"{path} is not from {prefix}"


def test_gid_is_the_roce_v2_ipv4_mapped_one() -> None:
    ip = os.environ.get("RXE_IP", "")
    port = choose_port(ip)
    assert not isinstance(port, str), port
    assert port.roce and port.gid_type == "RoCE v2", port
    assert port.gid[:12] == bytes(10) + b"\xff\xff", port.describe()
    if ip:
        assert port.gid[12:] == ipaddress.IPv4Address(ip).packed, port.describe()
    # rxe puts the link-local IPv6 GID at index 0: taking index 0 by habit would be wrong here
    zero = Path(f"/sys/class/infiniband/{port.device}/ports/{port.port}/gids/0").read_text().strip()
    assert zero.startswith("fe80"), zero
    assert port.gid_index != 0


async def test_offer_carries_the_gid_and_the_path_says_rdma() -> None:
    async with _pair() as (a, b):
        t = _transport(a)
        assert t.port is not None and t.port.gid_index != 0
        assert a.path.transport == "verbs" and a.path.rdma
        assert a.path.lanes == (f"rc/{t.port.device}:{t.port.port}",)
        r = await a.send(np.arange(10), tag=1)
        assert r.transport == "verbs" and r.protocol == "inline"
        assert np.array_equal(await b.recv(tag=1), np.arange(10))


def test_verbs_claims_no_gpu_memory_even_where_dma_buf_export_works(monkeypatch: pytest.MonkeyPatch) -> None:
    # there is no GPU in the guest, so dma-buf export is pretended; the channel stages CUDA
    # tensors through host memory whatever it says, and a path must not say GPUDirect for that
    from tensorwire.transports.verbs import _dmabuf, _transport

    monkeypatch.setattr(_dmabuf, "dmabuf_status", lambda: (True, "pretended"))
    monkeypatch.setattr(_transport, "dmabuf_status", _dmabuf.dmabuf_status, raising=False)
    caps = VerbsTransport.probe()
    assert caps is not None, VerbsTransport.unavailable_reason()
    assert caps.rdma and caps.memory_kinds == ("host",) and not caps.gpudirect, caps


async def test_one_sided_read_and_write_with_real_rkeys() -> None:
    async with _pair() as (a, b):
        kv = np.arange(2 * MiB // 4, dtype=np.float32).reshape(512, 1024)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        assert h.direct and h.transport == "verbs" and h.writable
        out = np.empty_like(kv)
        got, receipt = await b.read_with_receipt(h, out=out)
        assert got is out and np.array_equal(out, kv)
        assert receipt.protocol == "one-sided" and receipt.direct and receipt.transport == "verbs"
        new = np.full_like(kv, 3.5)
        w = await b.write(h, new)
        assert w.protocol == "one-sided" and w.nbytes == kv.nbytes
        assert np.array_equal(kv, new), "RDMA WRITE did not land in the exposed memory"
        assert a.node.exposures.served == 0, "the owner's code took part"
        # read-only exposure: registered without remote write, and writes are refused
        ro = np.arange(100, dtype=np.int16)
        ro.flags.writeable = False
        a.node.expose(ro, name="ro")
        hr = await b.lookup("ro")
        assert not hr.writable and np.array_equal(await b.read(hr), ro)
        with pytest.raises(tensorwire.HandleNotFound):
            await b.write(hr, ro.copy())
        # revocation waits for the reader's acknowledgement, then deregisters
        await a.node.unexpose("kv")
        with pytest.raises(tensorwire.HandleNotFound):
            await b.read(h, out=out)
        assert not _transport(a).registrations.regions or all(
            r.address != kv.ctypes.data for r in _transport(a).registrations.regions.values()
        )


async def test_out_buffer_registered_once() -> None:
    async with _pair() as (a, b):
        x = np.arange(MiB // 4, dtype=np.int32)  # 1 MiB: beyond inline, so RDMA READ into out=
        out = np.empty_like(x)
        mem = _transport(b).memory
        assert mem is not None
        for i in range(4):
            recv = asyncio.ensure_future(b.recv_with_receipt(tag="o", out=out))
            await asyncio.sleep(0.05)
            await a.send(x + i, tag="o")
            _, r = await recv
            assert r.direct and not r.staged and np.array_equal(out, x + i)
            if i == 0:
                first = mem.registrations
        assert mem.registrations == first, "out= was registered again"
        assert mem.hits >= 3
        # the sender's tensor is registered once too
        smem = _transport(a).memory
        assert smem is not None
        before = smem.registrations
        for _ in range(3):
            await a.send(x, tag="s")
            await b.recv(tag="s", out=out)
        assert smem.registrations - before <= 1


async def test_memory_its_owner_moved_is_not_sent_from_a_stale_registration() -> None:
    """A registration pins the pages behind its range when it is made. An mmap (or an
    array.array) that a numpy array is built over (``np.ndarray(buffer=...)``, ``np.memmap``) is
    that array's owner, and it can give its pages back and take new ones at the same addresses
    while it lives (``resize``), once no array is left over it. The cache kept the registration
    for as long as the owner lived, so the second send below went out of the old pages: the
    receiver got the first send's bytes in the tail. Only owners that cannot do that are cached
    (a numpy array that owns its memory: numpy refuses to resize one with a weak reference; a
    memoryview: its exporter cannot resize while it lives)."""
    size = MiB
    async with _pair() as (a, b):
        # (private: a shared anonymous mapping keeps its pages in its shmem object when it shrinks)
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = np.ndarray((size,), np.uint8, buffer=mm)
        view[:] = 1
        await a.send(view, tag="m")
        assert np.all(await b.recv(tag="m") == 1)
        address = view.ctypes.data
        del view
        mm.resize(size // 2)  # the tail's pages go back to the kernel
        mm.resize(size)  # and new ones come at the same addresses (mremap grows it in place)
        view = np.ndarray((size,), np.uint8, buffer=mm)
        assert view.ctypes.data == address, "the mapping moved: this run cannot show a stale registration"
        assert np.all(view[size // 2 :] == 0)
        view[:] = 2
        await a.send(view, tag="m")
        got = await b.recv(tag="m")
        assert np.all(got == 2), f"{np.count_nonzero(got != 2)} bytes came from the pages the mmap gave back"


async def test_channel_get_and_put_into_a_numpy_array_register_it_once() -> None:
    """The channel's own get and put (``OneSidedChannel``) took each buffer through a new
    memoryview, the owner the registration cache tied its registration to: it was registered
    and deregistered again on every call. And a buffer that is not C-contiguous raised
    memoryview's TypeError, not an error of tensorwire's."""
    async with _pair() as (a, b):
        kv = np.arange(MiB // 4, dtype=np.int32)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        addr = unpack_remote_key(h.remote_key).address
        channel = b.channel
        assert isinstance(channel, VerbsChannel)
        key = channel.remote_key(unpack_remote_key(h.remote_key).key)
        mem = _transport(b).memory
        assert mem is not None
        dest = np.zeros_like(kv)
        src = kv + 5
        await channel.get(addr, key, dest)
        await channel.put(src, addr, key)
        before = mem.registrations
        for _ in range(3):
            await channel.get(addr, key, dest)
            await channel.put(src, addr, key)
        assert np.array_equal(dest, kv) and np.array_equal(kv, src)
        assert mem.registrations == before, f"{mem.registrations - before} registrations for 6 more gets and puts"
        with pytest.raises(TransferError, match="contiguous"):
            await channel.get(addr, key, np.zeros((256, 2), np.int32)[:, 0])


async def test_staged_device_memory_registers_each_staging_chunk_once() -> None:
    """Reads into device memory (host-engine memory, staged as CUDA memory is on verbs) get
    into the staging chunks themselves, and writes put from them: the chunks are registered the
    first time and found in the cache after, however many tensors go through them."""
    from tensorwire.memory import HostEngine
    from tensorwire.tensors import EngineArray

    engine = HostEngine()
    for direction in ("in", "out"):
        engine.pool(direction).configure(256 << 10, 4)
    try:
        async with _pair() as (a, b):
            kv = np.arange(MiB, dtype=np.int32)  # 4 MiB: sixteen chunks
            a.node.expose(kv, name="kv")
            h = await b.lookup("kv")
            assert h.direct
            mem = _transport(b).memory
            assert mem is not None
            for i in range(3):
                out = EngineArray(engine, np.zeros(MiB, np.int32))
                _, r = await b.read_with_receipt(h, out=out)
                assert r.protocol == "one-sided" and r.staged and r.memory == "host-engine", r
                assert np.array_equal(out.array, kv)
                await b.write(h, EngineArray(engine, kv + 1))
                kv -= 1
                if i == 0:
                    first = mem.registrations
            assert mem.registrations == first, f"{mem.registrations - first} registrations after the first round"
    finally:
        engine.close()


async def test_remote_access_error_is_a_transfer_error_and_breaks_the_channel() -> None:
    async with _pair() as (a, b):
        a.node.expose(np.zeros(4096, np.uint8), name="z")
        h = await b.lookup("z")
        blob_addr = unpack_remote_key(h.remote_key).address
        dest = np.empty(4096, np.uint8)
        channel = b.channel
        bogus = RemoteKey(0x7FFFFF)
        with pytest.raises(TransferError, match="remote access error"):
            async with asyncio.timeout(30):
                await channel.rma("get", dest.ctypes.data, dest.nbytes, blob_addr, bogus, dest)  # type: ignore
        assert b.closed
        with pytest.raises(TensorWireError):
            await b.send(np.arange(3))


async def test_credit_frames_are_reported_so_the_ring_never_looks_full() -> None:
    """CREDIT frames take ring slots too: b sends a burst, a consumes it slowly, each recv
    returning its credit in a CREDIT frame of its own; b reports those frames (lazily), so a's
    view of b's ring stays nearly whole and its answer goes at once (the conformance check
    a_slow_consumer_of_a_burst_can_still_answer is the user's side of this)."""
    async with _pair() as (a, b):
        n = 90
        for i in range(n):
            await b.send(np.arange(4, dtype=np.int64) + i, tag="m")
        for i in range(n):
            assert (await a.recv(tag="m"))[0] == i
            await asyncio.sleep(0.004)
        ca, cb = a.channel, b.channel
        assert isinstance(ca, VerbsChannel) and isinstance(cb, VerbsChannel)
        assert ca.stats["credit_frames"] >= n // 2, ca.stats  # the traffic this is about
        lazily = (ca._qp.slots - RESERVE) // 2
        assert ca._ring_free() > ca._peer_ring - lazily, (ca._ring_free(), ca.stats, cb.stats)
        async with asyncio.timeout(20):
            await a.send(np.arange(3), tag="answer")
            assert list(await b.recv(tag="answer")) == [0, 1, 2]
        # one CREDIT frame of b's per `lazily` of a's, and a few for the answer: no ping-pong
        await asyncio.sleep(0.5)
        assert cb.stats["credit_frames"] <= ca.stats["credit_frames"] // lazily + 4, (ca.stats, cb.stats)


async def test_frag_frames_of_ever_new_messages_break_the_channel() -> None:
    """A hostile peer sends FRAG frames, each under the size limit, each of a new message: the
    receiver holds one partial message at most, so the second one is a protocol error."""
    async with _pair() as (a, b):
        ca, cb = a.channel, b.channel
        assert isinstance(ca, VerbsChannel) and isinstance(cb, VerbsChannel)
        broken = asyncio.Event()
        ca.add_close_callback(lambda exc: broken.set())
        before = ca.stats["frames_in"]
        body = bytes(cb._frame_max)
        for i in range(8):
            cb._enqueue(_Out(Kind.FRAG, body, msg_id=(1 << 40) + i))
        async with asyncio.timeout(30):
            await broken.wait()
        assert ca.state is ChannelState.BROKEN and a.closed
        assert isinstance(ca.mailbox.failure, ProtocolError) and "FRAG" in str(ca.mailbox.failure)
        assert ca.stats["frames_in"] - before <= 3, ca.stats  # broken at the second message's first frame


async def test_a_peer_parking_more_user_messages_than_max_unexpected_breaks_the_channel() -> None:
    """A hostile peer whose MSG frames go around its send window: the user's messages may hold
    max_unexpected of the receiver's slots, tensorwire's own the rest, and one user message past
    that share is a ProtocolError while slots are still free (as over tcp and ucx:
    tests/test_hostile.py)."""
    m = 8
    async with connected_pair("verbs", limits=Limits(max_unexpected=m), **EMULATED) as (a, b):
        ca, cb = a.channel, b.channel
        assert isinstance(ca, VerbsChannel) and isinstance(cb, VerbsChannel)
        x = np.arange(4, dtype=np.int64)
        header = prepare(x).header
        body = header + x.tobytes()

        def park(n: int, tag: int) -> None:
            for _ in range(n):
                cb._next_id += 1
                cb._send_body(
                    Kind.MSG,
                    body,
                    flags=Flag.INLINE,
                    nseg=0,
                    meta_len=len(header),
                    msg_id=cb._next_id,
                    tag=tag,
                    nbytes=x.nbytes,
                )

        before = ca.stats["frames_in"]
        park(m, tag=5)  # the user's whole share
        park(m // 2, tag=OWN_TAGS[0])  # and some of the slots kept for tensorwire's own
        await eventually(lambda: ca.stats["frames_in"] - before >= m + m // 2, seconds=30)
        assert ca.state is ChannelState.OPEN
        park(1, tag=5)
        await eventually(lambda: ca.state is not ChannelState.OPEN, seconds=30)
        assert isinstance(ca.mailbox.failure, ProtocolError), ca.mailbox.failure
        assert f"more than {m} user messages" in str(ca.mailbox.failure)


async def test_a_get_cancelled_while_the_channel_closes_waits_for_its_reads() -> None:
    """A get cancelled while aclose() waits for its BYE to go returns only once no RDMA READ
    can write into its buffer (the queue pair is destroyed), and none of its queued READs is
    posted once the channel is closing."""
    async with _pair() as (a, b):
        src = np.full(16 * MiB, 7, np.uint8)
        a.node.expose(src, name="src")
        blob = unpack_remote_key((await b.lookup("src")).remote_key)
        ch = b.channel
        assert isinstance(ch, VerbsChannel)
        qp = ch._qp
        rkey = ch.remote_key(blob.key)
        out = np.zeros(src.nbytes, np.uint8)
        piece = 64 << 10  # 256 READs: 32 posted at once, the rest queued
        items = [(out.ctypes.data + off, piece, blob.address + off, rkey, out) for off in range(0, out.nbytes, piece)]
        # a first get registers out= (cached): memory not registered yet is faulted in by a worker
        # thread before any READ is posted (_faulting_in), and the cancel below would come then
        await ch.rma_many("get", items)
        out[:] = 0
        at_return: list[tuple[ChannelState, bool]] = []

        async def get() -> None:
            try:
                await ch.rma_many("get", items)
            finally:  # what holds as the get returns
                at_return.append((ch.state, qp._closed))

        task = asyncio.ensure_future(get())
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(ch.aclose())
        await asyncio.sleep(0)
        assert ch.state is ChannelState.CLOSING and not task.done()
        posted = ch._rdma_ids
        # under TCG rxe completes READs inside post_send, and one drain takes them all: hold
        # the CQ's reader back while the cancel is delivered, the interleaving where no
        # completion has come in yet (on hardware they come when they come). The peer may
        # take the BYE meanwhile and end the bootstrap connection: that closes the channel
        loop = asyncio.get_running_loop()
        loop.remove_reader(qp.fd)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        if not qp._closed:
            loop.add_reader(qp.fd, qp._readable)
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(20):
                await asyncio.shield(task)
        assert at_return == [(ChannelState.CLOSED, True)], f"the cancelled get returned with the channel {at_return}"
        snapshot = out.copy()
        await closing
        assert ch._rdma_ids == posted, f"{ch._rdma_ids - posted} RDMA READs posted after the channel began to close"
        await asyncio.sleep(0.5)
        assert np.array_equal(out, snapshot), "out= written after the cancelled get returned"


async def test_a_close_right_after_a_burst_sends_what_it_queued_before_its_bye() -> None:
    """b receives a's message into out= (its recv queues the FIN as it returns), sends a burst
    of 40 inline messages, each send returning once its frame is queued, and closes. The burst
    outruns b's 32 send slots, so frames and the FIN wait in the queue at the close; aclose
    sends them before its BYE: a's send returns and a gets all 40. The close used to skip the
    queue (with no send slot free it sent no BYE at all) and drop it: a's send failed with
    PeerDisconnected after its message had been delivered, and 8 messages whose sends had
    returned never arrived."""
    src = (np.arange(MiB) % 251).astype(np.uint8)
    async with _pair() as (a, b):
        cb = b.channel
        assert isinstance(cb, VerbsChannel)
        send = asyncio.ensure_future(a.send(src, tag="t"))
        out = np.zeros_like(src)
        async with asyncio.timeout(30):
            await b.recv(tag="t", out=out)  # returns without yielding after its READs: FIN not queued yet
        assert np.array_equal(out, src)
        n = 40
        for i in range(n):
            await b.send(np.arange(4, dtype=np.int64) + i, tag="m")
        assert cb._outq, "the burst did not outrun the send slots: nothing waits in the queue"
        await b.aclose()
        (sent,) = await asyncio.gather(asyncio.wait_for(send, 30), return_exceptions=True)
        got: list[int] = []
        failure: TensorWireError | None = None
        try:
            async with asyncio.timeout(30):
                for _ in range(n):
                    got.append(int((await a.recv(tag="m"))[0]))
        except TensorWireError as exc:
            failure = exc
        assert isinstance(sent, tensorwire.Receipt), f"a's send said {sent!r} though b got its message"
        assert got == list(range(n)), f"messages whose sends returned were lost: got {got}, then {failure!r}"


async def test_closing_while_the_peer_reads_a_send_lets_the_send_finish() -> None:
    """a closes while b RDMA-reads its 4 MiB eager message out of a's memory: aclose waits for
    b's FIN (1 s at most) before its BYE, so the send returns and b has the message. The BYE
    used to go at once: the send failed with 'channel closed' and b's READs were cut off (a
    100 KiB message was read before the BYE came, and its send returned, in the one run tried)."""
    src = (np.arange(4 * MiB) % 251).astype(np.uint8)
    async with _pair() as (a, b):
        send = asyncio.ensure_future(a.send(src, tag="t"))
        await asyncio.sleep(0)  # its MSG frame is out: b reads the payload
        assert not send.done()
        close = asyncio.ensure_future(a.aclose())
        sent, got, _ = await asyncio.gather(
            asyncio.wait_for(send, 30), asyncio.wait_for(b.recv(tag="t"), 30), close, return_exceptions=True
        )
        arrived = isinstance(got, np.ndarray) and np.array_equal(got, src)
        assert isinstance(sent, tensorwire.Receipt) and arrived, f"send said {sent!r}, recv got {got!r}"


@pytest.mark.parametrize("grace", [10.0, 0.0], ids=["grace-enough", "grace-spent"])
async def test_closing_while_its_recv_reads_a_message_lets_the_sender_know_what_happened(
    grace: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b closes its channel while its recv's RDMA READs of a's message are in flight. The READs
    cannot be recalled, and the close waits for them within its goodbye grace.

    With grace enough (10 s here: the 1 s default ran out under emulation on a loaded host) they
    finish and the recv returns the message, so a's send must return too. b's BYE went out
    behind the READs and ahead of the FIN (which the recv queues as it returns, after the close
    had shut the channel): a's send failed with PeerDisconnected though b had the message, and a
    caller that sent it again delivered it twice.

    With the grace spent (0): the BYE still went ahead of the message's FIN and a's send failed
    while b's recv returned the message. Now a returned message's FIN goes before the BYE, and a
    recv whose READs are still under way as the BYE goes fails (as its sender does), though its
    READs finish: delivered exactly where the send says so."""
    from tensorwire.transports.verbs import _channel

    monkeypatch.setattr(_channel, "BYE_GRACE", grace)
    src = (np.arange((16 if grace else 1) * MiB) % 251).astype(np.uint8)
    # The close must come while the READs are in flight. A 1 MiB message's READs can be posted
    # and done within one of the loop's completion callbacks (a CI run saw none in flight for
    # 30 s: the recv had returned), so a pair whose READs the test never saw in flight is tried
    # again, up to three pairs; each must still agree with its send.
    for _ in range(3):
        async with _pair() as (a, b):
            cb = b.channel
            assert isinstance(cb, VerbsChannel)
            send = asyncio.ensure_future(a.send(src, tag="t"))
            out = np.zeros_like(src)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            await eventually(lambda cb=cb, recv=recv: bool(cb._rdma_cbs) or recv.done(), seconds=30, pause=0)
            in_flight = bool(cb._rdma_cbs)  # its READs are posted, not done
            close = asyncio.ensure_future(cb.aclose())
            sent, got, _ = await asyncio.gather(
                asyncio.wait_for(send, 60), asyncio.wait_for(recv, 60), close, return_exceptions=True
            )
            delivered = isinstance(got, np.ndarray)
            assert delivered == isinstance(sent, tensorwire.Receipt), f"a's send said {sent!r}, b's recv {got!r}"
            if grace or not in_flight:
                assert delivered and np.array_equal(out, src), f"the recv's READs were cut off: {got!r}"
        if in_flight:
            return
    pytest.fail("in none of three pairs were the recv's READs seen in flight when its channel closed")


def _resident(address: int, length: int) -> float:
    """The share of the pages of ``[address, address + length)`` in memory now (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    pages = (address + length - start + page - 1) // page
    vec = np.zeros(pages, np.uint8)
    if libc.mincore(start, address + length - start, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return float(np.mean(vec & 1))


async def test_memory_rdma_writes_into_is_faulted_in_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering memory for RDMA to write into faults in every page of it never written, and
    ibv_reg_mr does that holding the GIL: on the event loop, for the whole buffer at once. In
    this guest a 64 MiB recv without out= held the receiver's loop 0.76 s of its 5.4 s (a new
    buffer of the channel's own each time), and a fresh 256 MiB out= would hold it 3.5 s.
    Such memory is now faulted in by a worker thread first: when it is registered its pages are
    there (before: about none of them), for a recv without out=, a recv into a fresh out=, and a
    one-sided read into a fresh out=; and the bytes arrive whole."""
    n = 32 * MiB
    x = (np.arange(n) % 251).astype(np.uint8)
    async with _pair() as (a, b):
        mem = _transport(b).memory
        assert mem is not None
        register = mem._register
        seen: list[tuple[str, float]] = []  # (what, share of its pages in memory as it was registered)
        what = ["?"]

        def watched(address: int, length: int, access: int) -> object:
            if length >= n:
                seen.append((what[0], _resident(address, length)))
            return register(address, length, access)

        monkeypatch.setattr(mem, "_register", watched)
        posted = b.channel.mailbox.has_posted
        tid = 7

        what[0] = "recv without out="
        recv = asyncio.ensure_future(b.recv(tag=tid))
        await eventually(lambda: posted(tid))
        await a.send(x, tag=tid)
        assert np.array_equal(await recv, x)

        what[0] = "recv into a fresh out="
        out = np.empty(n, np.uint8)
        rr = asyncio.ensure_future(b.recv_with_receipt(tag=tid, out=out))
        await eventually(lambda: posted(tid))
        await a.send(x, tag=tid)
        got, receipt = await rr
        assert got is out and receipt.direct and np.array_equal(out, x), receipt

        what[0] = "one-sided read into a fresh out="
        a.node.expose(x, name="x")
        h = await b.lookup("x")
        fresh = np.empty(n, np.uint8)
        await b.read(h, out=fresh)
        assert np.array_equal(fresh, x)

        kinds = ["recv without out=", "recv into a fresh out=", "one-sided read into a fresh out="]
        assert [w for w, _ in seen] == kinds, seen
        assert all(share > 0.99 for _, share in seen), f"registered with its pages yet to be faulted in: {seen}"


def _untouched(n: int) -> np.ndarray:
    """``n`` bytes of memory never written (an anonymous mapping of their own: ``np.empty`` may
    hand back heap memory earlier tests wrote)."""
    return np.frombuffer(mmap.mmap(-1, n), np.uint8)


def _watch_registrations(monkeypatch: pytest.MonkeyPatch, t: VerbsTransport) -> list[tuple[int, float]]:
    """Each exposure registered from now on, as ``(address, share of its pages in memory then)``."""
    register = t._map
    seen: list[tuple[int, float]] = []

    def watched(address: int, length: int, writable: bool) -> tuple[bytes, object]:
        seen.append((address, _resident(address, length)))
        return register(address, length, writable)

    monkeypatch.setattr(t, "_map", watched)
    monkeypatch.setattr(t.registrations, "register", watched)
    return seen


async def test_fresh_memory_an_expose_registers_is_faulted_in_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``expose`` is called on the loop, and registering memory never written faulted in every
    page of it inside ibv_reg_mr, holding the GIL: in this guest exposing a fresh 64 MiB
    ``np.empty`` held the loop 0.6-1.4 s, 256 MiB 3.5-4.5 s. Such memory is now faulted in by a
    worker thread and registered after: its pages are there when it is registered (before:
    about none), and a peer reads and writes it as before."""
    n = 32 * MiB
    async with _pair() as (a, b):
        t = _transport(a)
        seen = _watch_registrations(monkeypatch, t)
        x = _untouched(n)
        a.node.expose(x, name="x")
        await eventually(lambda: bool(seen), seconds=60)
        assert [addr for addr, _ in seen] == [x.ctypes.data], seen
        assert seen[0][1] > 0.99, f"registered with its pages yet to be faulted in: {seen}"
        x[-MiB:] = 7
        h = await b.lookup("x")
        assert h.direct and h.transport == "verbs"
        got = np.zeros(MiB, np.uint8)
        _, receipt = await b.read_with_receipt(h[n - MiB :], out=got)
        assert (got == 7).all() and receipt.protocol == "one-sided", receipt
        w = await b.write(h[:MiB], np.full(MiB, 9, np.uint8))
        assert (x[:MiB] == 9).all() and w.protocol == "one-sided", w
        assert len(seen) == 1 and a.node.exposures.served == 0


async def test_an_exposure_looked_up_or_unexposed_while_it_is_faulted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a worker thread faults in what ``expose`` registers: a peer's lookup registers it
    there and then (its key works), and an unexpose means it is never registered."""
    import threading

    from tensorwire.transports.verbs import _transport as module

    n = 8 * MiB
    gate, finished = threading.Event(), threading.Event()
    fault_in_span = module.fault_in_span

    def held(address: int, length: int, keep: object = None) -> None:
        gate.wait(60)
        fault_in_span(address, length, keep)
        finished.set()

    monkeypatch.setattr(module, "fault_in_span", held)
    try:
        async with _pair() as (a, b):
            t = _transport(a)
            seen = _watch_registrations(monkeypatch, t)
            x = _untouched(n)
            a.node.expose(x, name="x")
            assert not seen, "registered before its memory was faulted in"
            x[-MiB:] = 3
            h = await b.lookup("x")  # registers it now
            assert [addr for addr, _ in seen] == [x.ctypes.data], seen
            assert h.direct and h.transport == "verbs"
            got = np.zeros(MiB, np.uint8)
            _, receipt = await b.read_with_receipt(h[n - MiB :], out=got)
            assert (got == 3).all() and receipt.protocol == "one-sided", receipt
            gate.set()
            await eventually(finished.is_set, seconds=30)
            await asyncio.sleep(0.05)  # (its done callback: no second registration)
            assert len(seen) == 1 and len(t.registrations.regions) == 1

            gate.clear()
            finished.clear()
            y = _untouched(n)
            a.node.expose(y, name="y")
            await a.node.unexpose("y")
            gate.set()
            await eventually(finished.is_set, seconds=30)
            await asyncio.sleep(0.05)
            assert len(seen) == 1, "an exposure unexposed while it was faulted in was registered after"
            assert all(r.address != y.ctypes.data for r in t.registrations.regions.values())
    finally:
        gate.set()


async def test_a_recv_cancelled_while_its_memory_is_faulted_in_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recv into an out= never registered has a worker thread fault it in before any RDMA READ
    is posted (``_faulting_in``). Cancelled meanwhile, it waited for the whole fault-in and the
    READs (in this guest a fresh 64 MiB takes seconds), and the message was then copied out of
    out=, written after all. Now the message goes back unread (``take_back``): the cancel ends
    at once with out= untouched, the sender's send waits on, the next recv gets the message
    whole and the send then returns; the first fault-in, ending after, posts no READ into the
    cancelled recv's out=. (It is held until the test lets it go: that steers only timing.)"""
    import threading

    from tensorwire.transports.verbs import _channel

    fault_in = _channel.fault_in
    gate = threading.Event()
    calls: list[int] = []

    def held(arrays: list[np.ndarray]) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            gate.wait(120)
        fault_in(arrays)

    monkeypatch.setattr(_channel, "fault_in", held)
    src = (np.arange(16 * MiB) % 251).astype(np.uint8)
    # no buffer credit: the message waits for its recv (rendezvous), and its sender for the FIN
    async with connected_pair("verbs", limits=Limits(recv_buffer_bytes=0), **EMULATED) as (a, b):
        ch = b.channel
        assert isinstance(ch, VerbsChannel)
        ran = watch_post_reads(monkeypatch, ch)
        out = _untouched(src.nbytes)
        send = asyncio.ensure_future(a.send(src, tag="t"))
        recv = asyncio.ensure_future(b.recv(tag="t", out=out))
        try:
            await eventually(lambda: bool(calls), seconds=60)
            (stale,) = ch._incoming.values()
            posted = ch._rdma_ids
            recv.cancel()
            done, _ = await asyncio.wait([recv], timeout=30)
            assert done, "a recv cancelled while its memory was faulted in waited for it"
            assert recv.cancelled() and not send.done() and ch._rdma_ids == posted
            assert not out.any(), "out= written by a recv cancelled before any READ"
            again = _untouched(src.nbytes)
            async with asyncio.timeout(120):
                got = await b.recv(tag="t", out=again)
                receipt = await send
            assert got is again and np.array_equal(again, src)
            assert isinstance(receipt, tensorwire.Receipt) and receipt.protocol == "rendezvous", receipt
            posted = ch._rdma_ids
        finally:
            gate.set()
        await eventually(lambda: stale in ran, seconds=60)  # the first fault-in has ended
        assert ch._rdma_ids == posted and not out.any(), "READs posted into the cancelled recv's out="


_CHILD = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("verbs",), lease_seconds=600, connect_timeout=60) as n:
        p = await n.connect(sys.argv[1])
        await p.send(np.arange(5), tag="hello")
        print("connected", flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


async def test_a_small_message_goes_eager_beside_an_unreceived_message_the_size_of_the_credit() -> None:
    """Credit head-of-line blocking, as tests/test_credit_keep.py checks over tcp and ucx: a
    message as large as the credit waits for its recv (rendezvous) instead of taking all of it
    eager, so a small one on another tag, with no recv posted either, still goes eager and its
    send returns before anything is received (it went rendezvous before, and waited for its
    recv: its RDMA READ would queue behind the bulk's)."""
    async with connected_pair("verbs", limits=Limits(recv_buffer_bytes=MiB), **EMULATED) as (a, b):
        big = np.arange(MiB, dtype=np.uint8)
        bulk = asyncio.ensure_future(a.send(big, tag="bulk"))  # nobody receives it yet
        await asyncio.sleep(0.5)
        small = await asyncio.wait_for(a.send(np.ones(8), tag="ping"), 30)
        assert small.protocol in ("eager", "inline")  # (a payload within inline_bytes rides in its frame)
        assert not bulk.done()  # rendezvous: it waits for its recv
        np.testing.assert_array_equal(await asyncio.wait_for(b.recv(tag="ping"), 30), np.ones(8))
        got = await asyncio.wait_for(b.recv(tag="bulk"), 30)
        assert (await asyncio.wait_for(bulk, 30)).protocol == "rendezvous"
        np.testing.assert_array_equal(got, big)


async def test_an_eager_message_without_memory_for_it_waits_unread_for_a_recv_with_out() -> None:
    """The receiver cannot allocate an eager message that came before its recv: it waits unread
    in the sender's memory, as a rendezvous message does, until a recv(out=) reads it whole (the
    channel broke on the MemoryError before). The host runs the same for tcp and ucx."""
    from test_out_of_memory import check_eager_without_memory, eager_without_memory

    check_eager_without_memory(await eager_without_memory("verbs", **EMULATED), kept=True)


async def test_an_eager_reply_without_memory_for_it_frees_the_servers_call() -> None:
    """A 48 MiB result the capped caller cannot take waited unread in the server's memory, and
    the server's send for the FIN, holding its call and slot until the channel closed: now
    the caller drops it (FIN, dropped) and the next calls get the slot. The host runs the same
    for tcp and ucx."""
    from test_out_of_memory import check_eager_reply_without_memory, eager_reply_without_memory

    check_eager_reply_without_memory(await eager_reply_without_memory("verbs", patience=30.0, **EMULATED))


async def test_dead_peer_fails_pending_work_promptly() -> None:
    # the lease is long: what fails the pending recv is the data plane noticing, not the lease
    async with tensorwire.start("127.0.0.1:0", transports=("verbs",), lease_seconds=600, connect_timeout=60) as node:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, node.address, stdout=subprocess.PIPE, env=env
        )
        try:
            async with asyncio.timeout(120):
                peer = await node.accept()
                assert np.array_equal(await peer.recv(tag="hello"), np.arange(5))
            pending = asyncio.ensure_future(peer.recv(tag="never"))
            await asyncio.sleep(0.2)
            child.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(PeerDisconnected):
                async with asyncio.timeout(20):
                    await pending
            assert time.monotonic() - t0 < 10
        finally:
            if child.returncode is None:
                child.kill()
            await child.wait()


_ENOMEM = """
import asyncio, os, resource, sys, numpy as np, tensorwire
from tensorwire.errors import RegistrationError
os.setgid(65534); os.setuid(65534)  # root ignores RLIMIT_MEMLOCK (CAP_IPC_LOCK)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("verbs",), connect_timeout=60) as n:
        try:
            n.expose(np.zeros(32 << 20, np.uint8), name="big")
        except RegistrationError as exc:
            print("ERROR", exc, flush=True)
            return
        print("NO ERROR", flush=True)
asyncio.run(main())
"""


def _readable_copy_of_the_package() -> Path:
    """A directory every user may read, holding a copy of ``tensorwire`` with its bytecode where
    it has some (``rxe-vm.sh`` compiles it for the guest: the child imports in 3 s less)."""
    pkg = Path(tempfile.mkdtemp(prefix="tw-enomem-"))
    shutil.copytree(ROOT / "tensorwire", pkg / "tensorwire")
    for d in (pkg, *(p for p in pkg.rglob("*") if p.is_dir())):
        d.chmod(0o755)
    return pkg


async def _as_nobody(script: str) -> str:
    """What ``script`` printed (stdout and stderr) run by a Python child that makes itself
    nobody first (root ignores RLIMIT_MEMLOCK); skips where nobody cannot use the device."""
    if os.stat("/dev/infiniband/uverbs0").st_mode & 0o6 != 0o6:
        pytest.skip("the uverbs device is not usable by an unprivileged user here")
    # the child runs as nobody: give it a copy of the package it can read (the checkout may
    # sit in a directory only its owner can enter, as a clone into `mktemp -d` does)
    pkg = await asyncio.to_thread(_readable_copy_of_the_package)
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")]), HOME="/tmp")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd="/tmp"
        )
        try:
            async with asyncio.timeout(150):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        shutil.rmtree(pkg, ignore_errors=True)
    return out.decode(errors="replace")


async def test_registration_enomem_names_the_memlock_limit() -> None:
    text = await _as_nobody(_ENOMEM)
    assert "ERROR" in text and "NO ERROR" not in text, text
    assert "ENOMEM" in text and "RLIMIT_MEMLOCK" in text and "64 KiB" in text, text
    assert RegistrationError.__name__  # the class the child caught


_LATE_FAILURE = """
import asyncio, json, logging, mmap, os, resource
os.setgid(65534); os.setuid(65534)  # root ignores RLIMIT_MEMLOCK (CAP_IPC_LOCK)
HARD = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
resource.setrlimit(resource.RLIMIT_MEMLOCK, (256 << 20, HARD))
import numpy as np
from tensorwire.testing import connected_pair

MiB, n = 1 << 20, 8 << 20
warned, seen = [], {}

class Warned(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING and "register" in record.getMessage():
            warned.append(record.getMessage())

logging.getLogger("tensorwire").addHandler(Warned())

async def main():
    async with connected_pair("verbs", lease_seconds=30.0, connect_timeout=60.0) as (a, b):
        t = a.node.transports["verbs"]
        x = np.frombuffer(mmap.mmap(-1, n), np.uint8)  # never written: registered after expose returns
        a.node.expose(x, name="x")
        seen["later"] = len(t._later)
        # expose returned; the registration, on the loop once the memory is faulted in, meets
        # a limit it does not fit in (ENOMEM from ibv_reg_mr)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, HARD))
        for _ in range(600):
            if warned:
                break
            await asyncio.sleep(0.1)
        # room again (memory pinned meanwhile freed): an owner-assisted read pins what it sends
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (256 << 20, HARD))
        x[-MiB:] = 7
        try:
            h = await b.lookup("x")
            seen["direct"], seen["transport"] = h.direct, h.transport
            got = np.zeros(MiB, np.uint8)
            _, r = await b.read_with_receipt(h[n - MiB :], out=got)
            seen["read"] = [r.protocol, bool((got == 7).all())]
            whole, r = await b.read_with_receipt(h)
            seen["whole"] = [r.protocol, bool((whole[-MiB:] == 7).all()), bool((whole[: n - MiB] == 0).all())]
            w = await b.write(h[:MiB], np.full(MiB, 9, np.uint8))
            seen["write"] = [w.protocol, bool((x[:MiB] == 9).all())]
            seen["served"] = a.node.exposures.served
            async with asyncio.timeout(30):
                await a.node.unexpose("x")
            seen["left"] = [len(t.registrations.regions), len(t._later)]
            a.node.expose(x, name="x")  # in memory now: registered at once, and peers reach it directly
            h = await b.lookup("x")
            _, r = await b.read_with_receipt(h[:MiB], out=got)
            seen["again"] = [h.direct, r.protocol, bool((got == 9).all())]
        except Exception as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"
        seen["warned"] = warned

asyncio.run(main())
print("SEEN", json.dumps(seen), flush=True)
"""


async def test_an_exposure_whose_late_registration_fails_is_served_by_its_owner() -> None:
    """Fresh memory ``expose`` registers once a worker thread has faulted it in: where that
    registration fails (here the memlock limit, lowered after ``expose`` returned; ENOMEM from
    ibv_reg_mr), the exposure stays and peers reach it through the owner, as one no one-sided
    transport registered. Before, the failure was logged and every peer's lookup of it failed
    with it (the exposure was lost to them until unexposed)."""
    text = await _as_nobody(_LATE_FAILURE)
    lines = [line for line in text.splitlines() if line.startswith("SEEN ")]
    assert lines, text
    seen = json.loads(lines[-1][5:])
    assert seen["later"] == 1, seen  # (the late path was taken)
    assert "error" not in seen, seen
    assert len(seen["warned"]) == 1 and "owner-assisted" in seen["warned"][0], seen["warned"]
    assert "RLIMIT_MEMLOCK" in seen["warned"][0], seen["warned"]
    assert seen["direct"] is False and seen["transport"] == "", seen
    assert seen["read"] == ["owner-assisted", True], seen
    assert seen["whole"] == ["owner-assisted", True, True], seen
    assert seen["write"] == ["owner-assisted", True], seen
    assert seen["served"] >= 3, seen  # (the owner answered each)
    assert seen["left"] == [0, 0], seen  # unexposed: nothing registered, nothing pending
    assert seen["again"] == [True, "one-sided", True], seen


def test_gpu_memory_through_dmabuf() -> None:
    ok, why = dmabuf_status()
    if not ok:
        pytest.skip(f"GPU memory registration via dma-buf is not possible here: {why}")
    import cupy  # pragma: no cover - needs a GPU next to an RDMA device

    from tensorwire.transports.verbs import register_cuda
    from tensorwire.transports.verbs._verbs import pv

    v = pv()
    ctx = v.device.Context(name=os.environ.get("RXE_DEV", "rxe0"))
    pd = v.pd.PD(ctx)
    buf = cupy.zeros(MiB, cupy.uint8)
    region = register_cuda(pd, buf.data.ptr, buf.nbytes, v.enums.IBV_ACCESS_LOCAL_WRITE)
    assert region.rkey and region.length == MiB
    region.close()
    pd.close()
    ctx.close()
