"""The serving end of a bench: one peer's requests, and the plain TCP listener of its baseline."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import ipaddress
import logging
import secrets
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ..control._server import bind_targets
from ..errors import PeerDisconnected, ProtocolError, ResourceError, TensorWireError
from ..tensors._device import Device
from ._wire import (
    ANSWER_TAG,
    DATA_TAG,
    MAX_COUNT,
    MAX_SIZE,
    PING_BYTES,
    PING_TAG,
    PONG_TAG,
    RAW_CRC,
    RAW_HEAD,
    RAW_PING,
    RAW_SINK,
    REQUEST_TAG,
    SECRET_BYTES,
    SERVICE_METHOD,
    STALL_S,
    allocate,
    bench_device,
    crc_of,
    recv_exact,
)

if TYPE_CHECKING:
    from .._node import Node
    from .._peer import Peer

__all__ = ["offer_bench", "serve_bench"]

log = logging.getLogger(__name__)

_ACCEPT_S = 30.0  # how long an opened baseline listener waits for its one client
_POLL_S = 0.5  # how soon a listener's thread sees a close (shutdown wakes it at once on Linux)
_SECRET_S = 5.0  # how long a new baseline connection may take to present the secret
_BIND_TRIES = 8  # ports tried for listeners on several addresses, one of which another process took
_REFUSAL = "it was started without --bench (start one with `tensorwire serve --bench`)"


async def _receive(peer: Peer, out: Any, count: int) -> dict[str, int]:
    """The node's side of a sink: ``count`` messages into ``out``, and how they landed, by
    their receipts: ``direct`` (into ``out`` with no copy of tensorwire's), ``staged`` (through a
    buffer of tensorwire's: the message came before its recv, or device memory went through host
    staging) or ``copied``
    (the transport copied it on its way: bytes inline with the header, tcp's read-ahead)."""
    landed = {"direct": 0, "staged": 0, "copied": 0}
    for _ in range(count):
        _, receipt = await peer._recv_own_with_receipt(tag=DATA_TAG, out=out)
        landed["direct" if receipt.direct else "staged" if receipt.staged else "copied"] += 1
    return landed


def _raw_receive(conn: socket.socket, out: memoryview, count: int) -> bool:
    """The baseline's side of a sink: ``count`` messages into ``out``; False if the client left."""
    return all(recv_exact(conn, out) for _ in range(count))


def _bind_addresses(host: str) -> list[tuple[socket.AddressFamily, str]]:
    """The addresses the node's control plane listens on for ``host``, as gRPC binds them
    (control's bind_targets: ``[::1]:P`` of a node at ``localhost:P`` too), and every address
    any other name resolves to. A client reaches the baseline wherever it reached the node."""
    targets = bind_targets(host)
    if targets is None:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        return list(dict.fromkeys((family, str(addr[0])) for family, _, _, _, addr in found))
    if targets[0] == (socket.AF_INET6, "::"):  # every interface: the targets are alternatives
        if socket.has_dualstack_ipv6():
            return targets[:1]  # gRPC takes both families on 0.0.0.0 too ('*:P')
        return [(socket.AF_INET6, "::")] if ":" in host else [(socket.AF_INET, "0.0.0.0")]
    return targets


def _listen(host: str) -> list[socket.socket]:
    """Listeners on one port at every address of ``host`` (see _bind_addresses) that this
    machine has (one without an IPv6 loopback serves localhost on 127.0.0.1 alone)."""
    addresses = _bind_addresses(host)
    for _ in range(_BIND_TRIES):
        listeners: list[socket.socket] = []
        missing: OSError | None = None
        try:
            for family, addr in addresses:
                port = listeners[0].getsockname()[1] if listeners else 0
                # IPv4 clients too on '::', as the node's own listeners take them ('[::]:5555':
                # all interfaces; create_server would make an IPv6 socket IPv6-only)
                dual = family == socket.AF_INET6 and ipaddress.ip_address(addr).is_unspecified
                try:
                    sock = socket.create_server(
                        (addr, port), family=family, dualstack_ipv6=dual and socket.has_dualstack_ipv6()
                    )
                except OSError as exc:
                    if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                        raise
                    missing = exc  # not an address of this machine: the others serve
                    continue
                listeners.append(sock)
        except OSError as exc:
            for sock in listeners:
                sock.close()
            if exc.errno == errno.EADDRINUSE and listeners:  # another process has this port there: next port
                continue
            raise
        if not listeners:
            assert missing is not None
            raise missing
        return listeners
    raise OSError(errno.EADDRINUSE, f"no port is free on every address of {host!r} ({_BIND_TRIES} tried)")


class _RawServer:
    """The baseline's far end: listeners on the node's host (on each of its addresses) that take
    one connection (which must present ``secret`` first), then serve its sink and ping
    operations in a thread."""

    def __init__(self, host: str, max_bytes: int) -> None:
        self._listeners = _listen(host)
        self.port: int = self._listeners[0].getsockname()[1]
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._closed = False
        threading.Thread(target=self._run, name="tensorwire-bench-raw", daemon=True).start()

    def close(self) -> None:
        """Stop at once: a thread blocked in accept or recv wakes up and ends."""
        with self._lock:
            self._closed = True
            socks = [*self._listeners, *([self._conn] if self._conn is not None else [])]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _run(self) -> None:
        try:
            conn = self._accept()
            if conn is not None:
                with conn:
                    self._serve(conn)
        except (OSError, MemoryError, ValueError) as exc:  # the client went, or asked for too much
            log.debug("bench baseline connection ended: %s", exc)
        finally:
            self.close()

    def _accept(self) -> socket.socket | None:
        end = time.monotonic() + _ACCEPT_S
        # a selector (epoll), not select(): a node with more than 1024 fds open has listeners
        # that select() refuses ("filedescriptor out of range")
        with selectors.DefaultSelector() as selector:
            for listener in self._listeners:
                listener.setblocking(False)  # the selector says which has a client; one that left meanwhile: none
                selector.register(listener, selectors.EVENT_READ)
            return self._accept_from(selector, end)

    def _accept_from(self, selector: selectors.BaseSelector, end: float) -> socket.socket | None:
        while (left := end - time.monotonic()) > 0 and not self._closed:
            # in slices: a close from another thread is seen within one
            for key, _ in selector.select(min(left, _POLL_S)):
                listener = key.fileobj
                assert isinstance(listener, socket.socket)
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    if self._closed:  # close() took the listener from under us
                        return None
                    raise
                if not self._admit(conn):  # not our client: drop it, keep waiting for the one that is
                    conn.close()
                    continue
                with self._lock:
                    if self._closed:
                        conn.close()
                        return None
                    self._conn = conn
                for other in self._listeners:
                    with contextlib.suppress(OSError):
                        other.close()
                return conn
        return None

    def _admit(self, conn: socket.socket) -> bool:
        """Whether ``conn`` presents the secret (then it is set up for the baseline). The client
        sends it as soon as it connects: a connection silent for longer is not ours, and must
        not hold the one accept thread (and a close) for STALL_S."""
        conn.settimeout(min(STALL_S, _SECRET_S))
        secret = bytearray(SECRET_BYTES)
        try:
            ok = recv_exact(conn, memoryview(secret)) and hmac.compare_digest(bytes(secret), self.secret)
        except OSError:
            return False
        if ok:
            conn.settimeout(None)  # the client measures tensorwire between operations, for as long as it likes
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return ok

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(RAW_HEAD.size)
        buf: np.ndarray | None = None
        while recv_exact(conn, memoryview(head)):
            op, size, count = RAW_HEAD.unpack(head)
            if op == RAW_SINK and 1 <= size <= self._max_bytes and 1 <= count <= MAX_COUNT:
                if buf is None or buf.nbytes != size:
                    buf = None
                    buf = np.empty(size, np.uint8)
                view = buf.data
                if not _raw_receive(conn, view, count):
                    return
                conn.sendall(RAW_CRC.pack(crc32c.crc32c(view)))
            elif op == RAW_PING and 1 <= count <= MAX_COUNT:
                ping = memoryview(bytearray(PING_BYTES))
                for _ in range(count):
                    if not recv_exact(conn, ping):
                        return
                    conn.sendall(ping)
            else:
                return  # not the protocol: end the connection


def _error(exc: BaseException | str, kind: str = "") -> dict[str, Any]:
    if isinstance(exc, str):
        return {"error": kind or "ConfigurationError", "message": exc}
    return {"error": kind or type(exc).__name__, "message": str(exc) or repr(exc)}


def offer_bench(node: Node) -> None:
    """Say that ``node`` runs ``serve_bench`` for its peers (``tensorwire serve``, with --bench or
    not): a client checks first, and a node that does not (a ``tensorwire stage``, a program of
    its own), which leaves bench requests unread, is named at once rather than after a timeout."""

    async def serves() -> None:
        """`tensorwire bench`: this node answers bench requests (or refuses them, without --bench)."""

    if SERVICE_METHOD not in node.methods:
        node.method(SERVICE_METHOD)(serves)


async def serve_bench(peer: Peer, *, enabled: bool) -> None:
    """Answer ``peer``'s bench requests until it goes (or, unless ``enabled``, refuse each).
    Its node offers ``tw.bench`` from now on (``offer_bench``; a server that may be called at
    once offers it before it accepts anyone)."""
    offer_bench(peer.node)
    service = _Service(peer)
    try:
        while True:
            try:
                req = await peer._recv_own(tag=REQUEST_TAG)
            except (PeerDisconnected, ResourceError):
                return  # the peer went, or the node closes
            except TensorWireError as exc:  # a request that could not be taken (too big, not ours)
                await service.answer(_error(exc))
                continue
            if not enabled:
                await service.answer({**_error(_REFUSAL), "refused": True})
                continue
            try:
                await service.handle(req)
            except (PeerDisconnected, ResourceError):
                return
            except MemoryError:
                await service.answer(_error("this node cannot allocate a buffer that large", "MemoryError"))
            except Exception as exc:  # said to the client, which stops; this node serves on
                await service.answer(_error(exc))
    except _Gone:
        return
    finally:
        service.close()


class _Gone(Exception):
    """The peer cannot be answered any more."""


class _Service:
    """One peer's bench state: the baseline's listener, the receive buffers."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.raw: _RawServer | None = None
        self.buffers: dict[Device, Any] = {}
        self.max_bytes = min(peer.node.config.limits.max_message_bytes, MAX_SIZE)

    async def answer(self, answer: Any) -> None:
        try:
            await self.peer._send_own(answer, tag=ANSWER_TAG)
        except TensorWireError as exc:
            log.info("bench: cannot answer %s (%s: %s)", self.peer.remote_address, type(exc).__name__, exc)
            raise _Gone from exc

    async def handle(self, req: object) -> None:
        """Serve one request. A sink or ping is checked (and its buffer allocated) before the
        node says ``"ready"``: the client sends nothing that could wait on a recv never posted."""
        peer = self.peer
        op = req.get("op") if isinstance(req, dict) else None
        if op == "open":
            if self.raw is not None:
                self.raw.close()
            host = peer.node.address.rpartition(":")[0].strip("[]")
            # (its getaddrinfo may ask a resolver: not on the event loop)
            self.raw = await asyncio.to_thread(_RawServer, host, self.max_bytes)
            await self.answer({"port": self.raw.port, "secret": self.raw.secret.hex()})
        elif op == "sink":
            assert isinstance(req, dict)
            size, count, device = _sink_request(req, self.max_bytes)
            out = self.buffers.get(device)
            if out is None or out.nbytes != size:
                self.buffers.pop(device, None)  # the old buffer goes before the new one comes
                out = self.buffers[device] = allocate(size, device)
            await self.answer("ready")
            landed = await _receive(peer, out, count)
            crc = await crc_of(out, device)
            # a client that asks is told how the node's receives went (one that does not, from
            # before this was told, takes the crc alone)
            await self.answer({"crc32c": crc, "landed": landed} if req.get("landed") else crc)
        elif op == "ping":
            assert isinstance(req, dict)
            count = _count(req.get("count"))
            pong = np.empty(PING_BYTES, np.uint8)
            await self.answer("ready")
            for _ in range(count):
                await peer._recv_own(tag=PING_TAG, out=pong)
                await peer._send_own(pong, tag=PONG_TAG)
        else:
            await self.answer(_error(f"unknown bench request {req!r}", "ProtocolError"))

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        self.buffers.clear()


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ProtocolError(f"a count is an int from 1 to {MAX_COUNT}, not {value!r}")
    return value


def _sink_request(req: dict[str, Any], max_bytes: int) -> tuple[int, int, Device]:
    size = req.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= max_bytes:
        raise ProtocolError(f"a size is an int from 1 to {max_bytes} (this node's limit), not {size!r}")
    return size, _count(req.get("count")), bench_device(str(req.get("device", "cpu")))
