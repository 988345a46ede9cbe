"""The staged-TCP transport: always available, authenticated by the session secret."""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import logging
import os
import socket

from ..._ratelog import RateLimitedLog
from ...errors import ConfigurationError, ConnectError, PeerDisconnected, ProtocolError
from .._base import Capabilities, Channel, Session, Transport, TransportContext
from .._frames import LIMITS, MAX_SESSION_ID, NONCE_BYTES, FrameType, PeerLimits, pack, proof
from ._channel import TcpChannel
from ._sockio import SockIO

log = logging.getLogger(__name__)

__all__ = ["TcpTransport"]


_WILDCARDS = ("0.0.0.0", "::", "")
_ACCEPT_BATCH = 64  # connections accepted per readable event before the loop runs other work
_BIND_TRIES = 8  # ports tried for a wildcard's second family before it serves on one


def _split(address: bytes) -> tuple[str, int]:
    try:
        host, _, port = address.decode().rpartition(":")
        host, number = host.strip("[]"), int(port)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConnectError(f"malformed tcp address {address[:64]!r}") from exc
    if not 0 < number < 65536 or "\0" in host:  # the socket calls would raise OverflowError, ValueError
        raise ConnectError(f"malformed tcp address {address[:64]!r}")
    return host, number


def _join(host: str, port: int) -> bytes:
    """The address blob: ``host:port``, an IPv6 host in brackets (``_split`` reads it back)."""
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


