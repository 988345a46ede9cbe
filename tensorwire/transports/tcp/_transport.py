"""The staged-TCP transport: always available, authenticated by the session secret."""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import itertools
import logging
import os
import socket
from typing import Any

from ..._checks import join_address
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
_STAGGER_S = 0.25  # a slow address has this long before the next is tried alongside it (RFC 8305)


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
    return join_address(host, port).encode()


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
    """The listeners for an IP address or a wildcard, all on one port. A wildcard gets one per
    family, as the control plane (gRPC on ``*``) takes both: a peer dials the host it reached
    that at, ``[::1]`` too. A machine without the second family (no IPv6, say) serves on the
    first alone. (A name: ``_listeners_at``.)"""
    if host not in _WILDCARDS:
        family = _literal(host)
        assert family is not None  # (names go to _listeners_at)
        return [_bind(family, host, 0)]
    v4, v6 = (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")
    return _on_one_port(*((v6, v4) if host == "::" else (v4, v6)))


def _on_one_port(
    first: tuple[socket.AddressFamily, str], other: tuple[socket.AddressFamily, str] | None
) -> list[socket.socket]:
    """A listener on ``first``, and one on ``other`` (another family's address) at the same
    port where that family has it; a port taken there is given up for another."""
    sock = _bind(*first, 0)
    if other is None:
        return [sock]
    for _ in range(_BIND_TRIES):
        try:
            return [sock, _bind(*other, sock.getsockname()[1])]
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:  # no such family (or address) here
                log.debug("tcp data listener on %s alone: %s", first[1], exc)
                return [sock]
        sock.close()  # that port is taken in the other family: another one
        sock = _bind(*first, 0)
    log.warning("tcp data listener on %s alone: %d ports were taken on %s", first[1], _BIND_TRIES, other[1])
    return [sock]


async def _listeners_at(name: str) -> list[socket.socket]:
    """The listeners for a host name: resolved (not guessed from the name's spelling, which
    took every name for IPv4), at the first of its addresses that binds, and, where the name
    has the other family too, at that family's first address on the same port: a peer that
    dials the name reaches this node whichever of its addresses it tries first."""
    addrs = await _resolve(name, 0)
    failed: list[str] = []
    for i, (family, sockaddr) in enumerate(addrs):
        other = next(((f, a[0]) for f, a in addrs[i + 1 :] if f != family), None)
        try:
            return _on_one_port((family, sockaddr[0]), other)
        except OSError as exc:  # not an address of this machine, say: the next one
            failed.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise OSError(f"{name!r} resolves to no address of this machine ({'; '.join(failed)})")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_SockAddr = tuple[socket.AddressFamily, tuple[Any, ...]]  # a family, and a sockaddr of it


def _show(sockaddr: tuple[Any, ...]) -> str:
    return _join(sockaddr[0], sockaddr[1]).decode()


def _literal(host: str) -> socket.AddressFamily | None:
    """The family of an IP address written out (``10.0.0.7``, ``::1``, ``fe80::1%eth0``); None for a name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


async def _resolve(host: str, port: int) -> list[_SockAddr]:
    """The addresses of the name ``host``, resolved off the event loop (getaddrinfo blocks), in
    the resolver's order with the families taking turns (RFC 8305), so that a family that does
    not answer here costs one address's wait, not all of them."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # gaierror; a name the idna codec refuses
        raise OSError(f"cannot resolve {host!r}: {exc}") from exc
    addrs = list(dict.fromkeys((family, tuple(addr)) for family, _, _, _, addr in found))
    if not addrs:
        raise OSError(f"cannot resolve {host!r}: no address")
    first = [a for a in addrs if a[0] == addrs[0][0]]
    rest = [a for a in addrs if a[0] != addrs[0][0]]
    return [a for pair in itertools.zip_longest(first, rest) for a in pair if a is not None]


async def _open(family: socket.AddressFamily, sockaddr: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _open_any(host: str, addrs: list[_SockAddr], tried: list[str]) -> socket.socket:
    """A socket connected to the first of ``addrs`` that takes it: each in turn, the next one
    started alongside once the one before has failed or had ``_STAGGER_S`` (happy eyeballs,
    lite); the other attempts are closed. ``tried`` gets each address as its attempt starts."""
    loop = asyncio.get_running_loop()
    todo = list(addrs)
    attempts: dict[asyncio.Task[socket.socket], str] = {}
    failures: list[str] = []
    first_failure: BaseException | None = None
    won: socket.socket | None = None
    try:
        while todo or attempts:
            if todo:
                family, sockaddr = todo.pop(0)
                tried.append(_show(sockaddr))
                attempts[loop.create_task(_open(family, sockaddr))] = tried[-1]
            done, _ = await asyncio.wait(
                attempts, timeout=_STAGGER_S if todo else None, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                where = attempts.pop(task)
                exc = task.exception()
                if exc is None:
                    if won is None:
                        won = task.result()
                    else:  # two at once: keep one
                        task.result().close()
                    continue
                first_failure = first_failure or exc
                why = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
                failures.append(f"{where}: {why or type(exc).__name__}")
            if won is not None:
                return won
    finally:
        for task in attempts:  # each closes its socket as it ends; one that connected is closed here
            task.cancel()
            task.add_done_callback(_discard)
        if attempts:
            try:
                await asyncio.wait(attempts)
            except BaseException:
                if won is not None:
                    won.close()
                raise
    raise OSError(f"no address of {host} took it: {'; '.join(failures)}") from first_failure


def _discard(task: asyncio.Task[socket.socket]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


class TcpTransport(Transport):
    name = "tcp"
    checks_payloads = True  # checksum=True: a crc32c on every payload frame

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
            named = host not in _WILDCARDS and _literal(host) is None
            self._listeners = await _listeners_at(host) if named else _listeners(host)
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
        who = join_address(_plain(addr[0]), addr[1]) if isinstance(addr, tuple) else str(addr)
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
        channel = TcpChannel(io, self.ctx.limits, remote, checksum=self.ctx.checksum, name=who)
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
        """Connect to ``address``: an IP address as it is written, a name at each of its addresses
        in turn (``_open_any``), all within ``handshake_seconds``, the session's proof included."""
        host, port = _split(address)
        family = _literal(host)
        tried: list[str] = []  # a name's addresses, as their attempts start
        sock: socket.socket | None = None
        io: SockIO | None = None
        try:
            async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                if family is not None:
                    sock = await _open(family, (host, port))
                else:
                    sock = await _open_any(host, await _resolve(host, port), tried)
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
            elif sock is not None:
                sock.close()
            why = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError) and family is None and sock is None:
                seconds = self.ctx.limits.handshake_seconds
                why = (
                    f"no address of {host} took it within {seconds} s (tried {', '.join(tried)})"
                    if tried
                    else f"{host} did not resolve within {seconds} s"
                )
            raise ConnectError(f"tcp data connection to {join_address(host, port)} failed: {why}") from exc
        except BaseException:
            if io is not None:
                io.close()
            elif sock is not None:
                sock.close()
            raise
        channel = TcpChannel(io, self.ctx.limits, remote, checksum=self.ctx.checksum, name=join_address(host, port))
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
