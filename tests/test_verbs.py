"""The verbs transport where it cannot run (this host: no RDMA device, no pyverbs) and its pure
parts: the honest reason in probe() and peer.path, the wire format, and the GID choice over a
sysfs tree laid out as the kernel lays it out. Its behaviour on a real verbs stack is tested in
the Soft-RoCE guest (tests/verbs, run by tests/test_verbs_vm.py)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import random
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _polling import collected, eventually
from _verbs_reads import watch_post_reads

import tensorwire
from tensorwire.errors import BrokenResourceError, PeerDisconnected, ProtocolError
from tensorwire.tensors import prepare
from tensorwire.transports import ChannelState, Limits, probe_all
from tensorwire.transports._frames import PeerLimits
from tensorwire.transports.verbs import (
    RemoteKey,
    VerbsChannel,
    VerbsTransport,
    _channel,
    _memory,
    choose_gid,
    choose_port,
)
from tensorwire.transports.verbs._wire import Kind, Offer, QpInfo

pytestmark = pytest.mark.timeout(30)
MAPPED = "0000:0000:0000:0000:0000:ffff"


def _port(root: Path, dev: str, port: int, gids: list[tuple[str, str]], link: str = "Ethernet") -> None:
    base = root / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    (base / "gid_attrs" / "ndevs").mkdir(parents=True)
    (base / "state").write_text("4: ACTIVE\n")
    (base / "link_layer").write_text(link + "\n")
    for i, (gid, typ) in enumerate(gids):
        (base / "gids" / str(i)).write_text(gid + "\n")
        (base / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")
        (base / "gid_attrs" / "ndevs" / str(i)).write_text("eth0\n")
    for i in range(len(gids), len(gids) + 2):  # unused entries are zero, as in the kernel
        (base / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")


def _ip(a: int, b: int, c: int, d: int) -> str:
    return f"{MAPPED}:{a:02x}{b:02x}:{c:02x}{d:02x}"


def test_probe_says_why_not_here() -> None:
    if VerbsTransport.probe() is not None:
        pytest.skip("this machine has a usable RDMA port")
    usable, unusable = probe_all(["verbs", "tcp"])
    assert "verbs" not in usable and "tcp" in usable
    reason = unusable["verbs"]
    assert reason == VerbsTransport.unavailable_reason()
    assert "pyverbs is not installed" in reason or "RDMA" in reason, reason


async def test_path_reports_why_verbs_was_passed_over() -> None:
    if VerbsTransport.probe() is not None:
        pytest.skip("this machine has a usable RDMA port")
    async with (
        tensorwire.start("127.0.0.1:0", transports=("verbs", "tcp")) as na,
        tensorwire.start("127.0.0.1:0", transports=("verbs", "tcp")) as nb,
    ):
        a = await na.connect(nb.address)
        assert a.path.transport == "tcp"
        why = dict(a.path.passed_over)["verbs"]
        assert VerbsTransport.unavailable_reason() in why, why
        with pytest.raises(tensorwire.NegotiationError, match="verbs"):
            await na.connect(nb.address, require="rdma")
        await a.send(np.arange(3))
        b = await nb.accept()
        assert np.array_equal(await b.recv(), np.arange(3))


def test_gid_choice_prefers_roce_v2_ipv4_mapped(tmp_path: Path) -> None:
    _port(
        tmp_path,
        "rxe0",
        1,
        [
            ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2"),  # link-local: index 0, not routable
            (_ip(10, 0, 0, 1), "IB/RoCE v1"),
            (_ip(10, 0, 0, 1), "RoCE v2"),
            (_ip(192, 168, 1, 5), "RoCE v2"),
        ],
    )
    assert choose_gid(str(tmp_path), "rxe0", 1)[0] == 2  # first v2 IPv4-mapped, not index 0
    assert choose_gid(str(tmp_path), "rxe0", 1, "192.168.1.5")[0] == 3  # the node's own address
    assert choose_gid(str(tmp_path), "rxe0", 1, "10.9.9.9")[0] == 2
    port = choose_port("192.168.1.5", root=str(tmp_path))
    assert not isinstance(port, str)
    assert (port.device, port.gid_index, port.gid_type) == ("rxe0", 3, "RoCE v2")
    assert port.gid == bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 5])


def test_gid_choice_without_v2_or_on_infiniband(tmp_path: Path) -> None:
    _port(tmp_path, "roce0", 1, [(_ip(10, 0, 0, 1), "IB/RoCE v1")])
    assert choose_gid(str(tmp_path), "roce0", 1) is None
    assert "no RoCE v2 GID" in str(choose_port(root=str(tmp_path)))
    _port(tmp_path, "mlx5_0", 1, [("fe80:0000:0000:0000:0002:c903:0001:0002", "IB/RoCE v1")], link="InfiniBand")
    port = choose_port(root=str(tmp_path))
    assert not isinstance(port, str) and port.device == "mlx5_0" and port.gid_index == 0 and not port.roce
    assert "no RDMA device" in str(choose_port(root=str(tmp_path / "none")))
    assert "no RDMA port" in str(choose_port(root=str(tmp_path), want="mlx5_0:2"))


def test_a_wildcard_bootstrap_host_is_dialled_at_the_host_whose_control_plane_answered() -> None:
    from tensorwire.transports import Capabilities, Limits, TransportContext

    transport = VerbsTransport(TransportContext("n", "127.0.0.1", Limits()), Capabilities())
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 2, 15])
    for wildcard in ("0.0.0.0", "::"):
        offer = Offer(1, True, 1, 0, 3, gid, wildcard, 40001)
        assert Offer.unpack(transport.dial_address(offer.pack(), "10.0.2.15")).host == "10.0.2.15"
        assert Offer.unpack(transport.dial_address(offer.pack(), "[fd00::5]")).host == "fd00::5"
    named = Offer(1, True, 1, 0, 3, gid, "10.0.2.16", 40001).pack()
    assert transport.dial_address(named, "10.0.2.15") == named
    assert transport.dial_address(b"garbage", "10.0.2.15") == b"garbage"  # connect says what is wrong
    wild = Offer(1, True, 1, 0, 3, gid, "0.0.0.0", 40001).pack()
    assert transport.dial_address(wild, "a" * 300) == wild  # (no host an offer can carry)


def test_offer_and_qp_info_round_trip_and_reject_garbage() -> None:
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 2, 15])
    offer = Offer(1, True, 1, 0, 3, gid, "10.0.2.15", 40001)
    assert Offer.unpack(offer.pack()) == offer
    for bad in (b"", b"TWU1" + bytes(40), offer.pack()[:-3], offer.pack()[:20]):
        with pytest.raises(ProtocolError):
            Offer.unpack(bad)
    info = QpInfo(0x1234, 0xABCDE, 1, 0, 3, 1, 64, 16384, gid)
    assert QpInfo.unpack(info.pack()) == info
    with pytest.raises(ProtocolError):
        QpInfo.unpack(QpInfo(0, 1, 1, 0, 3, 1, 64, 16384, gid).pack())  # qpn 0
    with pytest.raises(ProtocolError):
        QpInfo.unpack(QpInfo(5, 1, 1, 0, 3, 1, 1, 16384, gid).pack())  # a ring of one slot


def test_an_offer_host_that_is_not_ascii_is_a_protocol_error_and_a_name_is_sent_as_idna() -> None:
    """The host in a peer's offer was decoded as UTF-8 with errors replaced: a byte that is no
    UTF-8 (0xff) came through as the host "\ufffd", which connect then passed to the resolver
    (a bare UnicodeError), and a multi-byte host was called "truncated". Names travel as ASCII
    (an internationalised name as its IDNA form); one the offer cannot carry is a
    ConfigurationError where the node makes it, not a struct.error."""
    from tensorwire.errors import ConfigurationError

    gid = bytes(16)
    head = Offer(1, True, 1, 0, 3, gid, "x", 40001).pack()[:-2]  # up to the host's length
    for host in (b"\xff", b"h\xc3\xa9", b"a\x00b", b"\x80" * 4):
        with pytest.raises(ProtocolError, match="host"):
            Offer.unpack(head + bytes([len(host)]) + host)
    named = Offer(1, True, 1, 0, 3, gid, "bücher.example", 40001)
    assert Offer.unpack(named.pack()).host == "xn--bcher-kva.example"
    for host in ("a" * 300, "a\udcffb"):
        with pytest.raises(ConfigurationError, match="verbs"):
            Offer(1, True, 1, 0, 3, gid, host, 40001).pack()


async def test_an_offer_host_the_resolver_cannot_encode_is_a_connect_error() -> None:
    """An offer's host that unpacks (ASCII) but that the resolver refuses (an empty label:
    "a..b") raised a bare UnicodeError out of connect; the tcp transport says ConnectError."""
    from tensorwire.errors import ConnectError
    from tensorwire.transports import Capabilities, TransportContext
    from tensorwire.transports._base import Session

    transport = VerbsTransport(TransportContext("n", "127.0.0.1", Limits()), Capabilities())
    transport.port = SimpleNamespace(roce=True)  # type: ignore[assignment]  # (accepts() asks only this)
    address = Offer(1, True, 1, 0, 3, bytes(16), "a..b", 40001).pack()
    session = Session("sid", b"k" * 32, "n", "peer", Limits())
    with pytest.raises(ConnectError, match=r"a\.\.b"):
        await transport.connect(address, session)


# -- the channel's protocol over a queue pair in memory -------------------------------------------
# VerbsChannel as it is, over a stand-in for QueuePair: a SEND lands, in order and after a delay
# of the test's choosing, in the next receive slot the peer posted (a SEND with no slot posted
# is counted as an RNR, which the ring credit promises never happens); RDMA READ and WRITE copy
# the bytes. What needs real verbs (registration, completion events, rxe) is tested in the guest.


class _WC:
    __slots__ = ("byte_len", "status", "wr_id")

    def __init__(self, wr_id: int, byte_len: int = 0, status: int = 0) -> None:
        self.wr_id, self.byte_len, self.status = wr_id, byte_len, status


class _FakeQP:
    def __init__(self, slots: int, slot_bytes: int = 16 * 1024, send_slots: int = 32) -> None:
        self.slots, self.slot_bytes, self.send_slots = slots, slot_bytes, send_slots
        self.port = SimpleNamespace(device="fake0", port=1)
        self.send_view = np.zeros(send_slots * slot_bytes, np.uint8)
        self.recv_view = np.zeros(slots * slot_bytes, np.uint8)
        self.posted: deque[int] = deque(range(slots))  # receive slots posted, in order
        self.peer: _FakeQP
        self.channel: VerbsChannel
        self.delay: Callable[[], float] = lambda: 0.0  # how long a SEND is on the wire
        self.hold = False  # keep SENDs and RDMA completions back until released
        self.closed = False
        self.rnr = 0
        self.rdma_posted = 0
        self._wire: deque[tuple[int, np.ndarray]] = deque()  # SENDs on their way to the peer, in order
        self._held: list[Callable[[], None]] = []

    def start(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def _check(self) -> None:
        if self.closed:
            raise BrokenResourceError("verbs queue pair is closed")

    def slot_view(self, slot: int, nbytes: int) -> np.ndarray:
        off = slot * self.slot_bytes
        return self.recv_view[off : off + nbytes]

    def post_recv(self, slot: int) -> None:
        self._check()
        self.posted.append(slot)

    def post_send(self, wr_id: int, slot: int, nbytes: int) -> None:
        self._check()
        off = slot * self.slot_bytes
        self._wire.append((wr_id, self.send_view[off : off + nbytes].copy()))
        self._later(self._land)

    def post_rdma(self, wr_id: int, read: bool, laddr: int, lkey: int, n: int, raddr: int, rkey: int) -> None:
        self._check()
        self.rdma_posted += 1

        def done() -> None:
            if not self.closed:
                ctypes.memmove(laddr, raddr, n) if read else ctypes.memmove(raddr, laddr, n)
                self.channel._completions([_WC(wr_id)])

        self._later(done)

    def _later(self, fn: Callable[[], None]) -> None:
        if self.hold:
            self._held.append(fn)
        else:
            asyncio.get_running_loop().call_later(self.delay(), fn)

    def release(self) -> None:
        self.hold = False
        held, self._held = self._held, []
        for fn in held:
            self._later(fn)

    def _land(self) -> None:
        """The SEND at the head of the wire (each call lands one: the order is kept)."""
        if self.closed or self.peer.closed:
            return
        wr_id, data = self._wire.popleft()
        peer = self.peer
        if not peer.posted:
            self.rnr += 1  # the hardware would retry: so do we
            self._wire.appendleft((wr_id, data))
            asyncio.get_running_loop().call_later(0.001, self._land)
            return
        slot = peer.posted.popleft()
        peer.recv_view[slot * peer.slot_bytes : slot * peer.slot_bytes + len(data)] = data
        peer.channel._completions([_WC(slot, len(data))])
        self.channel._completions([_WC(wr_id)])


class _FakeMemory:
    def cached(self, arr: np.ndarray, access: int) -> bool:
        return True  # (registering is free here: nothing to fault in off the loop first)

    def acquire(self, arr: np.ndarray, access: int) -> Any:
        return SimpleNamespace(lkey=1, rkey=2)

    def release(self, region: Any) -> None:
        pass


_PV = SimpleNamespace(
    enums=SimpleNamespace(IBV_ACCESS_REMOTE_READ=4, IBV_ACCESS_LOCAL_WRITE=1),
    pyverbs_error=SimpleNamespace(PyverbsError=type("PyverbsError", (Exception,), {})),
)


def _channels(
    monkeypatch: pytest.MonkeyPatch, limits: tuple[Limits, Limits] = (Limits(), Limits()), slots: int = 64
) -> tuple[VerbsChannel, VerbsChannel]:
    """Two VerbsChannels joined by _FakeQPs (call it with the loop running)."""
    monkeypatch.setattr(_channel, "pv", lambda: _PV)
    qps = (_FakeQP(slots), _FakeQP(slots))
    qps[0].peer, qps[1].peer = qps[1], qps[0]
    out = []
    for i, (qp, mine, theirs) in enumerate(zip(qps, limits, reversed(limits), strict=True)):
        remote = PeerLimits(
            theirs.recv_buffer_bytes, theirs.max_unexpected, theirs.max_message_bytes, theirs.max_header_bytes
        )
        ch = VerbsChannel(
            qp,  # type: ignore[arg-type]
            _FakeMemory(),  # type: ignore[arg-type]
            limits=mine,
            remote=remote,
            remote_slots=slots,
            remote_slot_bytes=qp.slot_bytes,
            max_rdma=32,
            max_msg=1 << 30,
            name="ab"[i],
            on_shutdown=lambda: None,
        )
        qp.channel = ch
        out.append(ch)
    return out[0], out[1]


def _qp(ch: VerbsChannel) -> _FakeQP:
    qp = ch._qp
    assert isinstance(qp, _FakeQP)
    return qp


async def _recv(ch: VerbsChannel, tag: int) -> Any:
    got, _ = await ch.recv(tag, None)
    return got


async def _quiet(*chs: VerbsChannel) -> None:
    """Wait until no frame has gone out for a while (reports owed are sent within 1 ms), then
    check it stays so: no side answers CREDIT frames with CREDIT frames for ever."""
    counts = None
    while counts != (now := [c.stats["frames_out"] for c in chs]):
        counts = now
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert [c.stats["frames_out"] for c in chs] == counts, "CREDIT frames keep going back and forth"


async def test_credit_frames_are_reported_too_so_a_slow_consumer_can_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """b sends a burst, then waits for a's answer; a takes the messages some ms apart, each
    recv's credit going back in a CREDIT frame of its own. Those frames take slots of b's ring:
    b reports them (lazily), so a's answer finds room."""
    a, b = _channels(monkeypatch)
    n = 90
    for i in range(n):
        await b.send(1, prepare(np.arange(4) + i))
    for i in range(n):
        assert (await _recv(a, 1))[0] == i
        await asyncio.sleep(0.002)
    assert a.stats["credit_frames"] >= n // 2  # the traffic this is about
    async with asyncio.timeout(5):
        await a.send(2, prepare(np.arange(3)))
        assert list(await _recv(b, 2)) == [0, 1, 2]
    await _quiet(a, b)
    # at most one CREDIT frame of b's per (slots - RESERVE) // 2 of a's
    assert b.stats["credit_frames"] <= a.stats["credit_frames"] // ((64 - _channel.RESERVE) // 2) + 3, b.stats
    assert a._ring_free() > 64 - (64 - _channel.RESERVE) // 2, "b left a's view of its ring short"
    assert _qp(a).rnr == _qp(b).rnr == 0


