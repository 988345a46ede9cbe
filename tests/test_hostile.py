"""Hostile input on the staged-TCP data port: one bad connection is dropped, the node keeps serving.

Every test runs two honest nodes joined over tcp that keep exchanging and verifying tensors before,
during and after the attack. The attacker speaks the wire format itself (48-byte frame headers,
CHALLENGE / HELLO / WELCOME) over real loopback sockets; for attacks after authentication it gets
a genuine session from the control plane's Handshake RPC and proves the secret like a client would.

The frame layout and the HMAC proof are rebuilt here from the documented format rather than taken
from tensorwire, so that a change in the wire format shows up as a failing test.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import struct
import time
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

import tensorwire
from tensorwire.control import PROTOCOL_VERSION, _server
from tensorwire.control._pb import control_pb2, control_pb2_grpc, wire_pb2
from tensorwire.errors import ProtocolError, TensorWireError
from tensorwire.testing import peak_allocation
from tensorwire.transports import Capabilities, ChannelState, TransportContext
from tensorwire.transports._credit import OWN_TAGS
from tensorwire.transports.tcp import TcpTransport

# -- the wire format, as documented in tensorwire/transports/_frames.py ---------------------------
FRAME = struct.Struct("<4sBBHIQQqQI")
LIMITS = struct.Struct("<QIQII")
MAGIC = b"TWR1"
CHALLENGE, HELLO, WELCOME, MSG, CTS, DATA, ABORT, CREDIT, BYE = range(1, 10)
RENDEZVOUS, CHECKSUM = 1, 2
NONCE = 32
assert FRAME.size == 48

TRANSPORT_LOG = "tensorwire.transports.tcp._transport"
CHANNEL_LOG = "tensorwire.transports.tcp._channel"
MiB = 1 << 20
PEAK_BUDGET = 32 * MiB  # what a hostile claim may make the process allocate, at most


def frame(
    ftype: int,
    *,
    flags: int = 0,
    meta_len: int = 0,
    payload_len: int = 0,
    msg_id: int = 0,
    arg: int = 0,
    credit: int = 0,
    slots: int = 0,
    magic: bytes = MAGIC,
    reserved: int = 0,
) -> bytes:
    return FRAME.pack(magic, ftype, flags, reserved, meta_len, payload_len, msg_id, arg, credit, slots)


def mac(secret: bytes, nonce: bytes, sid: bytes, role: bytes) -> bytes:
    return hmac.new(secret, b"tensorwire-data-v1|" + role + b"|" + nonce + b"|" + sid, hashlib.sha256).digest()


def hello(
    secret: bytes, nonce: bytes, sid: bytes, limits: tuple[int, ...] = (8 * MiB, 64, 64 * MiB, 64 * 1024, 0)
) -> bytes:
    """A HELLO frame proving ``secret`` for ``sid``, with modest limits of our own."""
    meta = mac(secret, nonce, sid, b"client") + LIMITS.pack(*limits) + sid
    return frame(HELLO, meta_len=len(meta)) + meta


def message_header(arr: np.ndarray) -> bytes:
    spec = wire_pb2.TensorSpec(
        dtype=str(arr.dtype),
        shape=list(arr.shape),
        strides=[s // arr.itemsize for s in arr.strides],
        device="cpu",
        framework="numpy",
        nbytes=arr.nbytes,
    )
    return wire_pb2.MessageHeader(tensors=[spec], tree=wire_pb2.TreeNode(tensor=0)).SerializeToString()


def claim_header(dtype: str, shape: list[int], nbytes: int | None = None) -> bytes:
    """A header for one tensor that is never sent: only its claimed size matters."""
    itemsize = np.dtype(dtype).itemsize
    n = int(np.prod(shape, dtype=object)) * itemsize if nbytes is None else nbytes
    spec = wire_pb2.TensorSpec(dtype=dtype, shape=shape, device="cpu", framework="numpy", nbytes=n)
    return wire_pb2.MessageHeader(tensors=[spec], tree=wire_pb2.TreeNode(tensor=0)).SerializeToString()


def eager(arr: np.ndarray, *, tag: int, msg_id: int) -> bytes:
    """A valid eager message: MSG frame with the whole payload inline."""
    meta = message_header(arr)
    return frame(MSG, meta_len=len(meta), payload_len=arr.nbytes, msg_id=msg_id, arg=tag) + meta + arr.tobytes()


# -- a raw connection to a data port ----------------------------------------------------------------
class Raw:
    """One loopback connection to a node's tcp data port, driven byte by byte."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.port = writer.get_extra_info("sockname")[1]

    @classmethod
    async def open(cls, address: bytes) -> Raw:
        host, _, port = address.decode().rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer)

    @property
    def who(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def read_frame(self) -> tuple[Any, ...]:
        raw = await asyncio.wait_for(self.reader.readexactly(FRAME.size), 5)
        return FRAME.unpack(raw)

    async def challenge(self) -> bytes:
        magic, ftype, flags, reserved, meta_len, payload_len, *_ = await self.read_frame()
        assert (magic, ftype, flags, reserved, meta_len, payload_len) == (MAGIC, CHALLENGE, 0, 0, 0, NONCE)
        return await asyncio.wait_for(self.reader.readexactly(NONCE), 5)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def closed_by_server(self, within: float = 5.0) -> float:
        """Read (and discard) until the server closes the connection; seconds it took."""
        t0 = time.monotonic()

        async def drain() -> None:
            try:
                while await self.reader.read(1 << 16):
                    pass
            except ConnectionError:  # a reset is a close too
                pass

        try:
            await asyncio.wait_for(drain(), within)
        except TimeoutError:
            pytest.fail(f"the node kept the hostile connection {self.who} open for {within} s")
        return time.monotonic() - t0

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def raw(address: bytes) -> AsyncIterator[Raw]:
    r = await Raw.open(address)
    try:
        yield r
    finally:
        await r.aclose()


# -- honest traffic ---------------------------------------------------------------------------------
def same(x: Any, y: Any) -> bool:
    if isinstance(x, np.ndarray):
        return (
            isinstance(y, np.ndarray)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.tobytes() == np.ascontiguousarray(y).tobytes()
        )
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


@dataclass
class Traffic:
    rounds: int = 0
    task: asyncio.Task[None] | None = None

    async def beyond(self, n: int, within: float = 5.0) -> None:
        """Wait until more than ``n`` verified round trips have completed."""
        deadline = time.monotonic() + within
        while self.rounds <= n:
            if self.task is not None and self.task.done():
                self.task.result()  # the honest exchange failed: raise why
                pytest.fail("honest traffic stopped")
            if time.monotonic() > deadline:
                pytest.fail(f"honest traffic stalled at {self.rounds} round trips (wanted > {n})")
            await asyncio.sleep(0.01)


@dataclass
class Env:
    server: tensorwire.Node
    client: tensorwire.Node
    a: tensorwire.Peer  # client -> server
    b: tensorwire.Peer  # the server's side of it
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(1234))
    sent: int = 0

    @property
    def data_address(self) -> bytes:
        return self.server.offers["tcp"].address

    def _payload(self) -> dict[str, Any]:
        self.sent += 1
        n = int(self.rng.integers(1, 1 << 15))
        return {
            "i": self.sent,
            "x": self.rng.standard_normal(n).astype(np.float32),
            "y": (self.rng.integers(0, 255, size=(3, 5), dtype=np.uint8), "tail"),
        }

    async def round_trip(self, a: tensorwire.Peer | None = None, b: tensorwire.Peer | None = None) -> None:
        a, b = a or self.a, b or self.b
        x, y = self._payload(), self._payload()
        _, _, got_x, got_y = await asyncio.wait_for(
            asyncio.gather(a.send(x, tag="ping"), b.send(y, tag="pong"), b.recv(tag="ping"), a.recv(tag="pong")),
            10,
        )
        assert same(x, got_x), "honest tensor corrupted a -> b"
        assert same(y, got_y), "honest tensor corrupted b -> a"

    @contextlib.asynccontextmanager
    async def background(self) -> AsyncIterator[Traffic]:
        """Honest round trips in a loop while the body runs; their failure fails the test."""
        traffic = Traffic()
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await self.round_trip()
                traffic.rounds += 1
                await asyncio.sleep(0)

        traffic.task = asyncio.get_running_loop().create_task(loop())
        try:
            yield traffic
        finally:
            stop.set()
            await asyncio.wait_for(traffic.task, 10)

    async def still_serving(self) -> None:
        """The honest channel is open and exchanging, and a brand-new connection works too."""
        await self.round_trip()
        assert self.a.channel.state is ChannelState.OPEN
        assert self.b.channel.state is ChannelState.OPEN
        fresh_a = await asyncio.wait_for(self.client.connect(self.server.address), 10)
        fresh_b = await asyncio.wait_for(self.server.accept(), 10)
        try:
            await self.round_trip(fresh_a, fresh_b)
        finally:
            await fresh_a.aclose()
            await fresh_b.aclose()
        await self.round_trip()


