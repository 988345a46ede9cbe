"""The ucx transport: one UCX worker per node; channels are keyed tag streams between workers.

Address blob: ``b"TWU1"`` followed by the UCX worker address. A client creates an endpoint to
that address (without UCX peer error handling, which would disable the shared-memory lanes;
liveness comes from the control-plane lease) and sends HELLO on the well-known hello tag:

::

    HELLO   "TWUH" ver flags sid_len addr_len rx_key ctrl_bytes | limits | process | session id |
            client worker address | HMAC-SHA256(secret, sha256(everything before), sid, "ucx-client")
    WELCOME "TWUW" ver flags 0 0 rx_key ctrl_bytes | limits | process | HMAC(..., "ucx-server")

The server drops a HELLO that does not prove the pending session's secret (a warning, rate
limited), and only then creates an endpoint back to the client. ``rx_key`` is the 32-bit tag
key the sender of that message receives its channel on; ``ctrl_bytes`` the size of its control
receive buffer (so the other side knows how much it may inline); ``process`` the sender's pid,
start time and host tag (``_process``: a node lets go of the payloads of sends UCX never
completed once their peer's process is certainly gone).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..._ratelog import RateLimitedLog
from ...errors import ConfigurationError, ConnectError, PeerDisconnected, ProtocolError, TransportUnavailable
from ...memory._gpudirect import gpudirect_status
from .._base import Capabilities, Channel, Session, Transport, TransportContext
from .._frames import LIMITS, MAX_SESSION_ID, FrameType, PeerLimits, pack, proof
from .._remote import Hold, RegistrationCache
from ._channel import CTRL, HELLO, WELCOME, UcxChannel, ctrl_bytes, make_tag
from ._lanes import CUDA_TLS, NO_MESSAGES_TLS, RDMA_TLS
from ._process import PROCESS, ProcessId
from ._process import me as this_process
from ._ucp import MemoryRegion, Ucp
from ._ucp import load as load_ucp
from ._worker import Worker, context_cuda_support, context_resources, import_ucxx, ucx_options

log = logging.getLogger(__name__)

__all__ = ["ADDRESS_MAGIC", "UcxTransport"]

ADDRESS_MAGIC = b"TWU1"
_HELLO_MAGIC = b"TWUH"
_WELCOME_MAGIC = b"TWUW"
_VERSION = 2  # (2: the process block)
_HEAD = struct.Struct("<4sBBHIII")  # magic, version, flags, sid_len, addr_len, rx_key, ctrl_bytes
_PROOF = 32
_HELLO_MAX = 64 * 1024
_FIXED = _HEAD.size + LIMITS.size + PROCESS.size  # what precedes a HELLO's session id
_WELCOME_BYTES = _FIXED + _PROOF
_PROBED_MAX = 64
# UCX reads a worker address with no length to bound it and trusts what it reads: a format
# version it does not know (the low 4 bits of the first byte: 0 for v1, 1 for v2) fails an
# assertion that aborts the process, and a length field pointing past the end reads beyond the
# buffer. An address comes from a handshake, before any data-plane proof, so its version is
# checked here and UCX gets it followed by zeros: a walk past its end stops at the next
# interface record, whose zero bandwidth UCX refuses (64 KiB outlasts the longest walk, 64
# endpoint addresses of 255 bytes).
_UCX_ADDRESS_VERSIONS = (0, 1)
_ADDRESS_TAIL = bytes(64 << 10)


def _lane_kinds(tls: list[str]) -> tuple[bool, bool]:
    """Whether UCX lists an RDMA transport, and a cuda one."""
    return any(t.startswith(RDMA_TLS) for t in tls), any(t.startswith(CUDA_TLS) for t in tls)


def _memory_kinds(tls: list[str], cuda_support: bool) -> tuple[str, ...]:
    """CUDA memory goes by pointer where UCX lists a cuda transport and ucxx agrees to post device
    buffers (it refuses them where the context's TLS leaves cuda/cuda_copy out)."""
    return ("host", "cuda") if _lane_kinds(tls)[1] and cuda_support else ("host",)


def _gpudirect(tls: list[str], cuda_support: bool, kernel_ready: Callable[[], bool]) -> bool:
    """UCX moves GPU memory over its RDMA lanes itself (GPUDirect RDMA) where it has RDMA lanes,
    takes CUDA memory by pointer (:func:`_memory_kinds`) and the kernel lets the NIC reach GPU
    memory (nvidia-peermem or dma-buf)."""
    return _lane_kinds(tls)[0] and "cuda" in _memory_kinds(tls, cuda_support) and kernel_ready()


def _digest(secret: bytes, body: bytes, sid: bytes, role: bytes) -> bytes:
    return proof(secret, hashlib.sha256(body).digest(), sid, role)


def _read_welcome(reply: bytes, session: Session, sid: bytes) -> tuple[int, int, PeerLimits, ProcessId]:
    """The server's channel key, control buffer size, limits and process from a WELCOME that
    proves the session secret; ProtocolError otherwise."""
    magic, version, _f, _s, _a, server_key, remote_ctrl = _HEAD.unpack_from(reply, 0)
    if magic != _WELCOME_MAGIC or version != _VERSION or server_key == 0:
        raise ProtocolError("expected a tensorwire ucx WELCOME")
    head = reply[:_FIXED]
    if not hmac.compare_digest(
        reply[len(head) : len(head) + _PROOF], _digest(session.secret, head, sid, b"ucx-server")
    ):
        raise ProtocolError("server did not prove the session secret")
    limits = PeerLimits.unpack(head[_HEAD.size : _HEAD.size + LIMITS.size])
    return server_key, remote_ctrl, limits, ProcessId.unpack(head[_HEAD.size + LIMITS.size :])


def _no_welcome(hello_sent: bool, seconds: float, session: Session) -> str:
    """Why a connect that got no WELCOME failed, as far as the client can tell. A server answers
    a HELLO as soon as it takes it, or drops it (its log says why, naming the client node where
    the HELLO proved its session); nothing reaches the client without the endpoint back."""
    if not hello_sent:
        return (
            f"ucx data connection failed: the HELLO to the server did not go out within {seconds:g} s "
            "(Limits.handshake_seconds): UCX could not reach the server's worker"
        )
    return (
        f"ucx data connection failed: the server did not answer this node's HELLO within {seconds:g} s "
        "(Limits.handshake_seconds). A server answers at once unless it dropped the HELLO: most likely it could "
        "not create a UCX endpoint back to the worker address the HELLO gave, or UCX failed there. Its log "
        f"says why: a 'dropped ucx hello' warning naming client node {session.local_node[:8]}"
    )


CONTEXT_REFUSED = "UCX could not create a context"  # how probe() says UCX refused its configuration


class UcxTransport(Transport):
    name = "ucx"
    version = _VERSION  # (nodes of another HELLO layout negotiate another transport)
    extra = "ucx"
    _why_not: ClassVar[str] = "ucx cannot run on this machine"
    connect_sees_server_go = False  # an endpoint without peer error handling: a HELLO to nobody goes unanswered

    @classmethod
    def probe(cls) -> Capabilities | None:
        try:
            import_ucxx()
            options = tuple(sorted(ucx_options().items()))
            resources = context_resources(options)
            cuda_support = context_cuda_support(options)
        except ImportError as exc:
            cls._why_not = f"ucxx is not installed (pip install 'tensorwire[ucx]'): {exc}"
            return None
        except Exception as exc:
            cls._why_not = f"{CONTEXT_REFUSED}: {exc}"
            return None
        tls = [t for t, _ in resources if t != "self"]
        if not tls:
            cls._why_not = "UCX offers no transport here (check UCX_TLS)"
            return None
        if set(tls) <= set(NO_MESSAGES_TLS):
            # offered, it failed at every connect with UCX's bare 'Destination is unreachable'
            chosen = dict(options).get("TLS")
            where = "check UCX_TLS" if chosen is None else f"ucx_options TLS={chosen!r}"
            cls._why_not = (
                f"no lane carries messages: UCX offers only {', '.join(dict.fromkeys(tls))} here ({where}), "
                "which copies the bytes of transfers but carries no messages, so UCX can connect to no peer "
                "over it. Add a transport that does, e.g. TLS='sm' (cma with shared-memory FIFOs) or 'sm,tcp'"
            )
            return None
        try:
            load_ucp()
            one_sided = True  # expose/lookup/read/write use ucp put/get with rkeys
        except TransportUnavailable as exc:
            log.debug("ucx without one-sided: %s", exc)
            one_sided = False
        rdma, cuda = _lane_kinds(tls)
        if cuda and not cuda_support:
            log.warning("UCX lists cuda transports but ucxx will not post device buffers (UCX_TLS leaves cuda out?)")
        return Capabilities(
            memory_kinds=_memory_kinds(tls, cuda_support),
            one_sided=one_sided,
            rdma=rdma,
            gpudirect=_gpudirect(tls, cuda_support, lambda: bool(gpudirect_status()["ready"])),
            lanes=tuple(dict.fromkeys(f"{t}/{d}" for t, d in resources if t != "self")),
            tcp_only=all(t == "tcp" for t in tls),
        )

    @classmethod
    def unavailable_reason(cls) -> str:
        return cls._why_not

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        super().__init__(ctx, capabilities)
        self.options = ucx_options()  # read now: ucx_config() applies to nodes started inside it
        self.worker: Worker | None = None
        self.ucp: Ucp | None = None
        self._channels: set[UcxChannel] = set()
        self._keys: set[int] = set()
        self._probed: OrderedDict[bytes, Any] = OrderedDict()  # worker address -> endpoint from accepts()
        self._waving: set[asyncio.Task[None]] = set()  # given-up connects telling their servers (_wave_off)
        self._hello_buf = np.empty(_HELLO_MAX, np.uint8)
        self._hello_req: Any = None
        self._closed = False
        self._drops = RateLimitedLog(log, per_window=20, window=10.0, what="dropped connections", kind="ucx")
        self.registrations = RegistrationCache(self.name, self._map)
        # memory register_region takes: host, and CUDA where this UCX moves it by pointer
        # (UCX finds a region's memory type itself when it maps it)
        self.region_kinds = frozenset({"host", *(k for k in capabilities.memory_kinds if k == "cuda")})

    def __repr__(self) -> str:
        return f"<UcxTransport channels={len(self._channels)} options={self.options}>"

    def _new_key(self) -> int:
        while True:
            key = secrets.randbits(32)
            if key and key not in self._keys:
                self._keys.add(key)
                return key

    def _w(self) -> Worker:
        if self.worker is None or self._closed:
            raise ConnectError("ucx transport is not listening")
        return self.worker

    # -- listening ---------------------------------------------------------------------------
    async def listen(self) -> bytes:
        self.worker = Worker(self.options)
        try:
            self.ucp = self.worker.bind(load_ucp())  # (its requests then tell the worker they completed)
        except TransportUnavailable as exc:
            log.warning("ucx one-sided bindings unavailable: %s", exc)
        self._post_hello()
        return ADDRESS_MAGIC + self.worker.address

    def _post_hello(self) -> None:
        w = self.worker
        if w is None or self._closed:
            return
        from ucxx._lib.arr import Array

        self._hello_req = w.worker.tag_recv(Array(self._hello_buf), w.lib.UCXXTag(make_tag(0, HELLO)))
        w.watch(self._hello_req, self._on_hello, keep=self._hello_buf, owner=self, passive=True)

    def _parse_address(self, address: bytes) -> bytes | str:
        if len(address) <= len(ADDRESS_MAGIC) or not address.startswith(ADDRESS_MAGIC):
            return f"address blob is not a tensorwire ucx v{_VERSION} address ({address[:8]!r}...)"
        return address[len(ADDRESS_MAGIC) :]

    def _endpoint(self, worker_address: bytes) -> Any:
        w = self._w()
        ep = self._probed.pop(worker_address, None)
        if ep is not None:
            return ep
        version = worker_address[0] & 0x0F if worker_address else None
        if version not in _UCX_ADDRESS_VERSIONS:
            raise ProtocolError(f"not a UCX worker address (format version {version}; UCX writes 0 or 1)")
        addr = w.lib.UCXAddress.create_from_buffer(worker_address + _ADDRESS_TAIL)
        return w.worker.create_endpoint_from_worker_address(addr, False)

    def accepts(self, address: bytes) -> str | None:
        """Whether UCX can reach the peer: tries to create the endpoint (kept for its HELLO)."""
        parsed = self._parse_address(address)
        if isinstance(parsed, str):
            return parsed
        if self.worker is None or self._closed:
            return "ucx transport is not listening"
        if parsed in self._probed:
            return None
        try:
            ep = self._endpoint(parsed)
        except Exception as exc:
            return f"UCX cannot create an endpoint to the peer: {exc}"
        self._probed[parsed] = ep
        while len(self._probed) > _PROBED_MAX:
            _, old = self._probed.popitem(last=False)
            self.worker.track(asyncio.get_running_loop().create_task(self.worker.close_endpoint(old)))
        return None

    def endpoint_lanes(self, address: bytes) -> tuple[str, ...]:
        """The lanes UCX gave the endpoint that :meth:`accepts` created to ``address`` (what a
        channel to that peer will use), or ``()`` when unknown. The lanes a context lists are
        what UCX may use with anyone; an endpoint's are what it can use with this peer: two
        nodes whose shared-memory transports do not match (``TLS="sysv,tcp"`` against
        ``"posix,tcp"``), or on two machines, share only tcp lanes."""
        parsed = self._parse_address(address)
        ep = self._probed.get(parsed) if isinstance(parsed, bytes) else None
        if ep is None or self.ucp is None:
            return ()
        try:
            pairs = self.ucp.ep_transports(ep.handle)
        except Exception as exc:
            log.debug("ucp_ep_query failed: %s", exc)
            return ()
        return tuple(dict.fromkeys(f"{t}/{d}" for t, d in pairs))

    def stranded(self) -> tuple[int, int]:
        return (0, 0) if self.worker is None else self.worker.stranded()

    def _on_hello(self, req: Any) -> None:
        if self._closed:
            return
        try:
            req.check_error()
        except Exception as exc:
            if "cancel" not in str(exc).lower():
                self._drops.warn("dropped ucx hello: %s", exc)
        else:
            try:
                self._accept_hello()
            except ProtocolError as exc:
                self._drops.warn("dropped ucx hello: %s", exc)
            except Exception as exc:
                self._drops.warn("dropped ucx hello: %r", exc)
        self._post_hello()

    def _accept_hello(self) -> None:
        w = self._w()
        buf = self._hello_buf
        magic, version, _flags, sid_len, addr_len, rx_key, remote_ctrl = _HEAD.unpack_from(buf.data, 0)
        if magic != _HELLO_MAGIC or version != _VERSION:
            raise ProtocolError(f"not a tensorwire ucx v{_VERSION} hello")
        if not 0 < sid_len <= MAX_SESSION_ID or not 0 < addr_len <= _HELLO_MAX or rx_key == 0:
            raise ProtocolError("malformed hello")
        body_len = _FIXED + sid_len + addr_len
        if body_len + _PROOF > _HELLO_MAX:
            raise ProtocolError("hello too long")
        body = buf[:body_len].tobytes()
        sid = body[_FIXED : _FIXED + sid_len]
        worker_address = body[_FIXED + sid_len :]
        got = buf[body_len : body_len + _PROOF].tobytes()
        session, fut = self.sessions.admit(
            sid, lambda s: hmac.compare_digest(got, _digest(s.secret, body, sid, b"ucx-client"))
        )
        remote = PeerLimits.unpack(body[_HEAD.size : _HEAD.size + LIMITS.size])
        process = ProcessId.unpack(body[_HEAD.size + LIMITS.size : _FIXED])
        try:
            ep = self._endpoint(worker_address)
        except Exception as exc:
            # nothing can reach the client without that endpoint: it learns only by waiting
            # (handshake_seconds), and its error points here, by its node id
            raise ProtocolError(
                f"cannot create an endpoint back to client node {session.remote_node[:8]} at the worker "
                f"address its HELLO gave: {exc}"
            ) from exc
        my_key = self._new_key()
        channel = UcxChannel(
            w,
            self.ucp,
            ep,
            rx_key=my_key,
            tx_key=rx_key,
            limits=self.ctx.limits,
            remote=remote,
            remote_ctrl=remote_ctrl,
            cuda="cuda" in self.capabilities.memory_kinds,
            name=f"server {session.remote_node[:8]}",
            peer_process=process,
        )
        self._track(channel, my_key)
        head = (
            _HEAD.pack(_WELCOME_MAGIC, _VERSION, 0, 0, 0, my_key, ctrl_bytes(self.ctx.limits))
            + PeerLimits.of(self.ctx).pack()
            + this_process().pack()
        )
        welcome = head + _digest(session.secret, head, sid, b"ucx-server")
        from ucxx._lib.arr import Array

        wreq = ep.tag_send(Array(welcome), w.lib.UCXXTag(make_tag(rx_key, WELCOME)))
        if not wreq.completed:
            w.watch(wreq, lambda r: None, keep=welcome, owner=channel)
        fut.set_result(channel)

    def _track(self, channel: UcxChannel, key: int) -> None:
        self._channels.add(channel)

        def gone(_exc: object) -> None:
            self._channels.discard(channel)
            self._keys.discard(key)

        channel.add_close_callback(gone)

    # -- connecting --------------------------------------------------------------------------
    async def connect(self, address: bytes, session: Session) -> Channel:
        parsed = self._parse_address(address)
        if isinstance(parsed, str):
            raise ConnectError(parsed)
        w = self._w()
        from ucxx._lib.arr import Array

        try:
            ep = self._endpoint(parsed)
        except ProtocolError as exc:
            raise ConnectError(f"ucx data connection failed: {exc}") from exc
        except Exception as exc:
            # (a server that closed after the handshake freed its UCX worker: nothing is left at its
            # worker address, and UCX says so here, before the control connection's end is seen)
            raise ConnectError(
                f"ucx data connection failed: UCX cannot create an endpoint to the server's worker ({exc}): the "
                "server went away after the handshake (its node closed or died), or UCX cannot reach it from here "
                "(UCX_TLS); connect again once it serves"
            ) from exc
        my_key = self._new_key()
        sid = session.id.encode()
        welcome = np.zeros(_WELCOME_BYTES + 64, np.uint8)
        # this handshake's requests, given up together if it fails (owned by the transport, a
        # failed or cancelled connect also gave up the hello receive and other connects' requests:
        # the node then took no more ucx peers)
        mine = object()
        wreq = w.worker.tag_recv(Array(welcome), w.lib.UCXXTag(make_tag(my_key, WELCOME)))
        hello_posted = hello_sent = False
        try:
            async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                head = _HEAD.pack(
                    _HELLO_MAGIC, _VERSION, 0, len(sid), len(w.address), my_key, ctrl_bytes(self.ctx.limits)
                )
                body = head + PeerLimits.of(self.ctx).pack() + this_process().pack() + sid + w.address
                hello = body + _digest(session.secret, body, sid, b"ucx-client")
                hreq = ep.tag_send(Array(hello), w.lib.UCXXTag(make_tag(0, HELLO)))
                hello_posted = True  # (UCX cannot take a send back: it goes out, cancelled or not)
                if not hreq.completed:
                    await w.future(hreq, keep=hello, owner=mine)
                hreq.check_error()
                hello_sent = True
                if not wreq.completed:
                    await w.future(wreq, keep=welcome, owner=mine)
                wreq.check_error()
            server_key, remote_ctrl, remote, process = _read_welcome(welcome.tobytes(), session, sid)
        except BaseException as exc:
            if hello_posted and isinstance(exc, asyncio.CancelledError) and not self._closed:
                # the server may have taken the HELLO and made a peer of us (the WELCOME on its way)
                self._wave_off(ep, wreq, welcome, my_key, session, sid)
                ep = wreq = hreq = None  # (see below)
                raise
            w.cancel(wreq)
            w.hold(wreq, welcome)
            w.abandon(mine)
            self._keys.discard(my_key)
            w.track(asyncio.get_running_loop().create_task(w.close_endpoint(ep)))
            # the error's traceback keeps this frame, and a program may keep the error (a retry
            # loop's last one): not the endpoint and the requests, each of which holds this
            # node's UCX worker, its listening sockets and shared memory, after the node closed
            ep = wreq = hreq = None
            if isinstance(exc, TimeoutError):
                raise ConnectError(_no_welcome(hello_sent, self.ctx.limits.handshake_seconds, session)) from exc
            if isinstance(exc, (ProtocolError, PeerDisconnected)) or (
                isinstance(exc, Exception) and type(exc).__module__.startswith("ucxx")
            ):
                raise ConnectError(f"ucx data connection failed: {str(exc) or type(exc).__name__}") from exc
            raise
        channel = UcxChannel(
            w,
            self.ucp,
            ep,
            rx_key=my_key,
            tx_key=server_key,
            limits=self.ctx.limits,
            remote=remote,
            remote_ctrl=remote_ctrl,
            cuda="cuda" in self.capabilities.memory_kinds,
            name=f"client {session.remote_node[:8]}",
            peer_process=process,
        )
        self._track(channel, my_key)
        return channel

    def _wave_off(self, ep: Any, wreq: Any, welcome: np.ndarray, key: int, session: Session, sid: bytes) -> None:
        """A connect cancelled once its HELLO was out: the server may have taken it and made a
        peer of this node, which it would keep until its lease ran out (no UCX error reaches it:
        peer error handling is off, and no renewal is needed before a lease's end). The WELCOME
        is waited for in the background, as the connect would have (handshake_seconds), and
        answered with a BYE on the channel it names, which ends that peer at the server at once;
        then the endpoint goes. Closing the transport ends the wait."""
        from ucxx._lib.arr import Array

        w = self._w()
        mine = object()

        async def wave_off() -> None:
            try:
                async with asyncio.timeout(self.ctx.limits.handshake_seconds):
                    if not wreq.completed:
                        await w.future(wreq, keep=welcome, owner=mine)
                    wreq.check_error()
                    server_key = _read_welcome(welcome.tobytes(), session, sid)[0]
                    bye = pack(FrameType.BYE)
                    req = ep.tag_send(Array(bye), w.lib.UCXXTag(make_tag(server_key, CTRL)))
                    if not req.completed:
                        await w.future(req, keep=bye, owner=mine)
                    req.check_error()
                log.debug("ucx connect to %s given up: its server was told", session.remote_node[:8])
            except Exception as exc:  # no WELCOME: no peer there
                log.debug("ucx connect to %s given up: the server was not told: %r", session.remote_node[:8], exc)

        def done(_task: object) -> None:  # (also for a task cancelled before it began)
            self._waving.discard(task)
            w.cancel(wreq)
            w.abandon(mine)
            self._keys.discard(key)
            w.track(asyncio.get_running_loop().create_task(w.close_endpoint(ep)))

        task = asyncio.get_running_loop().create_task(wave_off(), name="tensorwire-ucx-wave-off")
        self._waving.add(task)
        task.add_done_callback(done)
        w.track(task)  # after done(): the worker's close waits for the endpoint close it starts

    # -- one-sided ---------------------------------------------------------------------------
    def _map(self, address: int, length: int, writable: bool) -> tuple[bytes, Callable[[], None]]:
        """ucp_mem_map + ucp_rkey_pack, for the registration cache."""
        w = self._w()
        ucp = self.ucp
        if ucp is None:
            raise TransportUnavailable("ucx: the libucp bindings did not load; one-sided is unavailable")
        context = w.context.handle
        memh = ucp.mem_map(context, address, length, writable=writable)
        try:
            rkey = ucp.rkey_pack(context, memh)
        except BaseException:
            ucp.mem_unmap(context, memh)
            raise

        def unmap() -> None:
            if not self._closed:
                ucp.mem_unmap(context, memh)

        return rkey, unmap

    def register_region(self, address: int, length: int, *, writable: bool, owner: Any = None) -> Hold:
        """Register ``[address, address + length)`` with this node's UCX context, through the
        registration cache (the same region registered twice is mapped once)."""
        if length <= 0:
            raise ConfigurationError("cannot register an empty region")
        return self.registrations.acquire(address, length, writable, owner)

    def register(self, buffer: Any) -> MemoryRegion:
        """Register ``buffer`` (writable, bytes-like, C-contiguous) with this node's UCX context.

        Returns a ``MemoryRegion`` whose ``address``/``length``/``rkey`` a peer needs to put to or
        get from it (``UcxChannel.remote_key(region.rkey)``, then ``put``/``get``).
        """
        arr = np.frombuffer(memoryview(buffer).cast("B"), np.uint8)
        hold = self.register_region(arr.ctypes.data, arr.nbytes, writable=True, owner=buffer)
        return MemoryRegion(arr.ctypes.data, arr.nbytes, hold.registration.key, hold)

    # -- lifecycle ---------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._closed:
            return
        self.sessions.cancel_all()
        await asyncio.gather(*[c.aclose() for c in list(self._channels)], return_exceptions=True)
        try:
            self.registrations.clear()  # before the context goes
        except Exception as exc:
            log.warning("ucx: unmapping registered memory failed: %s", exc)
        self._closed = True
        w = self.worker
        if w is None:
            return
        if self._hello_req is not None:
            w.cancel(self._hello_req)
        for task in self._waving:  # (a WELCOME that never comes would hold the close for handshake_seconds)
            task.cancel()
        for ep in self._probed.values():
            w.track(asyncio.get_running_loop().create_task(w.close_endpoint(ep)))
        self._probed.clear()
        try:
            await w.drain()
        except BaseException:  # (cancelled: a second aclose() returns at once, so free it now)
            self._hello_req = None
            w.close()
            raise
        # every ucxx request and endpoint holds the UCX worker it came from, and the worker its
        # context: the hello receive, kept here, kept this node's UCX worker (two listening tcp
        # sockets, a dozen descriptors, its shared-memory segments) as long as anything still
        # referenced the closed node
        self._hello_req = None
        await w.aclose()