@pytest.mark.parametrize("slots", [8, 64])
@pytest.mark.parametrize("seed", range(3))
async def test_ring_credit_neither_deadlocks_nor_ping_pongs(
    monkeypatch: pytest.MonkeyPatch, slots: int, seed: int
) -> None:
    """Both sides send bursts of small messages to each other and consume them with random
    pauses, over a wire with random delays: every message arrives in order, no SEND ever finds
    the peer's ring empty, and once the traffic stops so do the frames."""
    rng = random.Random(seed)
    a, b = _channels(monkeypatch, slots=slots)
    for ch in (a, b):
        _qp(ch).delay = lambda: rng.choice((0.0, 0.0, 0.0002, 0.001, 0.003))
    n = 150

    async def sender(ch: VerbsChannel) -> None:
        i = 0
        while i < n:
            for _ in range(rng.randint(1, 40)):
                if i < n:
                    await ch.send(7, prepare(np.array([i, i * i])))
                    i += 1
            await asyncio.sleep(rng.choice((0, 0.001, 0.004)))

    async def receiver(ch: VerbsChannel) -> None:
        for i in range(n):
            assert list(await _recv(ch, 7)) == [i, i * i]
            if rng.random() < 0.3:
                await asyncio.sleep(rng.choice((0, 0.001, 0.003)))

    async with asyncio.timeout(20):
        await asyncio.gather(sender(a), sender(b), receiver(a), receiver(b))
    await _quiet(a, b)
    assert _qp(a).rnr == _qp(b).rnr == 0
    for ch in (a, b):  # and what they said of each other's rings is all true again
        assert ch._ring_free() > slots - max(1, (slots - _channel.RESERVE) // 2), (ch.name, ch._ring_free())


async def test_nodes_with_different_inline_bytes_understand_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Limits.inline_bytes is each sender's own choice, never traded: a channel that inlines up
    to 64 KiB and one that inlines 1 KiB take each other's messages of every size (inline, in
    FRAG frames past one slot, or read by RDMA)."""
    a, b = _channels(monkeypatch, (Limits(), Limits(inline_bytes=1024)))
    sizes = [0, 1, 1024, 1025, 8192, 16 * 1024, 40_000, 4 * a._frame_max, 4 * a._frame_max + 1, 200_000]
    for n in sizes:
        x = np.arange(n, dtype=np.uint8)
        for src, dst, inline in ((a, b, 64 * 1024), (b, a, 1024)):
            async with asyncio.timeout(5):
                receipt = await src.send(n, prepare(x))
                got, _ = await dst.recv(n, None)
            assert np.array_equal(got, x), (src.name, n)
            # a message of no bytes carries no payload with its header: "eager", as its receiver says
            assert (receipt.protocol == "inline") == (0 < n <= min(inline, 4 * a._frame_max)), (
                src.name,
                n,
                receipt.protocol,
            )
    assert a.state is b.state is ChannelState.OPEN


async def test_frag_frames_of_one_message_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent sends whose bodies span several frames (inline payloads past one slot, and
    thousands of segment descriptors) go out one message after the other, each one's FRAG frames
    and MSG back to back: the receiver, which holds one partial message at most, takes them all."""
    a, b = _channels(monkeypatch)
    _qp(a).delay = _qp(b).delay = lambda: 0.0005
    big = [np.full(40_000, i, np.uint8) for i in range(6)]
    many = [
        {"parts": [np.full(64, i, np.uint8) for _ in range(2000)]} for i in range(3)
    ]  # 128 KB, 48 KB of descriptors
    async with asyncio.timeout(10):
        sends = [a.send(1, prepare(x)) for x in big] + [a.send(2, prepare(m)) for m in many]
        receipts = await asyncio.gather(*sends, *[_recv(b, 1) for _ in big], *[_recv(b, 2) for _ in many])
    assert {r.protocol for r in receipts[:6]} == {"inline"} and {r.protocol for r in receipts[6:9]} == {"eager"}
    assert sorted(int(g[0]) for g in receipts[9:15]) == list(range(6))
    assert sorted(int(m["parts"][0][0]) for m in receipts[15:]) == list(range(3))
    assert a.state is b.state is ChannelState.OPEN