@contextlib.asynccontextmanager
async def honest_pair(limits: tensorwire.Limits | None = None, *, lease_seconds: float = 30.0) -> AsyncIterator[Env]:
    """A server node under attack and a client node joined to it over tcp. The long lease makes
    sure nothing but the attack can break a session during a test."""
    lim = limits or tensorwire.Limits(handshake_seconds=5.0)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), limits=lim, lease_seconds=lease_seconds) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=lease_seconds) as client,
    ):
        a = await asyncio.wait_for(client.connect(server.address), 10)
        b = await asyncio.wait_for(server.accept(), 10)
        env = Env(server, client, a, b)
        await env.round_trip()  # before the attack
        yield env


# -- log and memory checks -------------------------------------------------------------------------
async def logged(
    caplog: pytest.LogCaptureFixture, logger: str, start: str, reason: str = "", within: float = 5.0
) -> logging.LogRecord:
    """Wait for a WARNING (or worse) from ``logger`` that starts with ``start`` and says ``reason``."""
    deadline = time.monotonic() + within
    while True:
        for r in caplog.records:
            msg = r.getMessage()
            if r.name == logger and r.levelno >= logging.WARNING and msg.startswith(start) and reason in msg:
                return r
        if time.monotonic() > deadline:
            seen = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.INFO]
            pytest.fail(f"no warning {start!r}...{reason!r} from {logger}; log was:\n" + "\n".join(seen))
        await asyncio.sleep(0.01)


