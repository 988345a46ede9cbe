"""The control-plane client: one gRPC channel per peer, every call with a deadline."""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from .._checks import split_address
from ..errors import (
    AuthenticationError,
    ClosedResourceError,
    ConfigurationError,
    ConnectTimeout,
    ControlPlaneError,
    HandleNotFound,
    NegotiationError,
)
from ._pb import control_pb2, control_pb2_grpc
from ._tls import TLSConfig

__all__ = ["ControlClient", "NodeClosing", "SessionLost", "WhyClosed", "map_rpc_error"]

_R = TypeVar("_R")


class SessionLost(ControlPlaneError):
    """The server dropped the session (it restarted, or the lease ran out)."""


class NodeClosing(ControlPlaneError):
    """The server cancelled the call before answering: gRPC does that to the calls a server still
    holds as it stops, and a node stops its server as it closes, once its peers are closed."""


# trailing metadata of a Lookup refused because the server does not know the session at all
SESSION_LOST_METADATA = (("tensorwire-session", "lost"),)


_TLS_FAILURE = ("ssl", "handshake", "certificate", "hostname verification")
# a handshake unanswered this long (seconds) is watched: is anything still listening there?
_HANDSHAKE_WATCH_AFTER = 1.0
# how long (seconds) ``nothing_listens`` waits on a connection it got for the server's first
# word, or its drop (a dying listener's backlog goes within milliseconds)
_UNANSWERED = 0.25


class WhyClosed(enum.Enum):
    """Why a server closed a plaintext control connection before answering: a TLS server does
    that to plaintext, and so does a node that is closing. ``probe_closed`` tells them apart."""

    SERVES_TLS = "serves TLS"  # it answered a TLS handshake
    CLOSING = "closing"  # it speaks plaintext HTTP/2 (it answered before, or said GOAWAY) or no TLS
    CLOSED = "closed"  # nothing listens there any more
    UNKNOWN = "unknown"  # not probed, or the probe got no answer in time


async def nothing_listens(target: str, seconds: float) -> bool:
    """Whether no server listens at ``target`` any more: a new TCP connection is refused, or is
    dropped (reset, or closed) before the server said a word. A gRPC server speaks first (its
    HTTP/2 settings, as it accepts), and the listener of a process being killed holds new
    connections in its backlog unaccepted, then resets them as it goes: the kernel closes a
    killed node's connections before its listener, so a probe made as the first of them
    failed got in, and the peer, gone, was reported as unreachable (ControlPlaneError) rather
    than disconnected. An answer, or none within ``_UNANSWERED`` (a TLS server waits for our
    hello), or any other failure, says nothing of the sort."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    try:
        async with asyncio.timeout_at(until):
            reader, writer = await asyncio.open_connection(*split_address(target))
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, TimeoutError):
        return False
    try:
        async with asyncio.timeout_at(min(until, loop.time() + _UNANSWERED)):
            said = await reader.read(1)
    except ConnectionResetError:
        return True
    except (OSError, TimeoutError):
        return False
    finally:
        writer.transport.abort()
    return not said


async def probe_closed(target: str, seconds: float) -> WhyClosed:
    """Offer ``target`` a TLS handshake (nothing is verified: we only learn whether it speaks
    TLS), to tell a TLS node refusing our plaintext from a node that closed under us. Costs one
    connection, made only after a plaintext connect failed so."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(seconds):
            host, port = split_address(target)
            try:
                _, writer = await asyncio.open_connection(host, port, ssl=context)
            except ConnectionResetError:
                # a connection the closing listener had queued is reset as it goes: ask again
                _, writer = await asyncio.open_connection(host, port, ssl=context)
        writer.transport.abort()  # (no TLS close_notify exchange to wait for)
        return WhyClosed.SERVES_TLS
    except ssl.SSLError as exc:  # a TLS alert (no client certificate, say) is a TLS answer too
        return WhyClosed.SERVES_TLS if "ALERT" in (exc.reason or "") else WhyClosed.CLOSING
    except ConnectionRefusedError:
        return WhyClosed.CLOSED
    except (OSError, ValueError, TimeoutError):  # (a second reset, an address we cannot parse, no answer)
        return WhyClosed.UNKNOWN