@pytest.mark.parametrize("second", ["FRAG", "MSG"])
async def test_a_new_message_amid_frag_frames_breaks_the_channel(monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    """A peer that starts message after message in FRAG frames (and never ends one) would make
    the receiver hold a partial body per message until the channel closed: the first frame of
    another message before the pending one's MSG is a protocol error."""
    a, b = _channels(monkeypatch)
    body = bytes(b._frame_max)
    b._enqueue(_channel._Out(Kind.FRAG, body, msg_id=1 << 40))
    b._enqueue(_channel._Out(Kind.FRAG, body, msg_id=1 << 40))  # the same message: fine
    await asyncio.sleep(0.01)
    assert a.state is ChannelState.OPEN and len(a._frags) == 1
    if second == "FRAG":
        b._enqueue(_channel._Out(Kind.FRAG, body, msg_id=(1 << 40) + 1))
    else:
        await b.send(3, prepare(np.arange(3)))  # a well-formed message of its own
    await asyncio.sleep(0.01)
    assert a.state is ChannelState.BROKEN and not a._frags
    assert isinstance(a.mailbox.failure, ProtocolError), a.mailbox.failure


async def test_a_get_cancelled_while_the_channel_closes_waits_for_its_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """An RDMA READ cannot be recalled: a get cancelled while aclose() waits for its BYE to go
    returns only once the queue pair is gone (no READ can land in its buffer after), and none of
    its READs still queued is posted once the channel is closing."""
    _, b = _channels(monkeypatch)
    src = np.full(1 << 20, 7, np.uint8)
    out = np.zeros_like(src)
    piece = 16 * 1024  # 64 READs: 32 posted at once, 32 queued
    items = [
        (out.ctypes.data + off, piece, src.ctypes.data + off, RemoteKey(2), out) for off in range(0, out.nbytes, piece)
    ]
    qp = _qp(b)
    qp.hold = True  # nothing completes meanwhile, the BYE's SEND included
    get = asyncio.ensure_future(b.rma_many("get", items))
    await asyncio.sleep(0)
    assert qp.rdma_posted == 32
    closing = asyncio.ensure_future(b.aclose())
    await asyncio.sleep(0)
    assert b.state is ChannelState.CLOSING
    get.cancel()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not get.done(), "a cancelled get returned while its RDMA READs were in flight"
    qp.release()  # the posted READs complete, then the BYE goes and the channel shuts down
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(get, 5)
    assert qp.closed and b.state is ChannelState.CLOSED
    assert qp.rdma_posted == 32, "RDMA READs posted after the channel began to close"
    await closing


async def test_each_operation_a_broken_channel_fails_gets_a_failure_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gets are in flight when the channel breaks. Before, both failed with the one object
    _shutdown was given: the second raise put that get's frames (and its buffer) in the
    traceback of the exception the first caller kept, so its 8 MiB stayed alive after its own
    caller let go, and each caller's traceback showed the other's frames."""
    _, b = _channels(monkeypatch)
    _qp(b).hold = True  # no READ completes

    def get(out: np.ndarray) -> asyncio.Future[None]:
        items = [(out.ctypes.data, out.nbytes, out.ctypes.data, RemoteKey(2), out)]
        return asyncio.ensure_future(b.rma_many("get", items))

    out1, out2 = np.zeros(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    gone = weakref.ref(out2)
    first, second = get(out1), get(out2)
    await asyncio.sleep(0)
    posted = _qp(b).rdma_posted
    b.fail(PeerDisconnected("the peer's connection ended"))
    assert posted > 0, "the gets were not under way"
    with pytest.raises(PeerDisconnected) as kept:  # the first caller keeps its failure
        await first
    with pytest.raises(PeerDisconnected) as other:
        await second
    assert kept.value is not other.value and "connection ended" in str(other.value)
    del out2, second, other

    await collected(gone)
    assert isinstance(kept.value, PeerDisconnected)


def test_a_queue_pair_that_cannot_be_created_is_a_connect_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyverbs failing to create the CQ or QP (the device's limits, memory for the queues) is a
    ConnectError naming the device, never a PyverbsError, and what was created is closed."""
    from tensorwire.errors import ConnectError
    from tensorwire.transports.verbs import _queue

    error = _PV.pyverbs_error.PyverbsError
    r, w = os.pipe()
    closed: list[str] = []

    class Channel:
        fd = r

        def close(self) -> None:
            closed.append("channel")

    def cq(*args: Any) -> None:
        raise error("Failed to create CQ. Errno: 12, Cannot allocate memory")

    fake = SimpleNamespace(**vars(_PV), cq=SimpleNamespace(CompChannel=lambda ctx: Channel(), CQ=cq))
    monkeypatch.setattr(_queue, "pv", lambda: fake)
    port = SimpleNamespace(device="fake0", port=1)
    try:
        with pytest.raises(ConnectError, match="verbs: cannot set up a queue pair on fake0:1: Failed to create CQ"):
            _queue.QueuePair(
                None,
                None,
                port,  # type: ignore[arg-type]
                lid=0,
                mtu=3,
                slots=8,
                slot_bytes=4096,
                send_slots=4,
                max_rdma=4,
                rd_atomic=1,
                on_completions=lambda wcs: None,
            )
        assert closed == ["channel"]
    finally:
        os.close(r)
        os.close(w)


def test_a_torch_tensor_sent_again_is_registered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch tensor's numpy view (``t.numpy()``) has a new alias tensor of its own for its
    ``base`` each time, which the registration cache took for the memory's owner: each send of
    the same tensor found no registration, registered it again and deregistered it once the
    message was gone (an ``ibv_reg_mr`` on the loop per send, where docs/verbs.md promised one per
    tensor). Its owner is the tensor's storage, which is the same object for as long as it
    lives, and which cannot be resized once numpy has a view of it. (The registrations here are
    stand-ins that count: registering needs an RDMA device, the guest has no torch.)"""
    torch = pytest.importorskip("torch")
    live: list[object] = []

    class MR:
        def __init__(self, pd: object, length: int, access: int, address: int) -> None:
            self.lkey = self.rkey = 1
            live.append(self)

        def close(self) -> None:
            live.remove(self)

    monkeypatch.setattr(
        _memory, "pv", lambda: SimpleNamespace(mr=SimpleNamespace(MR=MR), pyverbs_error=_PV.pyverbs_error)
    )
    cache = _memory.MemoryCache(None)
    t = torch.arange(1 << 18, dtype=torch.int32)
    for _ in range(3):
        msg = prepare(t)
        cache.release(cache.acquire(msg.arrays[0], 4))
        del msg
        gc.collect()
    assert (cache.registrations, cache.hits) == (1, 2), (cache.registrations, cache.hits)
    assert len(live) == 1 and len(cache) == 1
    row = prepare(t[1024:2048])  # a view of it: the same storage, inside the same registration
    cache.release(cache.acquire(row.arrays[0], 4))
    assert cache.registrations == 1
    del row, t
    gc.collect()
    assert not live and not len(cache), "the tensor is gone, and its registration stayed"


def test_an_owner_dying_while_the_cache_evicts_is_deregistered_and_counted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cached registration's owner can die at any allocation (the garbage collector finds it
    in a cycle), deregistering its entries from the finalizer (``_owner_died``) while the cache
    is part way through evicting a list it copied, which held that owner's entry too: the
    eviction then dropped it again and took its bytes off ``pinned`` a second time, so the cache
    counted fewer pinned bytes than it held (120 held, 88 counted here) and pinned past its
    bound before evicting. (Stand-in registrations; the collection runs inside deregistering.)"""
    live: dict[object, int] = {}

    class MR:
        def __init__(self, pd: object, length: int, access: int, address: int) -> None:
            self.lkey = self.rkey = 1
            live[self] = length

        def close(self) -> None:
            live.pop(self, None)
            gc.collect()  # (what any allocation in ibv_dereg_mr's wrapper may do)

    monkeypatch.setattr(
        _memory, "pv", lambda: SimpleNamespace(mr=SimpleNamespace(MR=MR), pyverbs_error=_PV.pyverbs_error)
    )
    cache = _memory.MemoryCache(None, max_bytes=100)
    a, b, c = np.zeros(64, np.uint8), np.zeros(32, np.uint8), np.zeros(120, np.uint8)
    cache.release(cache.acquire(a, 4))
    cache.release(cache.acquire(b, 4))
    cycle: list[Any] = [b]
    cycle.append(cycle)  # b's owner is now garbage in a cycle: it dies at the next collection
    gone = weakref.ref(b)
    del b, cycle
    held = cache.acquire(c, 4)  # over the bound: evicts a, whose deregistration collects b
    assert gone() is None
    assert cache.pinned == sum(live.values()) == 120, (cache.pinned, sorted(live.values()))
    cache.release(held)
    cache.close()
    assert not live


async def test_a_get_cancelled_while_its_memory_is_faulted_in_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get into memory not registered yet has a worker thread fault it in first, which changes
    no byte and keeps the array alive meanwhile; nothing is posted until it ends. A get
    cancelled meanwhile (its caller's deadline) waited for the whole fault-in all the same
    (``wait_out``): 3.5 s for 256 MiB in the emulated guest, however short the deadline.
    (The fault-in here blocks until the test lets it go.)"""
    import threading

    _, b = _channels(monkeypatch)
    go = threading.Event()
    started = threading.Event()

    def slow_fault_in(arrays: list[np.ndarray]) -> None:
        started.set()
        go.wait(10)

    monkeypatch.setattr(_channel, "fault_in", slow_fault_in)
    monkeypatch.setattr(b._mem, "cached", lambda arr, access: False)  # (nothing registered yet)
    src = np.full(2 << 20, 7, np.uint8)
    out = np.zeros_like(src)
    get = asyncio.ensure_future(b.rma_many("get", [(out.ctypes.data, out.nbytes, src.ctypes.data, RemoteKey(2), out)]))
    try:
        await eventually(started.is_set)
        get.cancel()
        done, _ = await asyncio.wait([get], timeout=2)
        assert done, "a cancelled get waited for its memory to be faulted in"
        assert get.cancelled() and _qp(b).rdma_posted == 0
    finally:
        go.set()
        await asyncio.wait([get], timeout=5)
    assert not out.any()


@pytest.mark.parametrize("protocol", ["eager", "rendezvous"])
async def test_a_recv_cancelled_while_its_memory_is_faulted_in_gives_the_message_back_unread(
    monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    """A recv into out= not registered yet has a worker thread fault it in before any RDMA READ
    is posted. Cancelled meanwhile, it waited for the whole fault-in and the READs, and the
    message was then copied out of out= (out= written after all). Now the message goes back
    unread (``take_back``): the cancel ends with out= untouched, the next recv gets the message
    whole into its own out=, and the send completes. The first fault-in, ending while the
    message is read again (its memory faulted in: the next recv's out=, or, eager, a buffer of
    ours), posts no READ into the cancelled recv's out=. (Each of the two fault-ins blocks
    until the test lets it go.)"""
    import threading

    a, b = _channels(monkeypatch, (Limits(), Limits(recv_buffer_bytes=0 if protocol == "rendezvous" else 64 << 20)))
    gates = [threading.Event(), threading.Event()]
    calls: list[int] = []

    def held_fault_in(arrays: list[np.ndarray]) -> None:
        k = len(calls)
        calls.append(k)
        if k < len(gates):
            gates[k].wait(10)

    monkeypatch.setattr(_channel, "fault_in", held_fault_in)
    monkeypatch.setattr(b._mem, "cached", lambda arr, access: False)  # (nothing registered yet)
    ran = watch_post_reads(monkeypatch, b)
    qp = _qp(b)
    src = (np.arange(2 << 20) % 251).astype(np.uint8)
    out = np.zeros_like(src)
    first = asyncio.ensure_future(b.recv(5, out))
    await eventually(lambda: b.mailbox.has_posted(5))  # (an eager message then lands in out=)
    send = asyncio.ensure_future(a.send(5, prepare(src)))
    again = np.zeros_like(src)
    try:
        await eventually(lambda: len(calls) == 1)
        (stale,) = b._incoming.values()
        assert stale.arrival.protocol == protocol and qp.rdma_posted == 0
        first.cancel()
        done, _ = await asyncio.wait([first], timeout=5)
        assert done, "a recv cancelled while its memory was faulted in waited for it"
        assert first.cancelled() and not out.any() and not send.done() and qp.rdma_posted == 0
        second = asyncio.ensure_future(b.recv(5, again))
        await eventually(lambda: len(calls) == 2)  # the message is read again: its memory is faulted in
        gates[0].set()
        await eventually(lambda: stale in ran)  # the first fault-in has ended
        assert qp.rdma_posted == 0, "READs posted into the cancelled recv's out="
        gates[1].set()
        async with asyncio.timeout(5):
            await second
            await send
    finally:
        for g in gates:
            g.set()
        if not send.done():  # (a cancelled send waits for its FIN: the channel's end ends it)
            a.abort()
            await asyncio.wait([send], timeout=5)
    assert np.array_equal(again, src) and not out.any()
    assert not b._incoming and not b._waiting and a.state is b.state is ChannelState.OPEN


async def test_a_recv_cancelled_while_faulting_in_a_message_its_sender_asked_back_reads_it_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sender's ABORT for a message being read (its memory faulted in) is ignored: the read
    goes on and its FIN ends the send. A recv of it cancelled then does not give it back
    unread (``take_back``), which would leave the cancelled send waiting for a FIN only another
    recv would send: it is read whole, as before, and delivered to the next recv."""
    import threading

    a, b = _channels(monkeypatch, (Limits(), Limits(recv_buffer_bytes=0)))
    go = threading.Event()
    monkeypatch.setattr(_channel, "fault_in", lambda arrays: go.wait(10))
    monkeypatch.setattr(b._mem, "cached", lambda arr, access: False)  # (nothing registered yet)
    src = (np.arange(2 << 20) % 251).astype(np.uint8)
    out = np.zeros_like(src)
    send = asyncio.ensure_future(a.send(5, prepare(src)))
    first = asyncio.ensure_future(b.recv(5, out))
    try:
        await eventually(lambda: bool(b._incoming))
        (entry,) = b._incoming.values()
        send.cancel()
        await eventually(lambda: entry.asked_back)
        first.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not first.done(), "a message its sender asked back was given back unread"
        go.set()
        async with asyncio.timeout(5):
            with pytest.raises(asyncio.CancelledError):
                await first
            with pytest.raises(asyncio.CancelledError):
                await send  # (read whole: its FIN came)
            got, _ = await b.recv(5, None)
    finally:
        go.set()
        if not send.done():  # (a cancelled send waits for its FIN: the channel's end ends it)
            a.abort()
            await asyncio.wait([send], timeout=5)
    assert np.array_equal(got, src)
    assert not b._incoming and not b._waiting and a.state is b.state is ChannelState.OPEN