def drop_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == TRANSPORT_LOG
        and r.levelno == logging.WARNING
        and r.getMessage().startswith("dropped tcp data connection from")
    ]


# == attacks before authentication =================================================================
async def _attack_pre_auth(
    env: Env,
    caplog: pytest.LogCaptureFixture,
    attack: Callable[[Raw], Awaitable[None]],
    reason: str,
    *,
    within: float = 2.0,
) -> float:
    """Run ``attack`` on a fresh raw connection while honest traffic flows; check that the node
    closes that connection (within ``within`` s), warns about it, and keeps serving."""
    async with env.background() as traffic:
        async with raw(env.data_address) as r:
            start = traffic.rounds
            t0 = time.monotonic()
            await attack(r)
            await r.closed_by_server(within=within + 3)
            took = time.monotonic() - t0
            await logged(caplog, TRANSPORT_LOG, f"dropped tcp data connection from {r.who}: ", reason)
            assert took < within, f"closing the hostile connection took {took:.2f} s"
        await traffic.beyond(start + 3)  # honest round trips went on
    await env.still_serving()
    return took


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefix", [b"", MAGIC], ids=["random", "magic-then-random"])
async def test_random_garbage_is_dropped(caplog: pytest.LogCaptureFixture, seed: int, prefix: bytes) -> None:
    garbage = prefix + random.Random(seed).randbytes(4096)
    assert not (prefix == b"" and garbage.startswith(MAGIC))

    async def attack(r: Raw) -> None:
        await r.send(garbage)  # without even reading the CHALLENGE

    async with honest_pair() as env:
        await _attack_pre_auth(env, caplog, attack, "")
        (rec,) = drop_warnings(caplog)
        reason = rec.getMessage().split(": ", 1)[1]
        # rejected for what it is, not because it timed out or hung up
        assert any(k in reason for k in ("magic", "frame type", "reserved", "expected HELLO")), reason


async def test_bad_magic_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    async def attack(r: Raw) -> None:
        await r.challenge()
        sid = uuid.uuid4().hex.encode()
        good = hello(b"x" * 32, b"\0" * NONCE, sid)
        await r.send(b"TWR2" + good[4:])

    async with honest_pair() as env:
        await _attack_pre_auth(env, caplog, attack, "bad frame magic")


async def test_hello_with_unknown_session_id_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    async def attack(r: Raw) -> None:
        nonce = await r.challenge()
        await r.send(hello(b"s" * 32, nonce, uuid.uuid4().hex.encode()))

    async with honest_pair() as env:
        await _attack_pre_auth(env, caplog, attack, "unknown or already used session id")


async def _control_handshake(node: tensorwire.Node, node_id: str = "") -> tuple[bytes, bytes, bytes]:
    """A genuine session from the node's control plane: (session id, secret, data address)."""
    offer = control_pb2.TransportOffer(
        name="tcp",
        version=1,
        address=b"127.0.0.1:9",  # never dialled: the client always connects to the server
        capabilities=control_pb2.Capabilities(memory_kinds=["host"], lanes=["tcp"]),
    )
    request = control_pb2.HandshakeRequest(
        node_id=node_id or f"raw-{uuid.uuid4().hex}",
        protocol_version=PROTOCOL_VERSION,
        preference=["tcp"],
        require="any",
        offers=[offer],
    )
    async with grpc.aio.insecure_channel(node.address) as ch:
        resp = await control_pb2_grpc.ControlStub(ch).Handshake(request, timeout=5)
    assert resp.chosen.name == "tcp"
    assert resp.chosen.address == node.offers["tcp"].address
    return resp.session_id.encode(), resp.session_secret, resp.chosen.address


@dataclass
class Session:
    """An authenticated raw data connection and the Peer the node made of it."""

    raw: Raw
    peer: tensorwire.Peer
    sid: bytes
    secret: bytes
    server_limits: tuple[int, ...]
    next_id: int = 1

    def msg_id(self) -> int:
        self.next_id += 1
        return self.next_id

    async def delivers(self, tag: int = 1) -> None:
        """A valid message on this raw connection reaches the node's Peer intact."""
        x = np.arange(16, dtype=np.int32) * (self.next_id + 1)
        await self.raw.send(eager(x, tag=tag, msg_id=self.msg_id()))
        got = await asyncio.wait_for(self.peer.recv(tag=tag), 5)
        assert same(x, got)


async def _authenticate(node: tensorwire.Node, r: Raw, sid: bytes, secret: bytes) -> tuple[int, ...]:
    """CHALLENGE / HELLO / WELCOME on ``r``; checks the server's proof; the server's limits."""
    nonce = await r.challenge()
    await r.send(hello(secret, nonce, sid))
    magic, ftype, _, _, meta_len, payload_len, *_ = await r.read_frame()
    assert (magic, ftype, meta_len, payload_len) == (MAGIC, WELCOME, NONCE + LIMITS.size, 0)
    meta = await asyncio.wait_for(r.reader.readexactly(meta_len), 5)
    assert hmac.compare_digest(meta[:NONCE], mac(secret, nonce, sid, b"server")), "server did not prove the secret"
    return LIMITS.unpack(meta[NONCE:])


