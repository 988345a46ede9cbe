"""The control-plane gRPC server: Handshake, node info, health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .._checks import join_address, split_address
from .._ratelog import RateLimitedLog
from ..errors import ClosedResourceError, ConfigurationError, NegotiationError
from ._auth import heartbeat_proof, leave_proof, lookup_proof
from ._client import SESSION_LOST_METADATA
from ._convert import offer_from_pb, offer_to_pb
from ._negotiate import MAX_TRANSPORTS, as_accepted, choose
from ._pb import control_pb2, control_pb2_grpc

if TYPE_CHECKING:
    from .._node import Node

log = logging.getLogger(__name__)

__all__ = ["PROTOCOL_VERSION", "ControlServer"]

# 2: RPC requests carry a stream's first window; 3: checksummed tcp frames carry a header check;
# 4: a heartbeat proves the session secret; 5: tensorwire's own messages have slots of their own
# (transports/_credit.own_slots); 6: an owner serves at most 128 of a peer's one-sided requests at
# once (_onesided.serve_ops)
# 7: a handshake carries each node's instance id (node ids may repeat), and a node renews the leases
# of all its sessions with another in one call (RenewLeases, _leases.py)
# 8: a closing node says goodbye to the nodes of its sessions (Leave, _leases.say_goodbye)
PROTOCOL_VERSION = 8
SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
MAX_NAME_CHARS = 64  # a transport name or require= in a handshake (they are short words)
MAX_REASON_CHARS = 300  # a client's reason for a transport it cannot use, as this node repeats it
MAX_ADDRESS_CHARS = 512  # a client's control address: a DNS name (253 at most) or an IP, and a port
MAX_INSTANCE_ID_CHARS = 64  # a node's instance id (Node.instance_id: 32 hex digits)
MAX_RENEWALS = 2048  # sessions in one RenewLeases call (each costs this node an HMAC)
SECRET_BYTES = 32  # a session secret (a client refuses a handshake answer with any other length)
_LOST, _REFUSED = object(), object()  # (_Servicer._renewal: a session not known here, a wrong proof)
_NO_SESSION = "no such session (closed, expired or never opened: a node restarted at this address)"


def _clip(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


_Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
_S = TypeVar("_S", bound=type)


def _forgetting_aborts(handler: _Handler) -> _Handler:
    """``handler``, whose aborted calls keep nothing of its frames.

    gRPC keeps the last call its server served, with its abort's AbortError, until its next
    call comes. That error's traceback held the handler's frames, and with them their locals (a
    refused lookup's peer with its channel; an Invoke's request and decoded arguments, or the
    result it could not send), and its ``__context__`` the exception an abort in an ``except``
    block answered (through its traceback the frames of the method Invoke ran, and their
    locals): all of it lived on for as long as the node served no other control call. The
    error goes back to gRPC without either, by way of gRPC's own path for an abort a handler
    suppressed (``raise_for_termination`` raises it once the handler has returned)."""

    @functools.wraps(handler)
    async def serve(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError as exc:
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            return None  # (gRPC raises the abort's error itself, without this frame either)

    return serve


def _aborts_keep_no_frames(cls: _S) -> _S:
    """``cls`` with each handler of the Control service wrapped by ``_forgetting_aborts``."""
    for method in control_pb2.DESCRIPTOR.services_by_name["Control"].methods:
        setattr(cls, method.name, _forgetting_aborts(getattr(cls, method.name)))
    return cls


@_aborts_keep_no_frames
class _Servicer(control_pb2_grpc.ControlServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        # refusals are logged, but a client that keeps sending bad ones cannot fill the log
        self._refusals = RateLimitedLog(
            log, per_window=20, window=10.0, what="refused control-plane requests", kind="control"
        )
        # handshakes this node cannot meet (require=, no shared transport): at info, an honest
        # client's among them is no attack; held to as few lines, each with the client's reasons
        self._unmet = RateLimitedLog(
            log, per_window=20, window=10.0, what="unmet handshakes", kind="control", level=logging.INFO
        )

    async def Handshake(  # noqa: N802 - gRPC method name
        self, request: control_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.HandshakeResponse:
        node = self.node
        peer = context.peer()
        if node._closed:  # (its server stops after its peers have closed) a session now would only be dropped
            # (the client shows this after the server's address: "this node" read as the client's own)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the node there is closing; connect again once a node serves there"
            )
        if request.protocol_version != PROTOCOL_VERSION:
            self._refusals.warn("handshake from %s refused: protocol version %d", peer, request.protocol_version)
            # (the client shows this after the server's address: "this node" read as the client's own)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"control protocol version {request.protocol_version} is refused: this server speaks version "
                f"{PROTOCOL_VERSION}, and nodes connect only at the same version (run tensorwire releases of the "
                "same protocol version on both nodes)",
            )
        token = node.config.auth_token
        if token is not None and not hmac.compare_digest(request.auth_token.encode(), token.encode()):
            missing = not request.auth_token
            self._refusals.warn("handshake from %s refused: %s auth token", peer, "missing" if missing else "wrong")
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{'no auth token given' if missing else 'wrong auth token'} (both nodes need the same auth_token: "
                "tensorwire.start(..., auth_token=...) on each, or --token or $TENSORWIRE_TOKEN for the command line)",
            )
        sizes = (len(request.preference), len(request.offers), len(request.unavailable))
        if max(sizes) > MAX_TRANSPORTS:
            self._refusals.warn("handshake from %s refused: %d preferences, %d offers, %d reasons", peer, *sizes)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a handshake names at most {MAX_TRANSPORTS} transports in each of its preference order, "
                f"offers and reasons (got {sizes[0]}, {sizes[1]}, {sizes[2]})",
            )
        names = [*request.preference, *(o.name for o in request.offers), *(u.name for u in request.unavailable)]
        longest = max(map(len, [*names, request.require]), default=0)
        if longest > MAX_NAME_CHARS:
            # they come back in reasons, refusals and this node's log: 32 names of 100 KB made a
            # 3 MB log line per handshake and a refusal too big for gRPC's trailers to carry
            self._refusals.warn("handshake from %s refused: a transport or require name of %d chars", peer, longest)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"transport names and require= are at most {MAX_NAME_CHARS} characters (got one of {longest})",
            )
        # the session waiting for its data connection keeps both for connect_timeout, and the
        # control address becomes the target (and the error text) of lookups back to the client:
        # 150 handshakes with 1.9 MB of each held 600 MB of this node's memory for 10 s
        max_id = node.config.MAX_NODE_ID_CHARS
        if (
            len(request.node_id) > max_id
            or len(request.control_address) > MAX_ADDRESS_CHARS
            or len(request.instance_id) > MAX_INSTANCE_ID_CHARS
        ):
            self._refusals.warn(
                "handshake from %s refused: a node id of %d chars, a control address of %d, an instance id of %d",
                peer,
                len(request.node_id),
                len(request.control_address),
                len(request.instance_id),
            )
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a node id is at most {max_id} characters, a control address at most {MAX_ADDRESS_CHARS} and an "
                f"instance id at most {MAX_INSTANCE_ID_CHARS} (got {len(request.node_id)}, "
                f"{len(request.control_address)} and {len(request.instance_id)})",
            )
        if request.control_address:
            # where this node dials back (lookups, its goodbye): one that is no host:port made
            # the session, and the first lookup failed late, in gRPC's words. (A host other than
            # the caller's is taken as it is: a node with several interfaces may serve on one and
            # call from another. None given: nothing is looked up back there.)
            try:
                split_address(request.control_address, lowest_port=1)
            except ConfigurationError as exc:
                self._refusals.warn("handshake from %s refused: control address %r", peer, request.control_address)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"control address {request.control_address!r} (where the accepting node would call the client "
                    f"back) cannot be dialled: {exc}",
                )
        remote = {o.name: offer_from_pb(o) for o in request.offers}
        remote_unusable = {u.name: _clip(u.reason) for u in request.unavailable}
        preference = list(request.preference) or list(node.config.transports)
        here_name, there_name = f"server {node.node_id[:8]}", f"client {request.node_id[:8] or '?'}"
        try:
            choice = choose(
                preference,
                node.offers,
                remote,
                node.unusable,
                remote_unusable,
                request.require or "any",
                node.reachable,
                local_name=here_name,
                remote_name=there_name,
                transports=node.transports,
            )
        except (NegotiationError, ConfigurationError) as exc:
            # (counted in tensorwire_refusals_total; its text, not the error: a log record a handler
            # keeps would keep the error's traceback, and through it choose's frames)
            self._unmet.warn("handshake from %s: %s", peer, str(exc))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        session_id = uuid.uuid4().hex
        secret = os.urandom(SECRET_BYTES)
        # the client's path names what its order passed over; this node's path names what its
        # own order puts above the choice too (the response is unchanged)
        here = as_accepted(
            choice,
            node.config.transports,
            preference,
            node.offers,
            remote,
            node.unusable,
            remote_unusable,
            local_name=here_name,
            remote_name=there_name,
        )
        node._expect_peer(
            here,
            session_id,
            secret,
            request.node_id,
            remote_addr=peer,
            control_address=request.control_address,
            remote_instance=request.instance_id,
            # (under mutual TLS: the certificate the client proved, whose name calls back check)
            proven=context.auth_context()
            if node.config.tls is not None and node.config.tls.require_client_cert
            else None,
        )
        resp = control_pb2.HandshakeResponse(
            session_id=session_id,
            session_secret=secret,
            server_node_id=node.node_id,
            server_instance_id=node.instance_id,
            protocol_version=PROTOCOL_VERSION,
            chosen=offer_to_pb(node.offers[choice.name]),
            lease_ms=int(node.config.lease_seconds * 1000),
        )
        for name, reason in choice.passed_over:
            resp.passed_over.add(name=name, reason=reason)
        return resp

    async def Heartbeat(  # noqa: N802 - gRPC method name
        self, request: control_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.HeartbeatResponse:
        renewed = self._renewal(request, "heartbeat", context)
        if renewed is _LOST:
            await context.abort(grpc.StatusCode.NOT_FOUND, _NO_SESSION)
        if renewed is _REFUSED:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "lease renewals need the session's proof")
        return control_pb2.HeartbeatResponse(lease_ms=int(self.node.config.lease_seconds * 1000))

    def _renewal(self, request: control_pb2.HeartbeatRequest, what: str, context: grpc.aio.ServicerContext) -> object:
        """Renew the lease of ``request``'s session if its proof is right: None, else ``_LOST``
        (no such session here) or ``_REFUSED`` (a wrong proof: knowing a session's id, which
        travels in the clear, must not keep a dead peer alive)."""
        secret = self.node._lease_secret(request.session_id)
        if secret is None:
            return _LOST
        if not hmac.compare_digest(request.proof, heartbeat_proof(secret, request.session_id)):
            self._refusals.warn("%s from %s refused: bad proof", what, context.peer())
            return _REFUSED
        self.node._renew(request.session_id)
        return None

    async def _at_most_sessions(self, n: int, what: str, verb: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse (INVALID_ARGUMENT) a call naming more than MAX_RENEWALS sessions: each costs
        this node an HMAC."""
        if n > MAX_RENEWALS:
            self._refusals.warn("%s from %s refused: %d sessions", what, context.peer(), n)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"one call {verb} at most {MAX_RENEWALS} sessions (got {n})"
            )

    async def RenewLeases(  # noqa: N802 - gRPC method name
        self, request: control_pb2.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.RenewLeasesResponse:
        """Heartbeat for many sessions at once; a session this node does not know, or whose
        proof is wrong, is said so in the answer and does not stop the others' renewal."""
        await self._at_most_sessions(len(request.renewals), "lease renewal", "renews", context)
        response = control_pb2.RenewLeasesResponse()
        for renewal in request.renewals:
            renewed = self._renewal(renewal, "lease renewal", context)
            if renewed is _LOST:
                response.lost.append(renewal.session_id)
            elif renewed is _REFUSED:
                response.refused.append(renewal.session_id)
        return response

    async def Leave(  # noqa: N802 - gRPC method name
        self, request: control_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.LeaveResponse:
        """A node closing says goodbye: each session named, known here and proved, ends as at
        its lease's end, without the wait (``Node._peer_left``); the others are passed over."""
        await self._at_most_sessions(len(request.sessions), "goodbye", "ends", context)
        ended = 0
        for leaving in request.sessions:
            peer = self.node._leaving_peer(leaving.session_id)
            session = None if peer is None else peer.session
            if peer is not None and (session is None or peer._closed):
                continue  # (a peer this node closes ends with its own ClosedResourceError)
            # no peer: a client that gave up its connect after the handshake, before its data
            # connection came (Node._give_up), whose session waits for it no longer
            secret = self.node._opening_secrets.get(leaving.session_id) if session is None else session.secret
            if secret is None:
                continue
            if not hmac.compare_digest(leaving.proof, leave_proof(secret, leaving.session_id)):
                self._refusals.warn("goodbye from %s refused: bad proof", context.peer())
                continue
            if peer is None:
                ended += self.node._drop_opening(leaving.session_id)
            else:
                ended += not peer.closed  # (one whose close on the data connection came first ended already)
                self.node._peer_left(peer)
        return control_pb2.LeaveResponse(ended=ended)

    async def Lookup(  # noqa: N802 - gRPC method name
        self, request: control_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.LookupResponse:
        node = self.node
        peer = await node._session_peer_soon(request.session_id)
        if peer is None or peer.session is None:
            # the session ended here (closed, its lease ran out) or never was here: this node
            # restarted at that address. Not a refusal of credentials: the caller's peer is gone.
            # (UNAUTHENTICATED as for a bad proof, marked so that our client can tell the two apart)
            log.info("lookup of %r from %s: no such session", request.name[:64], context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _NO_SESSION, SESSION_LOST_METADATA)
            raise AssertionError("unreachable: abort raises")
        # (an abort here keeps nothing of this frame, its peer among it: _forgetting_aborts)
        if not hmac.compare_digest(request.proof, lookup_proof(peer.session.secret, request.name)):
            self._refusals.warn("lookup of %r from %s refused: bad proof", request.name[:64], context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "lookups need an open session and its proof")
            raise AssertionError("unreachable: abort raises")
        entry = node.exposures.get(request.name)
        if entry is None:
            name = request.name if len(request.name) <= 200 else request.name[:200] + "..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name!r} is not exposed")
            raise AssertionError("unreachable: abort raises")
        h = entry.handle
        resp = control_pb2.LookupResponse(
            name=h.name,
            dtype=h.dtype,
            shape=list(h.shape),
            nbytes=h.nbytes,
            generation=h.generation,
            writable=h.writable,
            memory=h.memory,
        )
        # a one-sided key for the transport this peer's channel uses, if it registered the tensor
        # (none where it could not after all: the peer is served by this node, owner-assisted)
        hold = entry.holds.get(peer.channel.transport)
        key = hold.remote_key if hold is not None else b""
        if key:
            resp.transport = peer.channel.transport
            resp.remote_key = key
            entry.given.add(request.session_id)  # unexpose waits for this peer to acknowledge
        return resp

    async def GetNodeInfo(  # noqa: N802 - gRPC method name
        self, request: control_pb2.NodeInfoRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.NodeInfo:
        node = self.node
        info = control_pb2.NodeInfo(
            node_id=node.node_id,
            protocol_version=PROTOCOL_VERSION,
            preference=list(node.config.transports),
            auth_required=node.config.auth_token is not None,
        )
        for offer in node.offers.values():
            info.offers.append(offer_to_pb(offer, with_address=False))
        for name, reason in node.unusable.items():
            info.unavailable.add(name=name, reason=reason)
        return info

    async def ListMethods(  # noqa: N802 - gRPC method name
        self, request: control_pb2.ListMethodsRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListMethodsResponse:
        from ..rpc import _grpc  # here, not at the top: rpc imports tensors, which import control

        return await _grpc.list_methods(self.node, request, context)

    async def Invoke(  # noqa: N802 - gRPC method name
        self, request: control_pb2.InvokeRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.InvokeResponse:
        from ..rpc import _grpc

        return await _grpc.invoke(self.node, request, context)


def bind_targets(host: str) -> list[tuple[socket.AddressFamily, str]] | None:
    """The addresses gRPC binds for a server on ``host``, where they are certain: an IP address
    as written; both loopbacks for "localhost", in any case (gRPC's resolver gives both, whatever
    /etc/hosts says, for "LOCALHOST" too); a dual-stack socket or else an IPv4 one for every
    interface ("0.0.0.0", "::"). None for any other name: gRPC resolves it its own way. The
    bench's baseline listens where this says (tensorwire._bench._server)."""
    if host.lower() == "localhost":
        return [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_unspecified:
        return [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    return [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, host)]


def _why_unbindable(host: str, port: int) -> str | None:
    """What the OS says to a listener at (host, port), as gRPC binds it (SO_REUSEADDR, each
    address in turn; it needs one): "Address already in use" where another process serves that
    port. None: one of them would bind after all."""
    targets = bind_targets(host)
    try:
        if targets is None:
            targets = [(f, str(a[0])) for f, _, _, _, a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError as exc:
        return exc.strerror or str(exc)
    why = None
    for family, addr in targets:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: gRPC cannot use it either
            continue
        with sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # gRPC makes every IPv6 listener dual-stack
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((addr, port))
            except OSError as exc:
                why = why or exc.strerror or str(exc)
                continue
        return None
    return why


_LOOPBACK_TRIES = 8


def _listenable(targets: list[tuple[socket.AddressFamily, str]]) -> list[tuple[socket.AddressFamily, str]]:
    """Those of ``targets`` this host can listen on at some port (a host without IPv6 has no ::1)."""
    usable = []
    for family, addr in targets:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((addr, 0))
        except OSError:
            continue
        usable.append((family, addr))
    return usable


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


class _SweepWatch(asyncio.Task[None]):
    """A task that waits forever and calls ``on_cancel`` (once, synchronously) when something
    cancels it: the sweep of ``asyncio.run``'s end (or code like it) cancels every task of the
    loop before any of them runs again, so ``on_cancel`` runs while the others are still as they
    were."""

    def __init__(self, on_cancel: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(_forever(), loop=loop, name="tensorwire-control-sweep-watch")
        self._on_cancel: Callable[[], None] | None = on_cancel

    def cancel(self, msg: Any = None) -> bool:
        on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is not None:
            on_cancel()
        return super().cancel(msg)


class ControlServer:
    """A grpc.aio server with the Control service, health checking and reflection."""

    def __init__(self, node: Node) -> None:
        self._node = node
        # (None once stopped: a closed node that its user still holds lets gRPC's server go, and
        # with the last of gRPC's objects gRPC's poller thread, which lives as long as any does)
        self._server: grpc.aio.Server | None
        self._health: health.aio.HealthServicer | None
        self._server, self._health = self._build()
        self.port = 0
        self._tls = node.config.tls
        self._stopping = False
        self._sweep_watch: _SweepWatch | None = None
        # gRPC's start of the current server, once begun (``_start_server``): a stop waits for it
        self._starting: asyncio.Future[None] | None = None

    def _build(self) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        control_pb2_grpc.add_ControlServicer_to_server(_Servicer(self._node), server)  # type: ignore[no-untyped-call]
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        return server, health_servicer

    def _serving(self) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
        """gRPC's server and its health servicer; ClosedResourceError once stopping. (A port
        added to gRPC's server while it stops, or once it has started, fails gRPC's check that
        every listener was destroyed: the process aborts.)"""
        if self._stopping or self._server is None or self._health is None:
            raise ClosedResourceError("node is closed")
        return self._server, self._health

    async def start(self, host: str, port: int) -> int:
        if host.lower() == "localhost":
            self.port = await self._bind_loopbacks(host, port)
        else:
            self.port = await self._bind(host, port)
        await self._start_server(self._serving()[0])
        # (ClosedResourceError where the node closed meanwhile: its stop has stopped the server,
        # and a sweep watch made now would wait, uncancelled, until the loop's end)
        _, health_servicer = self._serving()
        self._sweep_watch = _SweepWatch(self._begin_stop_now)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def _bind(self, host: str, port: int) -> int:
        """Add a listening port at (host, port) to gRPC's server: the port it bound."""
        target = join_address(host, port)
        tls = self._tls
        # gRPC logs its own lines to stderr when it cannot bind ("Failed to add port ..."): a
        # port that is plainly taken is refused before gRPC sees it, so that the error below is
        # all a user reads; one taken in between still ends in that error, after gRPC's line
        certain = port != 0 and bind_targets(host) is not None
        if certain and (why := await asyncio.to_thread(_why_unbindable, host, port)) is not None:
            raise ConfigurationError(f"cannot bind the control plane to {target}: {why}")
        server, _ = self._serving()
        try:
            if tls is None:
                return int(server.add_insecure_port(target))
            return int(server.add_secure_port(target, tls.server_credentials()))
        except RuntimeError as exc:
            # grpc says only "Failed to bind" (and where to read more): ask the OS why
            why = await asyncio.to_thread(_why_unbindable, host, port)
            if why is None and tls is not None:
                # the OS would bind it: what gRPC refused is the TLS material, which Python's
                # OpenSSL loaded (TLSConfig checks that) and gRPC's BoringSSL does not take
                raise ConfigurationError(
                    f"cannot serve the control plane over TLS with the certificate {tls.cert_file!r} and the key "
                    f"{tls.key_file!r}: gRPC's TLS library (BoringSSL) refused them, most likely for their key type "
                    "(it serves with RSA keys, and ECDSA keys on P-256 or P-384)"
                ) from exc
            raise ConfigurationError(f"cannot bind the control plane to {target}: {why or exc}") from exc

    async def _bind_loopbacks(self, host: str, port: int) -> int:
        """Listen on every loopback this host has (127.0.0.1 and ::1) at one port, or refuse.

        gRPC binds "localhost:P" on each loopback and is content with one: where another
        listener held P on the other, the node served on half of its name, and a client that
        resolved "localhost" to that other loopback reached that listener instead. Port 0 got
        P from the first bind and could meet that on the second; such a port is given back and
        another tried. A port asked for must be free on each loopback."""
        target = join_address(host, port)
        loopbacks = await asyncio.to_thread(_listenable, bind_targets("localhost") or [])
        if not loopbacks:
            raise ConfigurationError(f"cannot bind the control plane to {target}: this host has no loopback to bind")
        for _, addr in loopbacks if port != 0 else ():
            if (why := await asyncio.to_thread(_why_unbindable, addr, port)) is not None:
                where = join_address(addr, port)
                raise ConfigurationError(f"cannot bind the control plane to {target}: {where}: {why}")
        for _ in range(_LOOPBACK_TRIES):
            bound = await self._bind(loopbacks[0][1], port)
            taken = [
                (addr, why)
                for _, addr in loopbacks[1:]
                if (why := await asyncio.to_thread(_why_unbindable, addr, bound)) is not None
            ]
            try:
                if not taken:
                    for _, addr in loopbacks[1:]:
                        await self._bind(addr, bound)
                    return bound
                addr, why = taken[0]
                refusal = ConfigurationError(
                    f"cannot bind the control plane to {target}: {join_address(addr, bound)}: {why}"
                )
            except ConfigurationError as exc:  # (taken since it was checked)
                refusal = exc
            await self._give_back_ports()
            if port != 0:
                raise refusal
            log.debug("the control plane tries another port: %s", refusal)
        raise ConfigurationError(
            f"cannot bind the control plane to {target}: in {_LOOPBACK_TRIES} tries no port was free on every loopback"
        )

    async def _give_back_ports(self) -> None:
        """Free the ports gRPC's server (not started) has bound, and begin a new server: gRPC
        frees them only once its server has started and stopped."""
        await self._start_server(self._serving()[0])
        await self._serving()[0].stop(None)  # (stopping meanwhile: the node's stop stops it)
        if self._stopping:  # (the node closed meanwhile: no new server for it to leave behind)
            raise ClosedResourceError("node is closed")
        self._server, self._health = self._build()
        self._starting = None

    async def _start_server(self, server: grpc.aio.Server) -> None:
        # grpc's start, cancelled half-way, leaves a server that can never stop (its serving task
        # dies with InvalidStateError, which stop() then raises): let it finish, then cancel
        if self._starting is None:
            self._starting = asyncio.ensure_future(server.start())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except BaseException:
            while not starting.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({starting})
            raise

    def _begin_stop_now(self) -> None:
        """Begin gRPC's stop at once, without awaiting: ``asyncio.run`` ending is about to cancel
        every task, gRPC's own among them (see _SweepWatch). gRPC's server lends the C core, for
        each call it waits for, fields of an object that only the waiting task holds; cancelled,
        that task frees them, and a stop after that had the core write into freed memory (a
        NULL into whatever object lived there next: a crash, or a silent corruption). The stop's
        first step, up to its first wait, tells the core to shut down, which fails those calls
        while their fields are alive; the node's own close (at the loop's end, or any later
        stop) finishes it."""
        if self._stopping or self._server is None:
            return
        stop = self._server.stop(None)
        try:
            stop.send(None)  # runs up to its wait for gRPC's serving task
        except StopIteration:
            return
        except Exception:  # (a stop that fails here is finished by the next one)
            log.debug("beginning gRPC's stop failed", exc_info=True)
            return
        stop.close()  # (leaves gRPC's server stopping: the next stop waits for the core and destroys it)

    async def stop(self, grace: float | None) -> None:
        """Stop serving; idempotent. Once stopped, this holds nothing of gRPC's (a stop that was
        cancelled part way is finished by the next)."""
        self._stopping = True
        if self._sweep_watch is not None:
            self._sweep_watch.cancel()
        if self._server is None or self._health is None:
            return
        server = self._server
        await self._health.enter_graceful_shutdown()
        if self._starting is None or not self._starting.done():
            # gRPC frees a server's ports, and its core, only once it has started and stopped:
            # its stop does nothing to one never started (a node closed during its bind held
            # them for the process's life), so that one starts first; and a start under way
            # finishes first (gRPC's start and stop are not meant to overlap)
            with contextlib.suppress(Exception):  # (grpc.aio.UsageError: not startable, nor then stoppable)
                await self._start_server(server)
        try:
            await server.stop(grace)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # not us: gRPC's serving task was cancelled (asyncio.run cancels every task as its
            # loop shuts down, and a node left open closes after that), and its stop, which
            # awaits that task, raised its CancelledError half way; a second stop finishes
            # (without it the core server was never destroyed, and gRPC's poller thread, which
            # waits for it, hung the next gc.collect() that freed the server)
            await server.stop(grace)
        self._server = self._health = None