def _plain(host: str) -> str:
    """An IPv4-mapped IPv6 host (``::ffff:10.0.0.7``) as the IPv4 host it is; others as given."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return host if mapped is None else str(mapped)


def _bind(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A listening socket; on ``::`` it takes IPv6 alone (IPv4 gets a socket of its own, so an
    IPv4 peer is seen at its IPv4 address, never as ``::ffff:a.b.c.d``)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _listeners(host: str) -> list[socket.socket]:
    """The listeners for ``host``, all on one port. A wildcard gets one per family, as the control
    plane (gRPC on ``*``) takes both: a peer dials the host it reached that at, ``[::1]`` too.
    A machine without the second family (no IPv6, say) serves on the first alone."""
    if host not in _WILDCARDS:
        return [_bind(socket.AF_INET6 if ":" in host else socket.AF_INET, host, 0)]
    v4, v6 = (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")
    (family, wildcard), (other, other_wildcard) = (v6, v4) if host == "::" else (v4, v6)
    first = _bind(family, wildcard, 0)
    for _ in range(_BIND_TRIES):
        try:
            return [first, _bind(other, other_wildcard, first.getsockname()[1])]
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:  # no such family here
                log.debug("tcp data listener on %s alone: %s", wildcard, exc)
                return [first]
        first.close()  # that port is taken in the other family: another one
        first = _bind(family, wildcard, 0)
    log.warning("tcp data listener on %s alone: %d ports were taken on %s", wildcard, _BIND_TRIES, other_wildcard)
    return [first]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpTransport(Transport):
    name = "tcp"

    @classmethod
    def probe(cls) -> Capabilities | None:
        return Capabilities(memory_kinds=("host",), one_sided=False, rdma=False, lanes=("tcp",))

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        super().__init__(ctx, capabilities)
        self._listeners: list[socket.socket] = []
        self._paused: asyncio.TimerHandle | None = None  # accepting again after a failed accept
        self._handshakes: set[asyncio.Task[None]] = set()
        self._unstarted: set[socket.socket] = set()  # accepted, their handshake not yet begun
        self._channels: set[TcpChannel] = set()
        self._closed = False
        self._drops = RateLimitedLog(log, per_window=20, window=10.0, what="dropped connections", kind="tcp")

    async def listen(self) -> bytes:
        host = self.ctx.host
        try:
            self._listeners = _listeners(host)
        except OSError as exc:  # socket.gaierror too: a host that does not resolve, or is not ours
            raise ConfigurationError(f"cannot bind the tcp transport to {host!r}: {exc}") from exc
        for sock in self._listeners:
            sock.setblocking(False)
        self._resume()
        return _join(host, self._listeners[0].getsockname()[1])

    def _accept(self, listener: socket.socket) -> None:
        """A listener is readable: accept what waits, each socket straight into its handshake.

        Accepting here, not in a task awaiting ``loop.sock_accept``, leaves no moment in which a
        close can cancel the wait after the accept and lose the socket (it stayed open, and its
        client waited out ``connect_timeout`` for a CHALLENGE)."""
        loop = asyncio.get_running_loop()
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving after a pause
                log.warning("tcp accept failed: %s", exc)
                for sock in self._listeners:
                    loop.remove_reader(sock.fileno())
                if self._paused is None:
                    self._paused = loop.call_later(0.1, self._resume)
                return
            # aclose closes it if the task is cancelled before its first step
            self._unstarted.add(conn)
            task = loop.create_task(self._handshake_server(conn, addr))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            for sock in self._listeners:
                asyncio.get_running_loop().add_reader(sock.fileno(), self._accept, sock)

    async def _handshake_server(self, conn: socket.socket, addr: object) -> None:
        self._unstarted.discard(conn)
        _tune(conn)
        io = SockIO(conn)
        who = f"{_plain(addr[0])}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        try:
            async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                nonce = os.urandom(NONCE_BYTES)
                await io.send_all([pack(FrameType.CHALLENGE, payload_len=NONCE_BYTES), nonce])
                hdr = await io.read_header()
                lo = NONCE_BYTES + LIMITS.size
                if hdr.type is not FrameType.HELLO or hdr.payload_len or not lo < hdr.meta_len <= lo + MAX_SESSION_ID:
                    raise ProtocolError(
                        f"expected HELLO, got {hdr.type.name} with {hdr.meta_len}+{hdr.payload_len} bytes"
                    )
                meta = await io.read_exact(hdr.meta_len)
                sid = meta[lo:]
                session, fut = self.sessions.admit(
                    sid, lambda s: hmac.compare_digest(meta[:NONCE_BYTES], proof(s.secret, nonce, sid, b"client"))
                )
                remote = PeerLimits.unpack(meta[NONCE_BYTES:lo])
                reply = proof(session.secret, nonce, sid, b"server") + PeerLimits.of(self.ctx).pack()
                await io.send_all([pack(FrameType.WELCOME, meta_len=len(reply)), reply])
        except (ProtocolError, PeerDisconnected, TimeoutError, OSError) as exc:
            self._drops.warn("dropped tcp data connection from %s: %s", who, str(exc) or type(exc).__name__)
            io.close()
            return
        except BaseException:
            io.close()
            raise
        channel = TcpChannel(io, self.ctx.limits, remote, checksum=self.ctx.checksum, name=f"{who}")
        self._track(channel)
        if fut.done():
            await channel.aclose()
        else:
            fut.set_result(channel)

    def _track(self, channel: TcpChannel) -> None:
        self._channels.add(channel)
        channel.add_close_callback(lambda _exc: self._channels.discard(channel))

    def dial_address(self, address: bytes, dialled_host: str) -> bytes:
        """A node listening on every interface (``0.0.0.0``, ``::``) offers that wildcard, which
        names no machine to a peer elsewhere: dial the host whose control plane we reached."""
        host, port = _split(address)
        if host not in _WILDCARDS or not dialled_host:
            return address
        return _join(dialled_host.strip("[]"), port)

    async def connect(self, address: bytes, session: Session) -> Channel:
        host, port = _split(address)
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        io: SockIO | None = None
        try:
            async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                await loop.sock_connect(sock, (host, port))
                _tune(sock)
                io = SockIO(sock)
                hdr = await io.read_header()
                if hdr.type is not FrameType.CHALLENGE or hdr.payload_len != NONCE_BYTES or hdr.meta_len:
                    raise ProtocolError(f"expected CHALLENGE, got {hdr.type.name}")
                nonce = await io.read_exact(NONCE_BYTES)
                sid = session.id.encode()
                hello = proof(session.secret, nonce, sid, b"client") + PeerLimits.of(self.ctx).pack() + sid
                await io.send_all([pack(FrameType.HELLO, meta_len=len(hello)), hello])
                hdr = await io.read_header()
                if hdr.type is not FrameType.WELCOME or hdr.meta_len != NONCE_BYTES + LIMITS.size or hdr.payload_len:
                    raise ProtocolError(f"expected WELCOME, got {hdr.type.name}")
                meta = await io.read_exact(hdr.meta_len)
                if not hmac.compare_digest(meta[:NONCE_BYTES], proof(session.secret, nonce, sid, b"server")):
                    raise ProtocolError("server did not prove the session secret")
                remote = PeerLimits.unpack(meta[NONCE_BYTES:])
        except (
            ProtocolError,
            PeerDisconnected,
            TimeoutError,
            OSError,
            ValueError,  # UnicodeError too: a host the resolver cannot encode (an empty or long label)
            OverflowError,  # a port the socket module refuses
        ) as exc:
            if io is not None:
                io.close()
            else:
                sock.close()
            raise ConnectError(
                f"tcp data connection to {host}:{port} failed: {str(exc) or type(exc).__name__}"
            ) from exc
        except BaseException:
            if io is not None:
                io.close()
            else:
                sock.close()
            raise
        channel = TcpChannel(io, self.ctx.limits, remote, checksum=self.ctx.checksum, name=f"{host}:{port}")
        self._track(channel)
        return channel

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self._listeners:
            asyncio.get_running_loop().remove_reader(sock.fileno())
        if self._paused is not None:
            self._paused.cancel()
        for t in list(self._handshakes):
            t.cancel()
        self.sessions.cancel_all()
        try:
            await asyncio.gather(*[c.aclose() for c in list(self._channels)], return_exceptions=True)
            await asyncio.gather(*self._handshakes, return_exceptions=True)
        finally:
            for conn in self._unstarted:
                conn.close()
            self._unstarted.clear()
            for sock in self._listeners:
                sock.close()