@contextlib.asynccontextmanager
async def session(env: Env) -> AsyncIterator[Session]:
    node_id = f"raw-{uuid.uuid4().hex}"
    sid, secret, address = await _control_handshake(env.server, node_id)
    async with raw(address) as r:
        limits = await _authenticate(env.server, r, sid, secret)
        peer = await asyncio.wait_for(env.server.accept(), 5)
        assert peer.remote_node == node_id
        yield Session(r, peer, sid, secret, limits)


async def test_hello_with_forged_secret_is_dropped_and_session_survives(caplog: pytest.LogCaptureFixture) -> None:
    """Knowing a pending session id without its secret gets an attacker nothing: the forged HELLO
    is refused, and the session stays open for the client that does hold the secret."""
    async with honest_pair() as env:
        sid, secret, address = await _control_handshake(env.server)
        forged = bytes(b ^ 0x5A for b in secret)

        async def attack(r: Raw) -> None:
            nonce = await r.challenge()
            await r.send(hello(forged, nonce, sid))

        await _attack_pre_auth(env, caplog, attack, "wrong session secret")
        async with raw(address) as r:  # the rightful owner still gets in
            await _authenticate(env.server, r, sid, secret)
            peer = await asyncio.wait_for(env.server.accept(), 5)
            s = Session(r, peer, sid, secret, ())
            await s.delivers()


async def test_hello_replaying_a_used_session_id_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """Even with the right secret, a session id opens one data connection only; the first one
    is unaffected by the attempt."""
    async with honest_pair() as env, session(env) as s:
        await s.delivers()

        async def attack(r: Raw) -> None:
            nonce = await r.challenge()
            await r.send(hello(s.secret, nonce, s.sid))

        await _attack_pre_auth(env, caplog, attack, "unknown or already used session id")
        await s.delivers()
        assert s.peer.channel.state is ChannelState.OPEN


# limits no channel can keep, and what refusing them says
UNKEEPABLE_LIMITS = {
    # every send would wait for a message slot for good
    "no-message-slots": ((8 * MiB, 0, 64 * MiB, 64 * 1024, 0), "no message in flight"),
    # not even a short RPC error reply would fit (Limits.MIN_HEADER_BYTES)
    "header-bound-too-small": ((8 * MiB, 64, 64 * MiB, 1023, 0), "below the 1024-byte minimum"),
    "unknown-flags": ((8 * MiB, 64, 64 * MiB, 64 * 1024, 0x80), "unknown flags 0x80"),
}


@pytest.mark.parametrize("name", list(UNKEEPABLE_LIMITS))
async def test_hello_promising_limits_no_channel_can_keep_is_dropped(
    caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """A client holding the session secret (buggy, or hostile) that promises limits no channel
    can keep is refused at its HELLO. Before, it got a channel, and with no message slot every
    send the node made on it waited for good."""
    limits, reason = UNKEEPABLE_LIMITS[name]
    async with honest_pair() as env:
        sid, secret, _ = await _control_handshake(env.server)

        async def attack(r: Raw) -> None:
            nonce = await r.challenge()
            await r.send(hello(secret, nonce, sid, limits))

        await _attack_pre_auth(env, caplog, attack, reason)


@pytest.mark.parametrize("name", list(UNKEEPABLE_LIMITS))
async def test_welcome_promising_limits_no_channel_can_keep_fails_the_connect(name: str) -> None:
    """The same from the client's side: a server that proves the session secret and promises
    limits no channel can keep fails the connect with ConnectError saying why."""
    limits, reason = UNKEEPABLE_LIMITS[name]
    secret, sid = b"s" * 32, b"sid-1"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = bytes(range(NONCE))
        writer.write(frame(CHALLENGE, payload_len=NONCE) + nonce)
        hello_meta_len = FRAME.unpack(await reader.readexactly(FRAME.size))[4]
        await reader.readexactly(hello_meta_len)
        meta = mac(secret, nonce, sid, b"server") + LIMITS.pack(*limits)
        writer.write(frame(WELCOME, meta_len=len(meta)) + meta)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    lim = tensorwire.Limits(handshake_seconds=5)
    transport = TcpTransport(TransportContext("n", "127.0.0.1", lim), Capabilities())
    session = tensorwire.transports.Session(sid.decode(), secret, "n", "fake-server", lim)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(tensorwire.ConnectError, match=reason):
            await asyncio.wait_for(transport.connect(f"127.0.0.1:{port}".encode(), session), 10)
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "header",
    [
        frame(HELLO, meta_len=2**32 - 1, payload_len=2**40),
        frame(HELLO, meta_len=2**32 - 1),
        frame(HELLO, meta_len=120, payload_len=2**40),
        frame(MSG, meta_len=2**32 - 1, payload_len=2**40, msg_id=1),
        frame(DATA, payload_len=2**40, msg_id=1),
        frame(HELLO, meta_len=NONCE + LIMITS.size),  # no session id at all
        frame(HELLO, meta_len=NONCE + LIMITS.size + 129),  # session id past the 128-byte bound
        frame(WELCOME, meta_len=NONCE + LIMITS.size),
        frame(BYE),
    ],
    ids=["hello-huge-both", "hello-huge-meta", "hello-huge-payload", "msg-huge", "data-huge", "hello-no-sid",
         "hello-long-sid",
         "welcome", "bye"],
)  # fmt: skip
async def test_huge_or_wrong_first_frame_is_dropped_without_allocating(
    caplog: pytest.LogCaptureFixture, header: bytes
) -> None:
    async def attack(r: Raw) -> None:
        await r.challenge()
        await r.send(header)

    async with honest_pair() as env:
        with peak_allocation() as mem:
            await _attack_pre_auth(env, caplog, attack, "expected HELLO")
        assert mem["peak"] < PEAK_BUDGET, f"a hostile length claim made the node allocate {mem['peak']} bytes"


