"""The verbs transport: RC queue pairs over pyverbs, one per peer, on one RDMA port per node.

``probe()`` reads sysfs only (is pyverbs installed, is there an active port with a usable GID).
``listen()`` opens the device, picks the GID (``_verbs.choose_gid``: RoCE v2, IPv4-mapped, the
node's own address when it has one), starts the small TCP bootstrap listener on the node's
host and returns the offer blob (``_wire.py``). Each connection creates its queue pair, trades
queue pair numbers and PSNs over the bootstrap socket, proven by the session secret, and keeps
that socket open as its liveness signal.

Device choice: the port whose GID is the node's address, else the first active one; the
environment variable ``TENSORWIRE_VERBS_DEVICE`` ("mlx5_0" or "mlx5_0:1") narrows it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..._ratelog import RateLimitedLog
from ...errors import (
    ConfigurationError,
    ConnectError,
    PeerDisconnected,
    ProtocolError,
    TensorWireError,
    TransportError,
    TransportUnavailable,
)
from .._base import Capabilities, Channel, Session, Transport, TransportContext
from .._frames import LIMITS, MAX_SESSION_ID, NONCE_BYTES, PeerLimits, proof
from .._remote import Hold, Registration, RegistrationCache, pack_remote_key
from ..tcp._transport import _WILDCARDS
from ._channel import VerbsChannel
from ._memory import FAULT_IN_BYTES, MemoryCache, fault_in_span, may_pin, present
from ._queue import QueuePair
from ._verbs import Port, choose_port, claim_event_fds, find_spec, pv, registration_error, unclaim
from ._wire import QP_INFO, Offer, QpInfo

log = logging.getLogger(__name__)

__all__ = ["DEVICE_ENV", "VerbsTransport"]

DEVICE_ENV = "TENSORWIRE_VERBS_DEVICE"
_CHALLENGE = b"TWVC"
_HELLO = b"TWVH"
_WELCOME = b"TWVW"
_READY = b"TWVR"
_SID = struct.Struct("<H")
_PROOF = 32
SLOTS = 64
SLOT_BYTES = 16 * 1024
SEND_SLOTS = 32
MAX_RDMA = 32


def _digest(secret: bytes, nonce: bytes, body: bytes, sid: bytes, role: bytes) -> bytes:
    return proof(secret, hashlib.sha256(nonce + body).digest(), sid, role)


class VerbsTransport(Transport):
    name = "verbs"
    extra = "verbs"
    _why_not: ClassVar[str] = "verbs cannot run on this machine"

    @classmethod
    def probe(cls) -> Capabilities | None:
        if not find_spec():
            cls._why_not = (
                "pyverbs is not installed "
                "(Debian/Ubuntu: apt install python3-pyverbs; or pip install 'tensorwire[verbs]')"
            )
            return None
        port = choose_port(want=os.environ.get(DEVICE_ENV, ""))
        if isinstance(port, str):
            cls._why_not = port
            return None
        if not any(n.startswith("uverbs") for n in _listdir("/dev/infiniband")):
            cls._why_not = "no /dev/infiniband/uverbs* device files (is the ib_uverbs module loaded?)"
            return None
        try:
            pv()
        except ImportError as exc:
            cls._why_not = f"pyverbs does not import: {exc}"
            return None
        # Host memory only, and no GPUDirect, even where dma-buf export is possible here
        # (dmabuf_status): the channel stages CUDA tensors through pinned host chunks and
        # exposes host memory only, so claiming "cuda" would make a path say GPUDirect while
        # its bytes go through host memory. _dmabuf.register_cuda is the piece that would
        # change that, once sends, receives and exposes post GPU memory by its registration.
        return Capabilities(
            memory_kinds=("host",),
            one_sided=True,
            rdma=True,
            gpudirect=False,
            lanes=(f"rc/{port.device}:{port.port}",),
        )

    @classmethod
    def unavailable_reason(cls) -> str:
        return cls._why_not

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        super().__init__(ctx, capabilities)
        self.port: Port | None = None
        self._ctx: Any = None
        self._pd: Any = None
        self._mtu = 0
        self._lid = 0
        self._max_msg = 1 << 30
        self._rd_atomic = 1
        self._event_fds: set[int] = set()
        self.memory: MemoryCache | None = None
        self.registrations = RegistrationCache(self.name, self._map)
        self._later: dict[tuple[int, int, bool], _Later] = {}  # exposures registered once faulted in
        # host memory only: exposing CUDA memory would register it as a dma-buf (_dmabuf.py),
        # which is not wired here yet; such tensors are served through their owner instead
        self.region_kinds = frozenset({"host"})
        self._server: asyncio.Server | None = None
        self._channels: set[VerbsChannel] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._drops = RateLimitedLog(log, per_window=20, window=10.0, what="dropped connections", kind="verbs")

    def __repr__(self) -> str:
        where = self.port.describe() if self.port else "not listening"
        return f"<VerbsTransport {where} channels={len(self._channels)}>"

    # -- listening ------------------------------------------------------------------------------
    async def listen(self) -> bytes:
        port = choose_port(self.ctx.host, want=os.environ.get(DEVICE_ENV, ""))
        if isinstance(port, str):
            raise TransportUnavailable(f"verbs: {port}")
        v = pv()
        try:
            self._ctx = v.device.Context(name=port.device)
            self._event_fds = claim_event_fds()  # its async event file
            self._pd = v.pd.PD(self._ctx)
            pattr = self._ctx.query_port(port.port)
            dattr = self._ctx.query_device()
        except v.pyverbs_error.PyverbsError as exc:
            self._close_device()
            raise TransportUnavailable(f"verbs: cannot open {port.device}: {exc}") from exc
        self.port = port
        self._mtu = int(pattr.active_mtu)
        self._lid = int(pattr.lid)
        self._max_msg = int(pattr.max_msg_sz) or self._max_msg
        self._rd_atomic = max(1, min(16, int(dattr.max_qp_rd_atom), int(dattr.max_qp_init_rd_atom)))
        self.memory = MemoryCache(self._pd)
        self._server = await asyncio.start_server(self._serve, host=self.ctx.host, port=0)
        bport = self._server.sockets[0].getsockname()[1]
        log.debug("verbs listening on %s, bootstrap port %d", port.describe(), bport)
        return Offer(port.port, port.roce, port.gid_index, self._lid, self._mtu, port.gid, self.ctx.host, bport).pack()

    def accepts(self, address: bytes) -> str | None:
        try:
            offer = Offer.unpack(address)
        except ProtocolError as exc:
            return str(exc)
        if self.port is None or self._closed:
            return "verbs transport is not listening"
        if offer.roce != self.port.roce:
            mine = "RoCE" if self.port.roce else "InfiniBand"
            theirs = "RoCE" if offer.roce else "InfiniBand"
            return f"the peer's RDMA port is {theirs}, this node's is {mine}"
        return None

    def _queue_pair(self) -> QueuePair:
        if self.port is None or self._closed:
            raise ConnectError("verbs transport is not listening")
        return QueuePair(
            self._ctx,
            self._pd,
            self.port,
            lid=self._lid,
            mtu=self._mtu,
            slots=SLOTS,
            slot_bytes=SLOT_BYTES,
            send_slots=SEND_SLOTS,
            max_rdma=MAX_RDMA,
            rd_atomic=self._rd_atomic,
            on_completions=lambda wcs: None,
        )

    def _channel(
        self, qp: QueuePair, remote: QpInfo, limits: PeerLimits, writer: asyncio.StreamWriter, name: str
    ) -> VerbsChannel:
        assert self.memory is not None

        def closed() -> None:
            self._channels.discard(channel)
            writer.close()

        channel = VerbsChannel(
            qp,
            self.memory,
            limits=self.ctx.limits,
            remote=limits,
            remote_slots=remote.slots,
            remote_slot_bytes=remote.slot_bytes,
            max_rdma=MAX_RDMA,
            max_msg=self._max_msg,
            name=name,
            on_shutdown=closed,
        )
        qp._on_completions = channel._completions
        self._channels.add(channel)
        channel.start()
        return channel

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        qp: QueuePair | None = None
        channel: VerbsChannel | None = None
        try:
            try:
                async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                    nonce = os.urandom(NONCE_BYTES)
                    writer.write(_CHALLENGE + nonce)
                    head = await reader.readexactly(len(_HELLO) + _SID.size)
                    (sid_len,) = _SID.unpack_from(head, len(_HELLO))
                    if head[: len(_HELLO)] != _HELLO or not 0 < sid_len <= MAX_SESSION_ID:
                        raise ProtocolError("expected a tensorwire verbs HELLO")
                    rest = await reader.readexactly(QP_INFO.size + LIMITS.size + sid_len)
                    body = head + rest
                    sid = rest[QP_INFO.size + LIMITS.size :]
                    got = await reader.readexactly(_PROOF)
                    session, fut = self.sessions.admit(
                        sid, lambda s: hmac.compare_digest(got, _digest(s.secret, nonce, body, sid, b"verbs-client"))
                    )
                    remote = QpInfo.unpack(rest[: QP_INFO.size])
                    limits = PeerLimits.unpack(rest[QP_INFO.size : QP_INFO.size + LIMITS.size])
                    qp = self._queue_pair()
                    qp.connect(remote)
                    welcome = _WELCOME + qp.info().pack() + PeerLimits.of(self.ctx).pack()
                    writer.write(welcome + _digest(session.secret, nonce, welcome, sid, b"verbs-server"))
                    if await reader.readexactly(len(_READY)) != _READY:
                        raise ProtocolError("expected READY")
            except (TransportError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                # (TransportError: a bad or unproven peer, or a queue pair this side could not
                # set up, RegistrationError included: the peer's connect fails as the socket ends)
                self._drops.warn("dropped verbs bootstrap from %s: %s", who, str(exc) or type(exc).__name__)
                if qp is not None:
                    qp.close()
                return
            except BaseException:
                if qp is not None:
                    qp.close()
                raise
            channel = self._channel(qp, remote, limits, writer, f"server {session.remote_node[:8]}")
            if fut.done():
                await channel.aclose()
                return
            fut.set_result(channel)
            await self._watch(reader, channel)
        finally:
            if channel is None:
                writer.close()

    async def _watch(self, reader: asyncio.StreamReader, channel: VerbsChannel) -> None:
        """The bootstrap socket's end is the peer's end: fail what is pending at once."""
        try:
            while await reader.read(4096):
                pass  # nothing is sent after READY; ignore anything a confused peer writes
        except (OSError, asyncio.CancelledError):
            pass
        channel.peer_gone()

    # -- connecting -----------------------------------------------------------------------------
    def dial_address(self, address: bytes, dialled_host: str) -> bytes:
        """A node listening on every interface offers that wildcard as its bootstrap host, which
        names no machine to a peer elsewhere: dial the host whose control plane we reached."""
        try:
            offer = Offer.unpack(address)
        except ProtocolError:
            return address  # connect says what is wrong with it
        if offer.host not in _WILDCARDS or not dialled_host:
            return address
        try:
            return dataclasses.replace(offer, host=dialled_host.strip("[]")).pack()
        except ConfigurationError:  # (a host an offer cannot carry: connect says the wildcard failed)
            return address

    async def connect(self, address: bytes, session: Session) -> Channel:
        try:
            offer = Offer.unpack(address)
        except ProtocolError as exc:
            raise ConnectError(str(exc)) from exc
        why = self.accepts(address)
        if why is not None:
            raise ConnectError(f"verbs: {why}")
        qp: QueuePair | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                try:
                    reader, writer = await asyncio.open_connection(offer.host, offer.bootstrap_port)
                except ValueError as exc:  # UnicodeError too: a name the idna codec refuses ("a..b")
                    raise OSError(f"cannot resolve {offer.host!r}: {exc}") from exc
                challenge = await reader.readexactly(len(_CHALLENGE) + NONCE_BYTES)
                if challenge[: len(_CHALLENGE)] != _CHALLENGE:
                    raise ProtocolError("expected a tensorwire verbs CHALLENGE")
                nonce = challenge[len(_CHALLENGE) :]
                qp = self._queue_pair()
                sid = session.id.encode()
                body = _HELLO + _SID.pack(len(sid)) + qp.info().pack() + PeerLimits.of(self.ctx).pack() + sid
                writer.write(body + _digest(session.secret, nonce, body, sid, b"verbs-client"))
                welcome = await reader.readexactly(len(_WELCOME) + QP_INFO.size + LIMITS.size)
                got = await reader.readexactly(_PROOF)
                if welcome[: len(_WELCOME)] != _WELCOME:
                    raise ProtocolError("expected a tensorwire verbs WELCOME")
                if not hmac.compare_digest(got, _digest(session.secret, nonce, welcome, sid, b"verbs-server")):
                    raise ProtocolError("server did not prove the session secret")
                remote = QpInfo.unpack(welcome[len(_WELCOME) : len(_WELCOME) + QP_INFO.size])
                limits = PeerLimits.unpack(welcome[len(_WELCOME) + QP_INFO.size :])
                qp.connect(remote)
                writer.write(_READY)
                await writer.drain()
        except BaseException as exc:
            if qp is not None:
                qp.close()
            if writer is not None:
                writer.close()
            if isinstance(exc, (ProtocolError, PeerDisconnected, TimeoutError, OSError, asyncio.IncompleteReadError)):
                raise ConnectError(
                    f"verbs connection to {offer.host}:{offer.bootstrap_port} failed: {str(exc) or type(exc).__name__}"
                ) from exc
            raise
        channel = self._channel(qp, remote, limits, writer, f"client {session.remote_node[:8]}")
        task = asyncio.get_running_loop().create_task(self._watch(reader, channel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return channel

    # -- one-sided ------------------------------------------------------------------------------
    def _map(self, address: int, length: int, writable: bool) -> tuple[bytes, Callable[[], None]]:
        """ibv_reg_mr with remote access, for the registration cache (the key is the rkey)."""
        if self._pd is None or self._closed:
            raise TransportUnavailable("verbs transport is not listening")
        v = pv()
        e = v.enums
        access = e.IBV_ACCESS_REMOTE_READ
        if writable:
            access |= e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        try:
            mr = v.mr.MR(self._pd, length, access, address=address)
        except v.pyverbs_error.PyverbsError as exc:
            raise registration_error(exc, length, "an exposed tensor") from exc

        def unregister() -> None:
            mr.close()

        return int(mr.rkey).to_bytes(4, "little"), unregister

    def register_region(self, address: int, length: int, *, writable: bool, owner: Any = None) -> Hold:
        """Register ``[address, address + length)`` for peers' RDMA READ (and WRITE if
        ``writable``), through the registration cache.

        Memory of ``FAULT_IN_BYTES`` or more not all in memory yet (never written: ``np.empty``)
        is registered later, on the loop, once a worker thread has faulted it in
        (``fault_in_span``): ``ibv_reg_mr`` faults it in itself holding the GIL, and ``expose``
        is called on the loop, which stood still meanwhile (in the emulated guest 0.6-1.4 s for
        64 MiB, 3.5-4.5 s for 256 MiB). A peer's lookup before that registers it then
        (``_LateHold.remote_key``), faulting in what is left on the loop, as before. Memory the
        memlock limit will not let this process pin is registered now, and fails now. Where the
        later registration fails all the same (the limit lowered, or memory pinned meanwhile),
        ``expose`` has returned: the exposure stays, without a key, and its peers' reads and
        writes are served by this node (``_Later.settle``)."""
        if length <= 0:
            raise ConfigurationError("cannot register an empty region")
        key = (address, length, writable)
        later = self._later.get(key)
        if later is not None:  # (exposed again while it is faulted in)
            hold = self.registrations.acquire(address, length, writable, owner)
            return _LateHold(hold.registration, self.registrations, later=later)
        if key not in self.registrations.regions and self._fresh(address, length):
            try:
                return self._register_later(address, length, writable, owner)
            except RuntimeError:  # (no worker threads any more: the interpreter is exiting)
                pass
        return self.registrations.acquire(address, length, writable, owner)

    def _fresh(self, address: int, length: int) -> bool:
        """Whether registering these bytes now would fault them in on the loop, and waiting
        will not hide a failure the registration can tell at once."""
        if length < FAULT_IN_BYTES or self._closed:
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # (no loop to free: register now)
            return False
        return may_pin(length) and not present(address, length)

    def _register_later(self, address: int, length: int, writable: bool, owner: Any) -> Hold:
        """A hold on a registration of these bytes made once a worker thread faulted them in."""
        loop = asyncio.get_running_loop()
        key = (address, length, writable)
        reg = Registration(self.name, address, length, writable, b"", b"", lambda: None, owner=owner)
        later = _Later(reg, self._map, lambda: self._later.pop(key, None) if self._later.get(key) is later else None)
        faulting = loop.run_in_executor(None, fault_in_span, address, length, owner)
        faulting.add_done_callback(lambda _: later.settle())
        reg._unregister = later.cancel  # (released before it is registered: it never will be)
        cache = self.registrations
        cache.regions[key] = reg
        cache.registrations += 1
        reg.refs += 1
        self._later[key] = later
        return _LateHold(reg, cache, later=later)

    # -- lifecycle ------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._closed:
            return
        self.sessions.cancel_all()
        await asyncio.gather(*[c.aclose() for c in list(self._channels)], return_exceptions=True)
        self._closed = True
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        try:
            self.registrations.clear()
        except Exception as exc:
            log.warning("verbs: deregistering exposed memory failed: %s", exc)
        if self.memory is not None:
            self.memory.close()
        self._close_device()

    def _close_device(self) -> None:
        for obj in (self._pd, self._ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:
                    log.debug("closing %s failed: %s", type(obj).__name__, exc)
        self._pd = self._ctx = None
        unclaim(self._event_fds)
        self._event_fds = set()


class _Later:
    """An exposure's registration, made once its memory is faulted in (or a peer needs its key
    first); ``cancel`` is its unregister until then."""

    def __init__(
        self,
        registration: Registration,
        register: Callable[[int, int, bool], tuple[bytes, Callable[[], None]]],
        forget: Callable[[], object],
    ) -> None:
        self.registration = registration
        self.error: TensorWireError | None = None
        self._register = register
        self._forget = forget
        self._done = False

    def settle(self) -> None:
        """Register it now, if not done yet (nor cancelled)."""
        if self._done:
            return
        self._done = True
        reg = self.registration
        t0 = time.perf_counter()
        try:
            key, unregister = self._register(reg.address, reg.length, reg.writable)
        except TensorWireError as exc:
            # ``expose`` returned long ago, so nobody is left to raise this to: the exposure
            # degrades as one no one-sided transport registered does. Lookups hand out no key
            # (``_LateHold.remote_key``), so peers read and write it through this node
            # (owner-assisted, their receipts say so); raising from the lookup instead lost the
            # exposure to every peer. Logged once, here (settle runs once per registration).
            log.warning(
                "verbs: could not register %d bytes of exposed memory at %#x after expose returned; "
                "peers' reads and writes of it are served by this node (owner-assisted) until it is "
                "unexposed: %s",
                reg.length,
                reg.address,
                exc,
            )
            self.error = exc  # (it stays findable, so exposing it again is served the same way)
            return
        self._forget()
        reg.key = key
        reg.remote_key = pack_remote_key(reg.transport, reg.address, reg.length, key)
        reg._unregister = unregister
        reg.seconds = time.perf_counter() - t0

    def cancel(self) -> None:
        self._done = True
        self._forget()


@dataclass(eq=False)
class _LateHold(Hold):
    """A hold on a registration ``_Later`` makes: its key registers the memory if not done yet,
    and is empty where that failed (``Hold.remote_key``: peers go through the owner)."""

    later: _Later | None = None

    @property
    def remote_key(self) -> bytes:
        if self.later is not None:
            self.later.settle()
            if self.later.error is not None:
                return b""
        return self.registration.remote_key


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