async def probe_plaintext(target: str, seconds: float) -> bool | None:
    """Ask ``target`` in plaintext for its node info, after it failed a TLS handshake with the
    answer a plaintext server gives (WRONG_VERSION_NUMBER): True if a tensorwire node answers
    (one started without tls=), False if something else does (another gRPC service, an HTTP
    server: its answer is no node's), None if neither said so in time. Nothing secret travels:
    node info needs no token."""
    channel = grpc.aio.insecure_channel(f"dns:///{target}", options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        stub = control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
        await stub.GetNodeInfo(control_pb2.NodeInfoRequest(), timeout=seconds)
        return True
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED or _not_http2(exc.details() or ""):
            return False
        return None
    finally:
        await channel.close()


def _host(target: str) -> str | None:
    try:
        return split_address(target)[0]
    except ConfigurationError:
        return None


def _not_http2(detail: str) -> bool:
    """What gRPC says of a server whose first bytes are not HTTP/2 (an HTTP/1 server, garbage)."""
    return "failed parsing http/2" in detail.lower()


_CLOSED_HINTS = {
    WhyClosed.CLOSING: " (the node closed the connection before answering: it is most likely closing; "
    "connect again once it serves)",
    WhyClosed.CLOSED: " (the node closed the connection before answering, and now refuses new ones: it "
    "has closed; connect again once it serves)",
    WhyClosed.UNKNOWN: " (the node closed the connection before answering: it may be closing, or it "
    "serves TLS and this node needs tls= too)",
}


def _plaintext_answer(detail: str) -> bool:
    """A TLS handshake that failed because the server answered in plaintext."""
    return "wrong_version_number" in detail.lower()


def _cancelled_all(detail: str) -> bool:
    """What gRPC says (UNAVAILABLE) of the calls a server held as its stop's grace ran out."""
    return "cancelling all calls" in detail.lower()


def _cut(detail: str) -> bool:
    """A connection the server closed or reset before answering. Under TLS, a server that
    refuses our certificate does that (gRPC says "Socket closed"), and so does one that dies or
    closes as we connect ("Handshake read failed (recvmsg:Connection reset by peer)")."""
    low = detail.lower()
    return any(w in low for w in ("socket closed", "connection reset", "broken pipe"))


def _closed_plaintext(detail: str) -> bool:
    """A plaintext connection the server closed before answering: what a TLS server does to
    plaintext, and what a closing node may do. (One that said GOAWAY spoke plaintext HTTP/2.)"""
    low = detail.lower()
    return "socket closed" in low and "goaway" not in low


def map_rpc_error(
    exc: grpc.aio.AioRpcError,
    target: str,
    *,
    tls: bool = False,
    closed: WhyClosed = WhyClosed.UNKNOWN,
    plaintext: bool | None = None,
    checked_name: str | None = None,
) -> Exception:
    """A control-plane failure as an error from the tree. With TLS on, a server that closes the
    connection during setup has most likely rejected our certificate, and we say so; one that
    answered our TLS hello as plaintext is a node started without tls= where ``plaintext`` (see
    ``probe_plaintext``) found one, and not a tensorwire node at all where it found something
    else. Without TLS, ``closed`` says why the server closed the connection before answering,
    when it did (see ``probe_closed``); with TLS, CLOSED or CLOSING says that the server, after it
    cut the TLS setup (``_cut``), refused or dropped a fresh one: a node that died or is closing,
    not one that refused our certificate. ``checked_name``: the name a TLS client checks the
    server's certificate for, said where it lacks it."""
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{target} refused the handshake: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return NegotiationError(f"{target}: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ConnectTimeout(f"{target} did not answer in time ({detail})")
    if code == grpc.StatusCode.CANCELLED or (code == grpc.StatusCode.UNAVAILABLE and _cancelled_all(detail)):
        # Our own cancellations and closes reach the caller as asyncio.CancelledError (see
        # _unary), so this is the server's: gRPC cancels the calls it holds unanswered as the
        # node closes (its server stops, or its event loop shuts down)
        return NodeClosing(
            f"the tensorwire node at {target} cancelled the call before answering ({detail}): it is "
            "most likely closing; connect again once it serves again"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED or _not_http2(detail):
        # another gRPC service ("Method not found!"), an HTTP/2 server or proxy ("status: 404"),
        # or an HTTP/1 one: the address or port is most likely not that of a tensorwire node
        return ControlPlaneError(
            f"{target} is not a tensorwire node's control plane (something else answers there: "
            f"{code.name}: {detail}); check the address and port"
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) and tls:
        if closed in (WhyClosed.CLOSED, WhyClosed.CLOSING):
            # the server cut the TLS setup and no longer completes one: it died or is closing
            # under the connect, which says nothing of our certificate
            return ControlPlaneError(f"cannot reach a tensorwire node at {target}: {detail}{_CLOSED_HINTS[closed]}")
        low = detail.lower()
        if any(w in low for w in _TLS_FAILURE):
            hint = ""
            if "hostname verification" in low and checked_name is not None:
                hint = (
                    f" (the server's certificate does not carry the name {checked_name!r}: connect at a name it "
                    "carries, or give that name as TLSConfig.server_name)"
                )
            if _plaintext_answer(low):  # what a plaintext server answers a TLS hello with
                if plaintext is False:
                    return ControlPlaneError(
                        f"{target} is not a tensorwire node's control plane (what answers there speaks no TLS, "
                        f"and its plaintext answer is no node's either: {detail}); check the address and port"
                    )
                hint = (
                    " (that node does not seem to serve TLS: start it with tls= too)"
                    if plaintext
                    else " (what answers there speaks no TLS: a node started without tls=, which needs it too, "
                    "or not a tensorwire node at all; check the address and port)"
                )
            return AuthenticationError(f"TLS handshake with {target} failed: {detail}{hint}")
        if "socket closed" in low:
            return AuthenticationError(
                f"{target} closed the connection during TLS setup (certificate rejected?): {detail}"
            )
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = ""
        if not tls and "socket closed" in detail.lower():
            why = closed if _closed_plaintext(detail) else WhyClosed.CLOSING
            if why is WhyClosed.SERVES_TLS:
                return AuthenticationError(
                    f"{target} serves TLS, and it closed this node's plaintext connection ({detail}): "
                    "start this node with tls= too (a TLSConfig whose ca_file trusts that node's certificate)"
                )
            hint = _CLOSED_HINTS[why]
        return ControlPlaneError(f"cannot reach a tensorwire node at {target}: {detail}{hint}")
    return ControlPlaneError(f"control call to {target} failed: {code.name}: {detail}")


# gRPC's floor for the time a connection attempt may take (its min_reconnect_backoff_ms), and
# the most it takes (a C int of milliseconds: a longer connect_timeout raised OverflowError)
_MIN_CONNECTING_SECONDS = 0.1
_MAX_CONNECTING_MS = 2**31 - 1
# What an attempt is given past connect_timeout: time for a caller whose call's deadline (its
# connect_timeout) passed to close the channel before the attempt ends. An attempt that ends
# without a connection while the channel is still open (a call in it not yet cancelled, as a
# closed channel's may still be for a few ms) is followed at once by another, of gRPC's backoff
# (1.6 s, 2.56 s, ...), which goes on after the close: given connect_timeout alone, 1 connect in
# 24 that timed out against a node that never answers dialled again although it had closed its
# channel at its deadline (gRPC's call in it was cancelled 20 ms later); with this, 0 in 25
_CLOSING_SECONDS = 1.0


class ControlClient:
    """The control connection to the node at ``target``. ``connect_timeout``: the longest one
    connection attempt (TCP, then HTTP/2 and TLS setup) may take, with a second more for the
    caller to close the channel once its call's deadline passed (``_CLOSING_SECONDS``). gRPC
    gives each 20 s by default, and goes on with it after the channel closes: against a node
    that took the connection and never answered (frozen, SIGSTOPped) a connect that timed out
    left its connection open 20 s after its deadline. (It cannot end sooner than this, whatever
    a caller's own deadline says: gRPC has no call that stops an attempt under way.)
    ``server_name``: with TLS, the name to check the server's certificate against, in place of
    ``tls.server_name`` (see ``callback_name``)."""

    def __init__(
        self,
        target: str,
        tls: TLSConfig | None = None,
        connect_timeout: float | None = None,
        server_name: str | None = None,
    ) -> None:
        self.target = target
        self._tls = tls is not None
        # the name the server's certificate is checked for (said where it lacks it)
        self._checked_name = None if tls is None else server_name or tls.server_name or _host(target)
        self._closed = False
        self._answered = False  # a call got the server's answer: it spoke plaintext (or TLS) to us
        # A subchannel (the connection) of our own: by default grpc shares one per target among
        # a process's channels, and with it the reconnect backoff of a channel that kept failing
        # against a dead node (an old peer's renewals or lookups), so a connect() to the node
        # restarted there failed fast with that stale 'Connection refused' for up to the backoff.
        options: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
        if connect_timeout is not None:
            # (gRPC's name for how long an attempt may take before it counts as failed)
            connecting = max(connect_timeout, _MIN_CONNECTING_SECONDS) + _CLOSING_SECONDS
            connecting_ms = min(int(connecting * 1000), _MAX_CONNECTING_MS)
            options.append(("grpc.min_reconnect_backoff_ms", connecting_ms))
        # "host:port" with the scheme written out: gRPC reads a host named like one of its
        # schemes as that scheme ("unix:5000" dialled the socket file "5000" in the working
        # directory, "ipv4:5000" failed as an invalid target) rather than as a host to resolve
        uri = f"dns:///{target}"
        # (None once closed: a closed client that its peer still holds lets gRPC's channel go,
        # and with the last of them gRPC's poller thread, which lives as long as any does)
        self._channel: grpc.aio.Channel | None
        if tls is None:
            self._channel = grpc.aio.insecure_channel(uri, options=options)
        else:
            options += tls.channel_options(server_name)
            self._channel = grpc.aio.secure_channel(uri, tls.channel_credentials(), options=options)
        self._stub: control_pb2_grpc.ControlStub | None
        self._stub = control_pb2_grpc.ControlStub(self._channel)  # type: ignore[no-untyped-call]

    def _rpc(self) -> control_pb2_grpc.ControlStub:
        """The stub the calls are made with; ClosedResourceError once closed (it is let go then)."""
        if self._closed or self._stub is None:
            raise self._closed_error()
        return self._stub

    async def _unary(
        self,
        method: Callable[..., Awaitable[_R]],
        request: Any,
        deadline: float,
        special: Mapping[grpc.StatusCode, Callable[[grpc.aio.AioRpcError], Exception | None]] | None = None,
    ) -> _R:
        """One call, its failure as an error from the tree (a status in ``special`` as what
        ``special[code](exc)`` returns, unless None). Closing the client fails the calls in
        flight and later ones with ClosedResourceError: grpc cancels its calls when its channel
        closes, and that CancelledError must not reach a caller nobody cancelled."""
        if self._closed:
            raise self._closed_error()
        try:
            response = await method(request, timeout=deadline)
            self._answered = True
            return response
        except grpc.aio.AioRpcError as exc:
            # its traceback holds gRPC's call object (the frames of the call's await), and the
            # call its channel's connection: chained to the error the caller keeps, that stayed
            # open after aclose() until the error was freed (a refused connect's, by the garbage
            # collector: it was in a cycle). Its code and details are all it says to a caller
            exc.with_traceback(None)
            make = special.get(exc.code()) if special is not None else None
            error = make(exc) if make is not None else None
            if error is not None:
                raise error from exc
            closed = WhyClosed.UNKNOWN
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not self._tls and _closed_plaintext(exc.details() or ""):
                # a TLS node closes plaintext at once, and so may a node that is closing: ask
                # which, unless this server has answered us in plaintext already
                closed = WhyClosed.CLOSING if self._answered else await probe_closed(self.target, min(deadline, 2.0))
            elif (
                self._tls
                and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
                and _cut(exc.details() or "")
            ):
                # a TLS setup cut short: a refused certificate, or a node that died or is closing
                # under us (a SIGKILLed one read as "TLS handshake failed", as if it had refused
                # our certificate). A live TLS server completes a fresh TLS handshake (or answers
                # it with an alert); a gone or closing one refuses or drops it
                why = await probe_closed(self.target, min(deadline, 2.0))
                if why in (WhyClosed.CLOSED, WhyClosed.CLOSING):
                    closed = why
            plaintext = None
            if self._tls and _plaintext_answer(exc.details() or ""):
                # a node without tls=, or no node at all: ask in plaintext which
                plaintext = await probe_plaintext(self.target, min(deadline, 2.0))
            raise map_rpc_error(
                exc, self.target, tls=self._tls, closed=closed, plaintext=plaintext, checked_name=self._checked_name
            ) from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise self._closed_error() from None
            # its traceback holds gRPC's call (the frames of its await), which holds the channel's
            # machinery: a connect's deadline, chained to the ConnectTimeout a caller keeps (and
            # in a cycle through the connect's task until the collector ran), kept the closed
            # channel dialling again every 20 s to a node that took the connection and never
            # answered. From here up it says all there is to say
            exc.with_traceback(None)
            raise
        except grpc.aio.UsageError as exc:  # the channel closed between our check and the call
            raise self._closed_error() from exc

    def _closed_error(self) -> ClosedResourceError:
        return ClosedResourceError(f"the control connection to {self.target} is closed")

    async def handshake(self, request: control_pb2.HandshakeRequest, deadline: float) -> control_pb2.HandshakeResponse:
        """The handshake; one whose answer is late is watched: a node that closes as the
        connection to it is made can leave that connection open and unserved (gRPC calls the
        channel READY), and the handshake waited out connect_timeout for an answer that could
        not come. Once nothing listens at the address any more, it fails at once."""
        call: asyncio.Future[control_pb2.HandshakeResponse]
        call = asyncio.ensure_future(self._unary(self._rpc().Handshake, request, deadline))
        try:
            while True:
                await asyncio.wait([call], timeout=_HANDSHAKE_WATCH_AFTER)
                if call.done():
                    return call.result()
                if await nothing_listens(self.target, _HANDSHAKE_WATCH_AFTER):
                    raise ControlPlaneError(
                        f"cannot reach a tensorwire node at {self.target}: it stopped listening while this "
                        "handshake waited for its answer (a new connection is refused): the node closed during "
                        "the connect; connect again once it serves"
                    )
        finally:
            if not call.done():
                call.cancel()
                await asyncio.wait([call])
            if not call.cancelled():
                # retrieved: an error it raised meanwhile (while the probe ran, or as it was
                # cancelled) is not ours to report
                call.exception()
            del call  # (its error, raised from here, holds this frame: no cycle through the task)

    async def node_info(self, deadline: float) -> control_pb2.NodeInfo:
        return await self._unary(self._rpc().GetNodeInfo, control_pb2.NodeInfoRequest(), deadline)

    async def heartbeat(self, session_id: str, proof: bytes, deadline: float) -> None:
        """Renew a lease. SessionLost means the server no longer knows the session."""
        await self._unary(
            self._rpc().Heartbeat,
            control_pb2.HeartbeatRequest(session_id=session_id, proof=proof),
            deadline,
            {grpc.StatusCode.NOT_FOUND: self._session_lost},
        )

    async def renew_leases(self, renewals: Sequence[tuple[str, bytes]], deadline: float) -> tuple[set[str], set[str]]:
        """Renew the leases of many sessions, given as (session id, heartbeat proof), in one
        call. Returns the sessions the server does not know and those whose proof it refused
        (each other one was renewed)."""
        request = control_pb2.RenewLeasesRequest(
            renewals=[control_pb2.HeartbeatRequest(session_id=sid, proof=proof) for sid, proof in renewals]
        )
        response = await self._unary(self._rpc().RenewLeases, request, deadline)
        return set(response.lost), set(response.refused)

    async def leave(self, sessions: Sequence[tuple[str, bytes]], deadline: float) -> int:
        """Say goodbye for sessions given as (session id, leave proof): the server ends each it
        knows (``Leave``). Returns how many it ended."""
        request = control_pb2.LeaveRequest(
            sessions=[control_pb2.HeartbeatRequest(session_id=sid, proof=proof) for sid, proof in sessions]
        )
        response = await self._unary(self._rpc().Leave, request, deadline)
        return int(response.ended)

    def _session_lost(self, exc: grpc.aio.AioRpcError) -> SessionLost:
        return SessionLost(f"{self.target} no longer knows this session: {exc.details()}")

    async def lookup(self, session_id: str, name: str, proof: bytes, deadline: float) -> control_pb2.LookupResponse:
        """Resolve an exposed name: HandleNotFound if there is none, SessionLost if the server no
        longer knows the session."""
        return await self._unary(
            self._rpc().Lookup,
            control_pb2.LookupRequest(session_id=session_id, name=name, proof=proof),
            deadline,
            {
                grpc.StatusCode.NOT_FOUND: lambda exc: HandleNotFound(f"{self.target}: {exc.details()}"),
                grpc.StatusCode.UNAUTHENTICATED: self._lookup_refused,
            },
        )

    def _lookup_refused(self, exc: grpc.aio.AioRpcError) -> SessionLost | None:
        """SessionLost where the server said it does not know the session (None: a bad proof)."""
        trailing = exc.trailing_metadata() or ()
        lost = any(tuple(item) in SESSION_LOST_METADATA for item in trailing)
        return self._session_lost(exc) if lost else None

    async def until_lost(self) -> None:
        """Return once the connection to the server is lost and a new one cannot be made (the
        server's node closed, or died): gRPC sees its connection shut at once. One that drops
        and comes back (a server that lives on) does not count, nor does closing this client."""
        if not await self._lost_or_closed():
            await asyncio.Event().wait()  # closed by us: nothing more to watch

    async def _lost_or_closed(self) -> bool:
        """True once the connection is lost (``until_lost``), False once this client closes:
        then the channel is not held any more (aclose lets it go)."""
        channel = self._channel
        if channel is None:
            return False
        state = channel.get_state(try_to_connect=False)
        while state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            if state is grpc.ChannelConnectivity.SHUTDOWN:
                return False
            if state is grpc.ChannelConnectivity.IDLE:
                # a connection that ended: only a new one says whether the server is still there
                channel.get_state(try_to_connect=True)
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=False)
        return True

    async def aclose(self) -> None:
        """Close the channel; calls in flight and later ones fail with ClosedResourceError.
        Idempotent. Once closed, the client holds nothing of gRPC's: a Peer (or anything) that
        keeps it after its close kept gRPC's channel, and with it gRPC's poller thread."""
        self._closed = True
        channel = self._channel
        if channel is None:
            return
        await channel.close()
        # (only once closed: a close that was cancelled part way is finished by the next)
        self._channel = self._stub = None