@pytest.mark.parametrize("n", [0, 1, 20, 47])
async def test_truncated_header_then_close(caplog: pytest.LogCaptureFixture, n: int) -> None:
    async with honest_pair() as env:
        async with env.background() as traffic:
            start = traffic.rounds
            r = await Raw.open(env.data_address)
            who = r.who
            await r.challenge()
            await r.send(frame(HELLO, meta_len=100)[:n])
            await r.aclose()
            await logged(caplog, TRANSPORT_LOG, f"dropped tcp data connection from {who}: ", "closed the connection")
            await traffic.beyond(start + 3)
        await env.still_serving()


@pytest.mark.parametrize("style", ["silent", "one-byte", "half-hello", "dribble"])
async def test_slow_loris_is_dropped_after_the_handshake_timeout(caplog: pytest.LogCaptureFixture, style: str) -> None:
    """Sending nothing, too little, or a byte at a time: the deadline covers the whole handshake."""
    limit = 0.5

    async def attack(r: Raw) -> None:
        if style == "one-byte":
            await r.send(b"T")
        elif style == "half-hello":
            nonce = await r.challenge()
            await r.send(hello(b"k" * 32, nonce, uuid.uuid4().hex.encode())[:100])
        elif style == "dribble":

            async def dribble() -> None:
                data = hello(b"k" * 32, b"\0" * NONCE, uuid.uuid4().hex.encode())
                with contextlib.suppress(ConnectionError):
                    for i in range(len(data)):  # 184 bytes, 50 ms apart: 9 s in all
                        if r.reader.at_eof() or r.writer.is_closing():
                            return  # the server hung up
                        r.writer.write(data[i : i + 1])
                        await r.writer.drain()
                        await asyncio.sleep(0.05)

            dribblers.append(asyncio.get_running_loop().create_task(dribble()))

    dribblers: list[asyncio.Task[None]] = []
    async with honest_pair(tensorwire.Limits(handshake_seconds=limit)) as env:
        try:
            # the reason is not checked here: see test_handshake_timeout_warning_says_why
            took = await _attack_pre_auth(env, caplog, attack, "", within=limit + 1.5)
        finally:
            for t in dribblers:
                t.cancel()
            await asyncio.gather(*dribblers, return_exceptions=True)
        assert took >= limit * 0.8, f"dropped after {took:.2f} s, before the {limit} s handshake deadline"


async def test_handshake_timeout_warning_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async with honest_pair(tensorwire.Limits(handshake_seconds=0.3)) as env, raw(env.data_address) as r:
        await r.closed_by_server(within=3)
        rec = await logged(caplog, TRANSPORT_LOG, f"dropped tcp data connection from {r.who}: ")
        reason = rec.getMessage().split(": ", 1)[1]
        assert reason.strip(), f"the warning gives no reason: {rec.getMessage()!r}"
        assert "timeout" in reason.lower() or "timed out" in reason.lower(), reason


async def test_many_idle_connections_are_all_dropped_and_honest_peers_connect_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limit = 2.0
    async with honest_pair(tensorwire.Limits(handshake_seconds=limit)) as env:
        idle = [await Raw.open(env.data_address) for _ in range(40)]
        try:
            async with env.background() as traffic:
                start = traffic.rounds
                # a new honest connection gets through while 40 connections hold handshakes open
                fresh = await asyncio.wait_for(env.client.connect(env.server.address), 5)
                fresh_b = await asyncio.wait_for(env.server.accept(), 5)
                still_open = sum(not r.reader.at_eof() for r in idle)
                assert still_open == len(idle), f"only {still_open} idle connections were still open"
                await env.round_trip(fresh, fresh_b)
                await fresh.aclose()
                took = await asyncio.wait_for(
                    asyncio.gather(*[r.closed_by_server(within=limit + 3) for r in idle]), limit + 4
                )
                assert max(took) < limit + 1.5
                await traffic.beyond(start + 3)
            assert len(drop_warnings(caplog)) == 20  # rate limited: 20 per 10 s window, the rest counted
        finally:
            for r in idle:
                await r.aclose()
        await env.still_serving()


async def test_a_flood_of_bad_connections_is_rate_limited_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    async with honest_pair() as env:
        async with env.background() as traffic:
            start = traffic.rounds
            for _ in range(30):
                async with raw(env.data_address) as r:
                    await r.send(b"\xff" * 48)
                    await r.closed_by_server(within=3)
            await traffic.beyond(start + 3)
        drops = drop_warnings(caplog)
        assert len(drops) == 20, f"{len(drops)} warnings for 30 dropped connections"
        assert all("bad frame magic" in d.getMessage() for d in drops)
        await env.still_serving()


# == protocol violations after authentication ======================================================
# The node's limits for these tests: small enough that claims can be checked against them.
POST_LIMITS = tensorwire.Limits(
    recv_buffer_bytes=8 * MiB,
    max_unexpected=64,
    max_message_bytes=64 * MiB,
    max_header_bytes=64 * 1024,
    handshake_seconds=5.0,
)
_SMALL = claim_header("int32", [4])  # 16 bytes, a valid header


def _msg(meta: bytes, *, flags: int = 0, payload_len: int = 0, tag: int = 7) -> Callable[[Session], bytes]:
    """A MSG frame carrying ``meta`` as its message header (and no payload bytes)."""
    return lambda s: (
        frame(MSG, flags=flags, meta_len=len(meta), payload_len=payload_len, msg_id=s.msg_id(), arg=tag) + meta
    )


def _msg_then(second: Callable[[int], bytes]) -> Callable[[Session], bytes]:
    """A valid 16-byte eager MSG on tag 8 whose payload has not come yet, then ``second(msg_id)``."""

    def build(s: Session) -> bytes:
        m = s.msg_id()
        return frame(MSG, meta_len=len(_SMALL), msg_id=m, arg=8) + _SMALL + second(m)

    return build


def _const(data: bytes) -> Callable[[Session], bytes]:
    return lambda s: data


_UNREAD_OWN_TAG = OWN_TAGS[0]  # one of tensorwire's own tags that nothing in the node receives on


def _flood(user: int, own: int = 0) -> Callable[[Session], bytes]:
    """``user`` valid 16-byte eager messages on tag 8, then ``own`` on one of tensorwire's
    tags, all left unreceived: each holds one of the node's message slots."""

    def build(s: Session) -> bytes:
        tags = [8] * user + [_UNREAD_OWN_TAG] * own
        return b"".join(
            frame(MSG, meta_len=len(_SMALL), payload_len=16, msg_id=s.msg_id(), arg=tag) + _SMALL + bytes(16)
            for tag in tags
        )

    return build


_HUGE = claim_header("float32", [2**38])  # 1 TiB, past max_message_bytes
_OVER_CREDIT = claim_header("uint8", [32 * MiB])  # within max_message_bytes, past the 8 MiB buffer
_UNDECODABLE = b"\xff" * 40
try:
    wire_pb2.MessageHeader.FromString(_UNDECODABLE)
except Exception:  # any protobuf error: it really is undecodable
    pass
else:
    raise AssertionError("the undecodable header decodes")

_TWICE = wire_pb2.MessageHeader(
    tensors=[wire_pb2.TensorSpec(dtype="int8", shape=[4], device="cpu", framework="numpy", nbytes=4)] * 2,
    tree=wire_pb2.TreeNode(list=wire_pb2.Sequence(items=[wire_pb2.TreeNode(tensor=0)] * 2)),
).SerializeToString()

# name: (what to send on the authenticated connection, what the warning must say)
VIOLATIONS: dict[str, tuple[Callable[[Session], bytes], str]] = {
    "msg-claims-past-max-message-bytes": (_msg(_HUGE), "more than the 67108864-byte limit"),
    "rendezvous-claims-past-max-message-bytes": (_msg(_HUGE, flags=RENDEZVOUS), "more than the 67108864-byte"),
    "eager-msg-past-buffer-credit": (_msg(_OVER_CREDIT), "beyond its buffer credit"),
    "msg-payload-len-past-its-message": (_msg(_SMALL, payload_len=2**40), "payload bytes for a 16-byte message"),
    "rendezvous-msg-with-payload": (_msg(_SMALL, flags=RENDEZVOUS, payload_len=16), "payload bytes for a 16-byte"),
    "meta-len-past-max-header-bytes": (
        _const(frame(MSG, meta_len=64 * 1024 + 1, msg_id=50, arg=7) + b"\0" * 1000),
        "exceeds the 65536-byte limit",
    ),
    "meta-len-and-payload-len-huge": (
        _const(frame(MSG, meta_len=2**32 - 1, payload_len=2**40, msg_id=50, arg=7)),
        "exceeds the 65536-byte limit",
    ),
    "data-for-unknown-message": (
        _const(frame(DATA, payload_len=16, msg_id=999_999, arg=0) + b"\0" * 16),
        "DATA for unknown message 999999",
    ),
    "data-past-the-end-of-its-message": (
        _msg_then(lambda m: frame(DATA, payload_len=2**40, msg_id=m, arg=0)),
        "does not continue message",
    ),
    "data-at-the-wrong-offset": (
        _msg_then(lambda m: frame(DATA, payload_len=8, msg_id=m, arg=8) + b"\0" * 8),
        "does not continue message",
    ),
    "duplicate-message-id": (
        _msg_then(lambda m: frame(MSG, meta_len=len(_SMALL), msg_id=m, arg=8) + _SMALL),
        "duplicate message id",
    ),
    "unknown-frame-type": (_const(frame(200, payload_len=2**40)), "unknown frame type 200"),
    "reserved-bits": (_const(frame(CREDIT, reserved=1)), "reserved frame bits"),
    "unknown-flags": (_const(frame(CREDIT, flags=0x80)), "reserved frame bits"),
    "bad-magic": (_const(frame(CREDIT, magic=b"EVIL")), "bad frame magic"),
    "hello-after-auth": (_const(frame(HELLO)), "unexpected HELLO frame"),
    "challenge-after-auth": (_const(frame(CHALLENGE)), "unexpected CHALLENGE frame"),
    "control-frame-with-payload": (_const(frame(CTS, payload_len=2**40, msg_id=1)), "CTS frame with"),
    "control-frame-with-metadata": (_const(frame(ABORT, meta_len=2**32 - 1, msg_id=1)), "ABORT frame with"),
    "credit-never-granted": (_const(frame(CREDIT, credit=2**62, slots=2**31)), "more credit than it granted"),
    # max_unexpected=64 for the user's messages, 64 more kept for tensorwire's: before, the
    # node counted only the 128, and the user's messages could take the kept slots too;
    # tensorwire's own may take all 128
    "user-messages-past-max-unexpected": (_flood(65), "more than 64 user messages without credit"),
    "messages-past-every-slot": (_flood(0, 129), "more than 128 messages without credit"),
    "checksum-not-negotiated": (_msg(_SMALL, flags=CHECKSUM), "checksum flag"),
    "undecodable-protobuf-header": (_msg(_UNDECODABLE), "undecodable message header"),
    "header-unknown-dtype": (_msg(claim_header("int32", [4]).replace(b"int32", b"evil!")), "unknown dtype"),
    "header-nbytes-disagrees-with-shape": (
        _msg(claim_header("int32", [4], nbytes=4), payload_len=4),
        "header claims 4 bytes for int32[4]",
    ),
    "header-negative-dimension": (_msg(claim_header("int32", [-4, -4], nbytes=64)), "negative dimension"),
    "header-too-many-dimensions": (_msg(claim_header("int8", [1] * 65)), "65 dimensions"),
    "header-non-cpu-device": (
        _msg(claim_header("int32", [4]).replace(b"cpu", b"gpu")),
        "device 'gpu'",
    ),
    "header-tree-refers-to-missing-tensor": (
        _msg(wire_pb2.MessageHeader(tree=wire_pb2.TreeNode(tensor=5)).SerializeToString()),
        "tree refers to tensor 5 of 0",
    ),
    # two int8[4] and their 8 bytes, the tree naming the first twice: the recv returned one
    # array twice and the second tensor's bytes went unseen
    "header-tree-places-a-tensor-twice": (
        lambda s: _msg(_TWICE, payload_len=8)(s) + bytes(range(8)),
        "tree refers to tensor 0 twice",
    ),
    "header-without-a-tree": (_msg(b""), ""),
}


async def _violate(
    caplog: pytest.LogCaptureFixture, attack: Callable[[Session], bytes], reason: str, *, error: type = ProtocolError
) -> None:
    """Send ``attack`` on an authenticated raw session whose Peer has a recv pending; that recv
    must fail with ``error``, the connection close, a warning be logged, and nothing else break:
    not the honest pair, not a second raw session, not new connections, not the memory."""
    async with honest_pair(POST_LIMITS) as env, session(env) as victim, session(env) as bystander:
        await victim.delivers()  # the raw session demonstrably works before the attack
        await bystander.delivers()
        pending = asyncio.ensure_future(victim.peer.recv(tag=7))
        await asyncio.sleep(0.05)
        assert not pending.done()
        async with env.background() as traffic:
            start = traffic.rounds
            with peak_allocation() as mem:
                await victim.raw.send(attack(victim))
                with pytest.raises(error):
                    await asyncio.wait_for(pending, 5)
                await victim.raw.closed_by_server()
            await logged(caplog, CHANNEL_LOG, "closing tcp channel", reason)
            await traffic.beyond(start + 3)
        assert mem["peak"] < PEAK_BUDGET, f"a hostile claim made the node allocate {mem['peak']} bytes"
        assert victim.peer.closed
        with pytest.raises(TensorWireError):  # later calls fail at once, they do not hang
            await asyncio.wait_for(victim.peer.recv(tag=7), 5)
        with pytest.raises(TensorWireError):
            await asyncio.wait_for(victim.peer.send(np.zeros(4)), 5)
        await bystander.delivers()
        assert bystander.peer.channel.state is ChannelState.OPEN
        await env.still_serving()


async def test_a_peer_may_fill_the_users_share_and_every_kept_slot() -> None:
    """The positive control for the two floods above: the node takes as many messages as an
    honest sender sends (64 of the user's, then 64 of tensorwire's), and the user's, received,
    free their slots for more."""
    async with honest_pair(POST_LIMITS) as env, session(env) as s:
        await s.raw.send(_flood(64, 64)(s))
        for _ in range(64):
            got = await asyncio.wait_for(s.peer.recv(tag=8), 5)
            assert got.tobytes() == bytes(16)
        await s.delivers()
        assert s.peer.channel.state is ChannelState.OPEN
        await env.still_serving()


async def test_raw_session_delivers_valid_messages() -> None:
    """The positive control for everything below: the hand-made handshake and frames are right,
    so the rejections that follow are due to the violation alone."""
    async with honest_pair(POST_LIMITS) as env, session(env) as s:
        assert s.server_limits == (8 * MiB, 64, 64 * MiB, 64 * 1024, 0)
        for tag in (1, 2, 1):
            await s.delivers(tag)
        # a message split into MSG + DATA frames, the way a sender chunks a payload
        x = np.arange(1000, dtype=np.float64)
        meta = message_header(x)
        m = s.msg_id()
        body = x.tobytes()
        await s.raw.send(
            frame(MSG, meta_len=len(meta), payload_len=3000, msg_id=m, arg=3)
            + meta
            + body[:3000]
            + frame(DATA, payload_len=len(body) - 3000, msg_id=m, arg=3000)
            + body[3000:]
        )
        assert same(x, await asyncio.wait_for(s.peer.recv(tag=3), 5))
        # and the node's replies reach us in the same format
        await s.peer.send(np.arange(4, dtype=np.int16), tag=9)
        while True:
            magic, ftype, _, _, meta_len, payload_len, _, arg, *_ = await s.raw.read_frame()
            body = await asyncio.wait_for(s.raw.reader.readexactly(meta_len + payload_len), 5)
            if ftype == MSG:
                break
        assert (magic, arg, payload_len) == (MAGIC, 9, 8)
        assert body[meta_len:] == np.arange(4, dtype=np.int16).tobytes()
        await env.still_serving()


@pytest.mark.parametrize("name", list(VIOLATIONS))
async def test_protocol_violation_after_auth_closes_only_that_connection(
    caplog: pytest.LogCaptureFixture, name: str
) -> None:
    attack, reason = VIOLATIONS[name]
    await _violate(caplog, attack, reason)


# -- headers that once passed decode_header and then could not be rebuilt: now protocol errors ---
def _header_msg(tree: wire_pb2.TreeNode, tensors: list[wire_pb2.TensorSpec] | None = None, *, flags: int = 0) -> Any:
    h = wire_pb2.MessageHeader(tensors=tensors or [], tree=tree).SerializeToString()
    return lambda s: frame(MSG, flags=flags, meta_len=len(h), msg_id=s.msg_id(), arg=7) + h


def _empty_dict_key() -> wire_pb2.TreeNode:
    t = wire_pb2.TreeNode()
    t.dict.keys.add()  # a key node with no kind set
    t.dict.values.add(none=True)
    return t


_ZERO_BUT_HUGE = [wire_pb2.TensorSpec(dtype="float32", shape=[0, 2**62, 2**62], nbytes=0)]


async def test_header_with_non_numeric_big_int_is_a_protocol_error(caplog: pytest.LogCaptureFixture) -> None:
    await _violate(caplog, _header_msg(wire_pb2.TreeNode(big_int="not-a-number")), "")


async def test_header_with_empty_dict_key_is_a_protocol_error(caplog: pytest.LogCaptureFixture) -> None:
    await _violate(caplog, _header_msg(_empty_dict_key()), "")


async def test_header_with_unallocatable_empty_tensor_is_a_protocol_error(caplog: pytest.LogCaptureFixture) -> None:
    await _violate(caplog, _header_msg(wire_pb2.TreeNode(tensor=0), _ZERO_BUT_HUGE), "")


async def test_rendezvous_header_with_unallocatable_empty_tensor_is_a_protocol_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _violate(caplog, _header_msg(wire_pb2.TreeNode(tensor=0), _ZERO_BUT_HUGE, flags=RENDEZVOUS), "")


def _next_session_id(monkeypatch: pytest.MonkeyPatch, sid: str) -> None:
    """Every node of this process hands out ``sid`` as the session id of its next handshake (once):
    a hostile server that chose the id of a session it saw on the wire (a data connection's hello
    carries it in the clear)."""
    ids = [sid]

    def uuid4() -> object:
        return types.SimpleNamespace(hex=ids.pop()) if ids else uuid.uuid4()

    monkeypatch.setattr(_server, "uuid", types.SimpleNamespace(uuid4=uuid4))


@pytest.mark.timeout(60)
async def test_a_server_answer_with_another_peers_session_id_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node ``a`` accepted an honest client ``c`` (session X). ``a`` then connected to a hostile
    server ``h`` that answered the handshake with session id X (and a secret of its own). ``a``
    took it: its table of sessions then named h's peer for X, so c's lookups were refused as bad
    proofs, and once h's peer went, ``a`` dropped X's session and lease with it: c's next renewal
    was answered "no such session" and c's healthy peer died with PeerDisconnected. A session id
    this node already knows for another session is a NegotiationError now, and c lives on."""
    lease = 0.3
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=lease) as a,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=lease) as c,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=lease) as h,
    ):
        a.expose(np.arange(4.0), name="w")
        to_a = await c.connect(a.address)
        assert to_a.session is not None
        victim = to_a.session.id
        _next_session_id(monkeypatch, victim)

        async def connect_and_leave() -> None:
            hostile = await a.connect(h.address)
            await hostile.aclose()  # (taken: h's peer goes, and took c's session with it)

        with pytest.raises(tensorwire.NegotiationError, match="a session id that names another session"):
            await connect_and_leave()
        assert not a.peers[1:] and a.peers[0].session is not None and a.peers[0].session.id == victim
        await asyncio.sleep(4 * lease)  # renewals of c's lease come every lease / 3
        assert not to_a.closed
        handle = await to_a.lookup("w")
        np.testing.assert_array_equal(await to_a.read(handle), np.arange(4.0))
