"""Node: a process's presence on the network. It serves the control plane, owns a listener
for each transport it can use, connects to other nodes and accepts their connections."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import logging
import time
import urllib.parse
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import _metrics
from ._checks import check_arguments, check_bool, check_options, check_seconds, split_address
from ._leases import GOODBYE_SECONDS, NODES_HERE, Renewals, say_goodbye
from ._loops import check_home, closed_by_hand, elsewhere
from ._onesided import ExposureTable, Handle, Revocation, retire, serve_ops
from ._path import Path
from ._peer import RESERVED_TAGS, Peer
from ._ratelog import RateLimitedLog
from .control import PROTOCOL_VERSION, Choice, ControlClient, ControlServer, Offer, TLSConfig, check_require
from .control._auth import leave_proof
from .control._convert import offer_from_pb, offer_to_pb
from .control._negotiate import MAX_TRANSPORTS, shortfall
from .control._pb import control_pb2
from .control._server import MAX_INSTANCE_ID_CHARS, MAX_NAME_CHARS, SECRET_BYTES
from .control._tls import callback_name
from .errors import (
    ClosedResourceError,
    ConfigurationError,
    ConnectError,
    ConnectTimeout,
    NegotiationError,
    PeerDisconnected,
    TransportUnavailable,
)
from .rpc._registry import MethodRegistry, methods_of
from .rpc._server import attach as _serve_rpc
from .transports import (
    DEFAULT_PREFERENCE,
    KNOWN,
    Channel,
    ChannelState,
    Limits,
    Session,
    Transport,
    TransportContext,
    probe_all,
)
from .transports import _registry as transport_registry
from .transports._frames import MAX_SESSION_ID

log = logging.getLogger(__name__)

__all__ = ["Node", "NodeConfig", "start"]


@check_arguments
@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How a node behaves. Every field has a sensible default.

    transports: transport names in order of preference (fastest first).
    auth_token: if set, peers must present it in the handshake, and stock gRPC clients in
        ``authorization: Bearer <token>`` metadata; so it is printable ASCII (a space included),
        at most MAX_AUTH_TOKEN_CHARS (4096) characters: ``secrets.token_urlsafe(32)`` is one.
    limits: memory and message bounds (see ``tensorwire.transports.Limits``).
    connect_timeout: seconds a connect (handshake plus data connection) may take.
    lease_seconds: a peer that neither renews its lease over the control plane nor answers
        renewals for this long is declared dead (PeerDisconnected), even if its sockets stay up.
    checksum: crc32c on every staged-TCP payload frame (on when either side asks); a corrupted
        frame raises IntegrityError and is never delivered. Other transports' payloads carry
        none: the node warns once per such transport that a peer opens over.
    tls: certificates for the control plane (TLSConfig): TLS, or mutual TLS with
        require_client_cert. The session secret then never crosses the network in the clear.
    node_id: this node's name, at most MAX_NODE_ID_CHARS (256) characters; a random one by default.
        A name for people (logs, errors, ``peer.remote_node``): several nodes may share one (a
        hostname, in containers). What tells running nodes apart is ``Node.instance_id``.
    ucx_options: UCX configuration for this node's ucx transport, names without the ``UCX_``
        prefix: ``{"TLS": "sm,self"}``, ``{"RNDV_THRESH": "64k"}``. Passed to the UCX context,
        never through the environment; they win over ``ucx_config()`` and ``UCX_*`` variables.
    goodbye_seconds: how long a closing peer (or node) gives its goodbye (``Leave``, made beside
        the close on the data connection) to reach the other node, and how long this node keeps
        a session whose data connection the other side closed, for a goodbye that comes after
        that close. A goodbye not heard in time is no error: the other side then sees the peer
        gone without one (``remote_closing`` False). Raise it where the control plane is slow
        (an emulated or heavily loaded host, a long way between nodes).

    Every field is checked when the config is made (``start()`` makes one from its options): a
    wrong type or value is a ConfigurationError that says what is allowed. connect_timeout is a
    finite number of seconds > 0; lease_seconds one from MIN_LEASE_SECONDS up to what the
    handshake's uint32 milliseconds carry (MAX_LEASE_SECONDS, about 49 days); goodbye_seconds
    one > 0 up to MAX_GOODBYE_SECONDS (a close waits for it, so it stays short).
    """

    MIN_LEASE_SECONDS: ClassVar[float] = 0.05  # the watchdog wakes every lease / 4 (at most 0.5 s)
    MAX_LEASE_SECONDS: ClassVar[float] = float((1 << 32) - 1) // 1000  # lease_ms is a uint32
    # a name, not a payload: it travels in every handshake (a huge one failed there, deep in gRPC)
    MAX_NODE_ID_CHARS: ClassVar[int] = 256
    # the token is also a gRPC metadata value, which gRPC refuses past 8 KiB of metadata in all
    # (at random from there to 16 KiB, always beyond): half of that leaves the client's other
    # headers (about 0.5 KiB) and any metadata of its own room
    MAX_AUTH_TOKEN_CHARS: ClassVar[int] = 4096
    MAX_GOODBYE_SECONDS: ClassVar[float] = 60.0

    transports: tuple[str, ...] = DEFAULT_PREFERENCE
    auth_token: str | None = field(default=None, repr=False)  # a secret: never printed
    limits: Limits = field(default_factory=Limits)
    connect_timeout: float = 10.0
    lease_seconds: float = 3.0
    checksum: bool = False
    tls: TLSConfig | None = None
    node_id: str | None = None
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    goodbye_seconds: float = GOODBYE_SECONDS

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: store the checked values, normalized
        set_(self, "transports", _check_transports(self.transports))
        _check_name("auth_token", self.auth_token)
        _check_token(self.auth_token, self.MAX_AUTH_TOKEN_CHARS)
        if not isinstance(self.limits, Limits):
            raise ConfigurationError(
                f"limits must be a tensorwire.Limits (e.g. Limits(max_unexpected=64)), not {self.limits!r}"
            )
        set_(self, "connect_timeout", check_seconds("connect_timeout", self.connect_timeout))
        set_(
            self,
            "lease_seconds",
            check_seconds("lease_seconds", self.lease_seconds, self.MIN_LEASE_SECONDS, self.MAX_LEASE_SECONDS),
        )
        set_(
            self,
            "goodbye_seconds",
            check_seconds("goodbye_seconds", self.goodbye_seconds, 0.0, self.MAX_GOODBYE_SECONDS),
        )
        set_(self, "checksum", check_bool("checksum", self.checksum))
        if self.tls is not None and not isinstance(self.tls, TLSConfig):
            raise ConfigurationError(
                f"tls must be a tensorwire.TLSConfig(cert_file=..., key_file=..., ...) or None, not {self.tls!r}"
            )
        _check_name("node_id", self.node_id)
        if self.node_id is not None and len(self.node_id) > self.MAX_NODE_ID_CHARS:
            raise ConfigurationError(
                f"node_id is {len(self.node_id)} characters long ({self.node_id[:40]!r}...); "
                f"the limit is {self.MAX_NODE_ID_CHARS}: give the node a shorter name"
            )
        opts = self.ucx_options
        if not isinstance(opts, Mapping):
            raise ConfigurationError(f"ucx_options must be a mapping like {{'TLS': 'sm,self'}}, not {opts!r}")
        for key, value in opts.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigurationError(
                    f"ucx_options maps names to strings (e.g. {{'RNDV_THRESH': '64k'}}), not {key!r}: {value!r}"
                )
            if key.startswith("UCX_"):  # (the ucx_config() error it met said "pass TLS='...' as a string")
                raise ConfigurationError(
                    f"ucx_options names UCX settings without the UCX_ prefix: {{{key[4:]!r}: {value!r}}}, not {key!r}"
                )
            if "\0" in key or "\0" in value:  # UCX reads C strings: it would take "tcp\0x" for "tcp"
                raise ConfigurationError(f"ucx_options holds a NUL character in {key!r}: {value!r}; UCX cannot take it")
        set_(self, "ucx_options", dict(opts))


def _check_transports(names: object) -> tuple[str, ...]:
    """A non-empty sequence of known transport names, in preference order (a repeat counts once)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise ConfigurationError(f"transports must be a sequence of names, e.g. ('tcp',), not {names!r}")
    given = tuple(names)
    for name in given:  # (before the repeats are dropped: a list among them cannot be hashed)
        if not isinstance(name, str) or name not in KNOWN:
            raise ConfigurationError(f"unknown transport {name!r} in transports; known: {', '.join(KNOWN)}")
    order = tuple(dict.fromkeys(given))
    if not order:
        raise ConfigurationError(f"transports is empty; name at least one of: {', '.join(KNOWN)}")
    return order


def _check_name(what: str, value: object) -> None:
    """auth_token and node_id: None, or a non-empty string that UTF-8 can carry."""
    if value is None:
        return
    ok = isinstance(value, str) and value != ""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            ok = False
    if not ok:
        # a token is a secret even when it is a wrong one (bytes, a surrogate from the
        # environment): say what kind of value it was, never the value
        shown = f"this {type(value).__name__} (not shown: a secret)" if what == "auth_token" else repr(value)
        raise ConfigurationError(f"{what} must be a non-empty string (UTF-8) or None, not {shown}")


def _check_token(token: str | None, limit: int) -> None:
    """A token a stock gRPC client can present as ``authorization: Bearer <token>`` metadata:
    printable ASCII, the only characters gRPC lets a text metadata value hold (a client given
    any other failed in gRPC with "Illegal header value"), and short enough for gRPC's 8 KiB of
    metadata (a 20 KB one was refused with RESOURCE_EXHAUSTED on every call). The error never
    shows the token, only its length or the kind and place of the character."""
    if token is None:
        return
    if len(token) > limit:
        raise ConfigurationError(
            f"auth_token is {len(token)} characters long; the limit is {limit} (it travels as gRPC "
            f"metadata): use a shorter token, e.g. secrets.token_urlsafe(32)"
        )
    for i, c in enumerate(token):
        if not " " <= c <= "~":
            if c in "\r\n":  # most likely: a token read from a file with its line end
                kind = "a newline"
            elif c < " " or c == "\x7f":
                kind = "a control character"
            else:
                kind = "a non-ASCII character"
            raise ConfigurationError(
                f"auth_token has {kind} at position {i + 1} of {len(token)}; gRPC metadata carries printable "
                f"ASCII only: use such a token, e.g. secrets.token_urlsafe(32)"
            )


def _dialable(control_address: str, caller: str) -> str:
    """Where to reach the control plane of a client that says it serves at ``control_address``
    and called from ``caller`` (gRPC's ``ipv4:10.0.0.7:5123`` / ``ipv6:%5B::1%5D:5123``, its
    brackets percent-encoded). A client
    serving on every interface (``0.0.0.0``, ``::``) names no machine, and one serving on
    loopback names ours when it called from elsewhere: both are the host it called from, at the
    port it gave. (Dialled as given, a lookup would reach this machine, and maybe another node
    there, which would deny the session and so break a healthy peer.)"""
    kind, _, rest = caller.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return control_address
    try:
        host, port = split_address(control_address, lowest_port=1)
        host_part = urllib.parse.unquote(rest.rpartition(":")[0])
        called_from = ipaddress.ip_address(host_part.strip("[]").partition("%")[0])  # (a zone: fe80::1%eth0)
    except (ConfigurationError, ValueError):
        return control_address  # said nothing usable: a lookup dialling it fails and says so
    if isinstance(called_from, ipaddress.IPv6Address) and called_from.ipv4_mapped is not None:
        called_from = called_from.ipv4_mapped
    try:
        served = ipaddress.ip_address("127.0.0.1" if host.lower() == "localhost" else host)
    except ValueError:  # another name: trust it
        return control_address
    if not (served.is_unspecified or (served.is_loopback and not called_from.is_loopback)):
        return control_address
    return f"[{called_from}]:{port}" if called_from.version == 6 else f"{called_from}:{port}"


# A handshake answer's lease_ms of 0 is the field unset: the lease NodeConfig gives by default.
_UNSET_LEASE_SECONDS = 3.0
# One reason of an answer's passed_over as this node keeps it (in peer.path, and its log): an
# honest one is a line (a UCX error, or the lanes both sides list, 8 of 40 characters at most each).
_MAX_PASSED_OVER_CHARS = 1000


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class _Answer:
    """A server's handshake answer, checked (``_checked_answer``)."""

    chosen: Offer
    lease: float  # seconds
    passed_over: tuple[tuple[str, str], ...]


def _checked_answer(
    resp: control_pb2.HandshakeResponse,
    address: str,
    preference: tuple[str, ...],
    offers: Mapping[str, Offer],
    require: str = "any",
    transports: Mapping[str, Transport] | None = None,
) -> _Answer:
    """The handshake answer of the server at ``address``, checked as that server checks a
    client's request: a broken or hostile server must not make this node misbehave. Each field
    is one an honest server of this protocol sends; anything else is a NegotiationError naming
    the field. (Taken as they came, a lease of 1 ms had this node renew every 0.3 ms and break
    the peer within a second; a server node id of 3 MB was kept, and printed, for the peer's
    life; another protocol version, or another version of the chosen transport, went unnoticed;
    so did a chosen transport short of ``require``, which a server that ignores it picks.)
    ``transports``: this node's, to ask which lanes the chosen one would use (``endpoint_lanes``).
    The passed-over reasons only inform, and are clipped, never refused."""
    said = f"{address} answered the handshake with"
    broken = "no node of this protocol answers so: the server is broken or hostile (check what serves there)"
    if resp.protocol_version != PROTOCOL_VERSION:
        raise NegotiationError(
            f"{address} speaks control protocol version {resp.protocol_version}, and this node version "
            f"{PROTOCOL_VERSION}: nodes connect only at the same version (run tensorwire releases of the same "
            "protocol version on both nodes)"
        )
    name = resp.chosen.name
    if name not in offers or name not in preference:
        why = "which this node does not offer" if name not in offers else f"not in this connect's order {preference}"
        raise NegotiationError(f"{address} chose {_clipped(name, MAX_NAME_CHARS)!r}, {why}")
    mine = offers[name].version
    if resp.chosen.version != mine:
        raise NegotiationError(
            f"{address} chose {name} version {resp.chosen.version}, and this node's {name} is version {mine}: "
            f"their data connections would not understand each other (negotiation passes over a transport whose "
            f"versions differ); {broken}"
        )
    chosen = offer_from_pb(resp.chosen)
    transport = (transports or {}).get(name)
    used = transport.endpoint_lanes(chosen.address) if transport is not None and require != "any" else ()
    short = shortfall(require, offers[name].capabilities, chosen.capabilities, used, "this node", address)
    if short is not None:
        raise NegotiationError(
            f"{said} chosen transport {name}, which does not satisfy require={require!r}: {name} "
            f"{_clipped(short, _MAX_PASSED_OVER_CHARS)}. A server of this protocol refuses a connect it cannot "
            f"meet: this one ignored require= (it is broken or hostile, or no tensorwire node of this release; "
            f"check what serves there)"
        )
    lo, hi = NodeConfig.MIN_LEASE_SECONDS, NodeConfig.MAX_LEASE_SECONDS
    lease = resp.lease_ms / 1000 if resp.lease_ms else _UNSET_LEASE_SECONDS
    if not lo <= lease <= hi:
        raise NegotiationError(
            f"{said} a lease of {resp.lease_ms} ms; a node's lease is {lo * 1000:g} ms to {hi * 1000:.0f} ms "
            f"(NodeConfig.lease_seconds), and {broken}"
        )
    if len(resp.server_node_id) > NodeConfig.MAX_NODE_ID_CHARS:
        raise NegotiationError(
            f"{said} a node id of {len(resp.server_node_id)} characters; a node id is at most "
            f"{NodeConfig.MAX_NODE_ID_CHARS} (NodeConfig.node_id), and {broken}"
        )
    if not 0 < len(resp.server_instance_id) <= MAX_INSTANCE_ID_CHARS:
        raise NegotiationError(
            f"{said} an instance id of {len(resp.server_instance_id)} characters; one is 1 to "
            f"{MAX_INSTANCE_ID_CHARS} (what tells running nodes apart), and {broken}"
        )
    sid = len(resp.session_id.encode())
    if not 0 < sid <= MAX_SESSION_ID:
        raise NegotiationError(
            f"{said} a session id of {sid} bytes; one is 1 to {MAX_SESSION_ID} bytes (what a data "
            f"connection's hello carries), and {broken}"
        )
    if len(resp.session_secret) != SECRET_BYTES:
        raise NegotiationError(
            f"{said} a session secret of {len(resp.session_secret)} bytes, not {SECRET_BYTES}: {broken}"
        )
    passed_over = tuple(
        (_clipped(p.name, MAX_NAME_CHARS), _clipped(p.reason, _MAX_PASSED_OVER_CHARS))
        for p in resp.passed_over[:MAX_TRANSPORTS]
    )
    return _Answer(chosen, lease, passed_over)


class Node:
    """One tensorwire endpoint. Create it with ``tensorwire.start``."""

    # Peers that left messages to receive wait in the accept queue after they have gone; until
    # accept() is first called, at most this many: the oldest beyond it is dropped with its
    # messages. A node that never accepts (one that serves only methods or exposures) kept each
    # such peer for good, with up to Limits.recv_buffer_bytes of its messages (about 170 KiB a
    # peer for one small message). A node that accepts keeps them all: they are its backlog,
    # and dropping one would lose messages its accept loop has yet to reach.
    MAX_DEPARTED: ClassVar[int] = 64

    def __init__(self, address: str, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id or uuid.uuid4().hex
        # new at each start, whatever node_id says: node ids may repeat (a hostname, in
        # containers), and a node reached at two addresses has one instance id. Peers learn it
        # in the handshake (peer.remote_instance)
        self.instance_id = uuid.uuid4().hex
        NODES_HERE[self.instance_id] = self  # (the goodbyes of inproc peers find it there)
        self._host, self._port = split_address(address)
        self.address = ""
        self.transports: dict[str, Transport] = {}
        self.offers: dict[str, Offer] = {}
        self.unusable: dict[str, str] = {}
        self._server: ControlServer | None = None
        self._incoming: deque[Peer] = deque()  # accepted peers that accept() has not handed out
        self._departed: dict[Peer, None] = {}  # those of them that have gone, oldest first
        self._accepts = False  # accept() was called: nothing of the accept queue is dropped
        self._dropping = RateLimitedLog(
            log, per_window=20, window=10.0, what="gone peers dropped with their messages", kind="accept"
        )
        self._incoming_ready = asyncio.Event()  # set when a peer joins _incoming, or the node closes
        # called with each peer the node adopts (``_watch_adopted``): a peer may go before a poll
        # of ``peers`` sees it (a pipeline stage's neighbour linked and closed at once)
        self._adopted: set[Callable[[Peer], None]] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        self.peers: list[Peer] = []
        self._leases: dict[str, tuple[float, Peer]] = {}
        # the renewals of the leases of the sessions we opened, by (address, lease): _leases.renewals_for
        self._renewals: dict[tuple[str, float], Renewals] = {}
        self._sessions: dict[str, Peer] = {}
        # sessions whose channel the other side closed, for goodbye_seconds: a peer closed alone
        # says goodbye beside its close, and the goodbye may come after it (``_leaving_peer``).
        # Weakly: a peer nobody holds any more has nobody to tell, and is freed at once
        self._left: weakref.WeakValueDictionary[str, Peer] = weakref.WeakValueDictionary()
        self._opening: dict[str, asyncio.Task[None]] = {}  # handshaken sessions whose data path is opening
        self._opening_secrets: dict[str, bytes] = {}  # their secrets (``_session_taken``)
        # (a client that only handshakes, in a loop, cannot fill the log with these)
        self._unopened = RateLimitedLog(
            log, per_window=20, window=10.0, what="handshakes whose data connection never opened", kind="control"
        )
        self._connecting: set[asyncio.Task[Peer]] = set()  # connects under way: closing the node ends them
        self._unchecked: set[str] = set()  # transports whose lack of checksums this node has warned of
        self.exposures = ExposureTable()
        self._retiring: set[asyncio.Task[None]] = set()  # unexposed tensors waiting for peers' acks
        # gone peers whose channel may still serve their gets and puts (``_forget_exposures``)
        self._settling: dict[Peer, str] = {}
        self._watchdog: asyncio.Task[None] | None = None
        # its goodbye as it closes (say_goodbye), which may call over its peers' control
        # connections: a peer closing meanwhile keeps its own open until it ends (Peer._close_control)
        self._goodbye: asyncio.Task[None] | None = None
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set when it starts
        self._loop_end: AsyncGenerator[None, None] | None = None  # see _until_loop_ends

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return (
            f"<Node {self.node_id[:12]} at {self.address} {state} "
            f"transports={list(self.offers)} peers={len(self.peers)}>"
        )

    def _transport_options(self) -> contextlib.AbstractContextManager[None]:
        if not self.config.ucx_options or "ucx" not in self.config.transports:
            return contextlib.nullcontext()
        from .transports.ucx._worker import ucx_config

        return ucx_config(**self.config.ucx_options)

    async def _start(self) -> Node:
        await _load_transports(self.config.transports, checksum=self.config.checksum)
        self._loop = asyncio.get_running_loop()  # where it lives (abort() from another thread)
        methods_of(self).home = self._loop  # (its limits are set there too)
        _metrics.node_started(self)
        with self._transport_options():  # probe and construct under this node's UCX options
            usable, self.unusable = probe_all(self.config.transports)
            if "ucx" in self.unusable:
                from .transports.ucx._transport import CONTEXT_REFUSED

                if self.unusable["ucx"].startswith(CONTEXT_REFUSED):
                    from .transports.ucx._worker import chosen_options

                    # options set on purpose (the node's, or a ucx_config block's) that UCX
                    # refuses: say so, rather than a quiet tcp path
                    if chosen := chosen_options():
                        where = "ucx_options" if self.config.ucx_options else "ucx_config options"
                        raise ConfigurationError(f"{where} {chosen} were refused: {self.unusable['ucx']}")
            if not usable:
                raise TransportUnavailable(f"no usable transport among {self.config.transports}: {self.unusable}")
            ctx = TransportContext(self.node_id, self._host, self.config.limits, checksum=self.config.checksum)
            transports = [(name, cls, caps, cls(ctx, caps)) for name, (cls, caps) in usable.items()]
        try:
            self._loop_end = self._until_loop_ends()
            await anext(self._loop_end)
            for name, cls, caps, transport in transports:
                self.transports[name] = transport
                blob = await transport.listen()
                self.offers[name] = Offer(name, cls.version, blob, caps)
            self._server = ControlServer(self)
            port = await self._server.start(self._host, self._port)
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_leases(), name="tensorwire-leases")
        except BaseException:
            await self.aclose()
            raise
        self.address = f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"
        log.info("node %s serving at %s with %s", self.node_id, self.address, ", ".join(self.offers))
        return self

    # -- negotiation helpers used by the control server ---------------------------------------
    def reachable(self, name: str, address: bytes) -> str | None:
        """Why this node's transport ``name`` cannot reach the peer at ``address`` (None: it can)."""
        return self.transports[name].accepts(address)

    def _path(self, choice: Choice, channel: Channel) -> Path:
        caps = self.offers[choice.name].capabilities
        return Path(choice.name, channel.lanes, caps.rdma, caps.gpudirect, caps.memory_kinds, choice.passed_over)

    def _adopt(self, peer: Peer, side: str) -> None:
        """A new peer, ``side`` "connect" or "accept": track it, count it and serve its
        one-sided requests."""
        self.peers.append(peer)
        _metrics.peer_opened(side, peer.path, peer.remote_instance)
        transport = peer.path.transport
        carrier = self.transports.get(transport)
        unchecked = carrier is not None and not carrier.checks_payloads
        if self.config.checksum and unchecked and transport not in self._unchecked:
            # the user asked for checksums, and the path taken has none: say so (once per
            # transport), rather than let checksum=True read as a promise it is not here
            self._unchecked.add(transport)
            log.warning(
                "checksum=True, but %s does not checksum payloads (only tcp does): payloads to %s and to every "
                "later %s peer of this node carry no crc32c; connect with transports=('tcp',) where they must",
                transport,
                peer.remote_address,
                transport,
            )
        assert peer.session is not None
        self._sessions[peer.session.id] = peer
        peer.channel.add_close_callback(lambda _exc: self._gone(peer))
        peer._spawn(serve_ops(peer, self.exposures))
        _serve_rpc(peer, methods_of(self))
        for seen in list(self._adopted):
            seen(peer)
        if peer.channel.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            # the other side left before we got here (inproc: a close right after connect): the
            # callback will never fire, and the peer would stay in ``peers`` and its session here
            self._gone(peer)

    @contextlib.contextmanager
    def _watch_adopted(self, seen: Callable[[Peer], None]) -> Generator[None, None, None]:
        """Within the block, ``seen(peer)`` for every peer this node adopts (connected or
        accepted), as it is adopted: before it can go, which a poll of ``peers`` may miss."""
        self._adopted.add(seen)
        try:
            yield
        finally:
            self._adopted.discard(seen)

    def _gone(self, peer: Peer) -> None:
        """A peer's channel closed (either side, or its lease ran out): it leaves ``peers`` and
        its session, and lets go of its control connection; messages that had fully arrived
        stay deliverable to whoever holds the Peer, until it is closed. One that accept() never
        handed out and that left nothing to receive leaves the accept queue too (a node that
        only serves methods or exposures never accepts: each such peer was kept forever), and
        so does one that its holder closed (``aclose``: it let go of those messages)."""
        # (requests and replies of tensorwire's own services, rpc among them, count for nothing:
        # nobody serves them once the peer has gone)
        if peer in self._incoming:
            if peer._closed or not peer.channel.mailbox.holds_messages(ignore=RESERVED_TAGS):
                self._incoming.remove(peer)
            else:
                self._departed[peer] = None
                if len(self._departed) > self.MAX_DEPARTED and not self._accepts:
                    self._drop_departed(next(iter(self._departed)))
        if peer.session is not None:
            sid = peer.session.id
            if self._sessions.get(sid) is peer:  # (not another peer's entry of the same id: a node connected to itself)
                del self._sessions[sid]
            if not peer._closed and self._loop is not None:  # (the other side closed it, or went)
                self._left[sid] = peer
                self._loop.call_later(self.config.goodbye_seconds, self._left.pop, sid, None)
            lease = self._leases.get(sid)
            if lease is not None and lease[1] is peer:
                del self._leases[sid]
            self._forget_exposures(peer, sid)
        self._forget(peer)
        task = peer._wind_down()
        if task is not None:
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _drop_departed(self, peer: Peer) -> None:
        """Drop the oldest gone peer of the accept queue, which nobody has accepted to receive
        what it left (``MAX_DEPARTED``), and close it: its messages are let go."""
        del self._departed[peer]
        self._incoming.remove(peer)
        self._dropping.warn(
            "dropped the unread messages of peer %s (node %s), which left before anyone accepted it: a node that "
            "has never called accept() keeps at most %d such peers; accept() them (or 'async for peer in node') "
            "to receive what they send",
            peer.remote_address,
            peer.remote_node[:12],
            self.MAX_DEPARTED,
        )
        self._retire(peer.aclose())

    def _session_taken(self, session_id: str, secret: bytes) -> bool:
        """Whether ``session_id``, which a server chose for a session of ours, already names
        another session of this node (one it accepted, or opened to another node) under another
        secret. A hostile server that saw that id on the wire (a data connection's hello carries
        it in the clear) would take the other session's place in this node's tables, and its
        peer's close would end that session's lease here. The same secret is the same session:
        a node connected to itself, whose own server side holds it too."""
        holders = [self._sessions.get(session_id), self._leases.get(session_id, (0.0, None))[1]]
        known = [p.session.secret for p in holders if p is not None and p.session is not None]
        if session_id in self._opening_secrets:
            known.append(self._opening_secrets[session_id])
        return any(not hmac.compare_digest(s, secret) for s in known)

    def _session_peer(self, session_id: str) -> Peer | None:
        return self._sessions.get(session_id)

    def _leaving_peer(self, session_id: str) -> Peer | None:
        """The peer a goodbye for ``session_id`` ends (``Leave``): the session's peer here, or
        the one whose channel its close on the data connection, which overtook the goodbye, has
        just closed (``_left``). A node connected to itself holds both ends under the id they
        share (``_sessions`` one of them): where that one said the goodbye, it is for the other
        end (the one saying it is closing on this side)."""
        peer = self._sessions.get(session_id)
        if peer is not None and peer._said_goodbye and peer.remote_instance == self.instance_id:
            ends = (p for p in self.peers if p is not peer and p.session is not None and p.session.id == session_id)
            peer = next((p for p in ends if not p._said_goodbye), None)
        return peer if peer is not None else self._left.get(session_id)

    def _forget_exposures(self, peer: Peer, session_id: str) -> None:
        """The exposures stop waiting for the session's acknowledgements once its channel has
        settled (``Channel.settled``; ucx): until then its peer's gets and puts may still be served
        from and into their memory (emulated by this node's UCX worker), so an unexpose meanwhile
        waits for that too (``_session_ends`` hands it the peer)."""
        settling = peer.channel.settled()
        if settling is None:
            self.exposures.forget(session_id)
            return
        self._settling[peer] = session_id

        async def then() -> None:
            try:
                await settling
            finally:
                self._settling.pop(peer, None)
                self.exposures.forget(session_id)

        self._retire(then())

    def _session_ends(self, session_id: str) -> list[Peer]:
        """This node's peers of the session: one, or, for a node connected to itself, both of
        its ends (``_sessions`` holds one of them under the id they share). A lookup names only
        the session, so a revocation goes to each end: the one the reader's notice must reach
        may be either."""
        settling = [p for p, sid in self._settling.items() if sid == session_id]
        peer = self._sessions.get(session_id)
        if peer is None:
            return settling
        if peer.remote_node != self.node_id:
            return [peer, *settling]
        return [p for p in self.peers if p.session is not None and p.session.id == session_id] + settling

    async def _session_peer_soon(self, session_id: str) -> Peer | None:
        """The session's peer; for a session whose data connection is still being adopted (a
        control call that overtook it), once it is. None: no such session here (closed,
        expired, or never opened: this node restarted at that address)."""
        opening = self._opening.get(session_id)
        if opening is not None:
            await asyncio.wait([opening], timeout=self.config.connect_timeout)
        return self._sessions.get(session_id)

    @check_arguments
    def expose(self, tensor: Any, *, name: str) -> Handle:
        """Publish a C-contiguous tensor under ``name`` for session peers to read and write.
        The tensor stays alive and must stay valid until ``unexpose(name)``. Transports with
        one-sided support (ucx) register its memory now (once per region, however often it
        is exposed), so their peers read and write it without this node's code."""
        self._check_open("node.expose")
        return self.exposures.expose(tensor, name, self.transports)

    @check_arguments
    def method(self, name: str | Callable[..., Any] | None = None, *, max_arg_bytes: int | None = None) -> Any:
        """Register an async function (or async generator, for ``peer.stream``) as an RPC method:
        ``@node.method("forward")``; the name defaults to the function's. ``max_arg_bytes``
        declares the most tensor bytes one call's arguments may carry."""
        check_home(self._loop, "node.method")  # (the registry is what the loop serves calls from)
        return methods_of(self).decorator(name, max_arg_bytes=max_arg_bytes)

    @property
    def methods(self) -> MethodRegistry:
        """The RPC methods this node offers, by name, and their ``limits`` (CallLimits)."""
        return methods_of(self)

    @check_arguments
    def unexpose(self, name: str) -> Revocation:
        """Revoke ``name``: lookups and reads and writes through old handles fail
        (HandleNotFound). Peers holding a one-sided key (ucx) are told; their direct
        operations fail once the notice has reached them, and the memory stays registered and
        referenced until each has acknowledged (or gone), and until the owner-assisted reads
        and writes already moving its bytes (tcp, inproc) have ended. ``await
        node.unexpose(name)`` to wait for that: afterwards no peer's operation reaches the tensor.
        On a closed (or closing) node, ClosedResourceError, as for ``expose``: closing the node
        unexposed everything."""
        self._check_open("node.unexpose")
        if not isinstance(name, str):  # (it was "HandleNotFound: None is not exposed")
            raise ConfigurationError(f"unexpose takes the name a tensor was exposed under, not {type(name).__name__}")
        entry = self.exposures.unexpose(name)
        if not entry.given and not entry.busy:
            entry.release()
            return Revocation(None)
        return Revocation(self._retire(retire(entry, self._session_ends)))

    def _expect_peer(
        self,
        choice: Choice,
        session_id: str,
        secret: bytes,
        remote_node: str,
        *,
        remote_addr: str,
        control_address: str = "",
        remote_instance: str,
        proven: Mapping[str, Sequence[bytes]] | None = None,
    ) -> None:
        """``proven``: the auth context of a mutual-TLS handshake (its client's certificate)."""
        control_address = _dialable(control_address, remote_addr)
        control_name = None
        if proven is not None and control_address:
            control_name = callback_name(proven, split_address(control_address)[0])
        session = Session(session_id, secret, self.node_id, remote_node, self.config.limits)
        pending = self.transports[choice.name].expect(session)

        async def wait() -> None:
            try:
                async with asyncio.timeout(self.config.connect_timeout):
                    channel = await pending
            except TimeoutError:
                self._unopened.warn("peer %s completed the handshake but never opened its data connection", remote_addr)
                if isinstance(pending, asyncio.Future):
                    pending.cancel()
                return
            except asyncio.CancelledError:
                # (its client gave up, _drop_opening, or this node closes) a data connection
                # that came as it ended has nobody to take it: dropping it tells the client
                if isinstance(pending, asyncio.Future):
                    pending.add_done_callback(_drop_channel)
                return
            if self._closed:  # the node began closing after this handshake
                channel.abort()
                return
            peer = Peer(
                self,
                channel,
                remote_node=remote_node,
                remote_instance=remote_instance,
                remote_address=remote_addr,
                path=self._path(choice, channel),
                session=session,
                control_address=control_address,
                control_name=control_name,
            )
            peer._lease = self.config.lease_seconds
            self._leases[session_id] = (time.monotonic() + self.config.lease_seconds, peer)  # _gone drops it
            self._incoming.append(peer)
            self._incoming_ready.set()
            self._adopt(peer, "accept")  # after the above, which _gone undoes for a peer that already left
            log.info("accepted %s (node %s): %s", remote_addr, remote_node[:12], peer.path)

        task = asyncio.get_running_loop().create_task(wait())
        self._waiting.add(task)
        self._opening[session_id] = task
        self._opening_secrets[session_id] = secret
        task.add_done_callback(self._waiting.discard)
        task.add_done_callback(lambda _t: self._opening.pop(session_id, None))
        task.add_done_callback(lambda _t: self._opening_secrets.pop(session_id, None))

    def _lease_secret(self, session_id: str) -> bytes | None:
        """The secret of a session whose lease this node keeps (None: no such session)."""
        entry = self._leases.get(session_id)
        if entry is None or entry[1].session is None:
            return None
        return entry[1].session.secret

    def _renew(self, session_id: str) -> bool:
        entry = self._leases.get(session_id)
        if entry is None:
            return False
        self._leases[session_id] = (time.monotonic() + self.config.lease_seconds, entry[1])
        entry[1]._confirm()
        return True

    async def _watch_leases(self) -> None:
        lease = self.config.lease_seconds
        interval = min(lease / 4, 0.5)
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            lag = now - before - interval
            if lag > interval:
                # our own loop was stalled (page faults, a long copy): renewals may be sitting
                # unread, so that time does not count against the peers
                self._leases = {sid: (exp + lag, p) for sid, (exp, p) in self._leases.items()}
            self._expire(now, lease)

    def _expire(self, now: float, lease: float) -> None:
        """Declare dead the peers whose lease ran out by ``now``. (A function of its own: the
        loop's last peer, bound in ``_watch_leases`` while it sleeps, kept a dead peer's
        channel, its failure's traceback and, through them, what its sends held.)"""
        for sid, (expiry, peer) in list(self._leases.items()):
            if now > expiry:
                del self._leases[sid]
                log.warning(
                    "peer %s at %s missed its lease (%s s): declaring it dead",
                    peer.remote_node[:8],
                    peer.remote_address,
                    lease,
                )
                peer.channel.fail(PeerDisconnected(f"peer {peer.remote_address} stopped renewing its {lease} s lease"))

    def _peer_left(self, peer: Peer) -> None:
        """The node of ``peer``'s session said goodbye (it is closing, ``Leave``): what ends with
        the channel (``ended``: one-sided operations under way, sends waiting for a producer's
        stream, for a message slot or for a rendezvous CTS) fails now with PeerDisconnected, as
        at the lease's end, where the close on the data connection may be held up behind bytes
        not read yet (a reader parked behind a busy consumer stream). Messages that came whole
        stay deliverable, and so do those still on their way: the reader goes on and shuts the
        channel at the close (or the lease ends it)."""
        log.info("peer %s at %s said goodbye: it is closing", peer.remote_node[:8], peer.remote_address)
        # (also where its close on the data connection got here first: the peer went with a goodbye)
        peer._remote_closing = True  # (what ``peer.remote_closing`` and ``repr(peer)`` say)
        peer.channel._ending(PeerDisconnected(f"peer {peer.remote_address} closed (it said goodbye)"))

    # -- public API -----------------------------------------------------------------------------
    @check_arguments
    async def connect(
        self,
        address: str,
        *,
        require: str = "any",
        transports: tuple[str, ...] | list[str] | None = None,
        connect_timeout: float | None = None,
    ) -> Peer:
        """Handshake with the node at ``address`` and open the negotiated data path.

        ``require`` ("any", "rdma", "gpudirect") fails with NegotiationError instead of falling
        back below it; ``transports`` overrides the preference order for this connection.
        Closing the node ends a connect under way with ClosedResourceError.
        """
        check_home(self._loop, "node.connect")  # before its task and its bookkeeping
        try:
            attempt = asyncio.get_running_loop().create_task(
                self._connect(address, require, transports, connect_timeout), name=f"tensorwire-connect {address}"
            )
            self._connecting.add(attempt)
            attempt.add_done_callback(self._connecting.discard)
            try:
                return await attempt
            except asyncio.CancelledError:
                if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
                    attempt.result().abort()  # it connected as our caller gave up: nobody holds it
                task = asyncio.current_task()
                if self._closed and attempt.cancelled() and task is not None and not task.cancelling():
                    raise ClosedResourceError(f"node closed while connecting to {address}") from None
                raise
        except Exception as exc:  # (a cancelled connect, or Ctrl-C, is not a failure to connect)
            _metrics.connect_failed(exc)
            raise

    async def _connect(
        self,
        address: str,
        require: str,
        transports: tuple[str, ...] | list[str] | None,
        connect_timeout: float | None,
    ) -> Peer:
        self._check_open("node.connect")
        host, _ = split_address(address, lowest_port=1)
        if connect_timeout is not None:
            connect_timeout = check_seconds("connect_timeout", connect_timeout)
        check_require(require)
        preference = self.config.transports if transports is None else _check_transports(transports)
        timeout = self.config.connect_timeout if connect_timeout is None else connect_timeout
        if require != "any":
            self._precheck(require, preference)
        request = control_pb2.HandshakeRequest(
            node_id=self.node_id,
            instance_id=self.instance_id,
            protocol_version=PROTOCOL_VERSION,
            auth_token=self.config.auth_token or "",
            preference=list(preference),
            require=require,
            control_address=self.address,
        )
        for offer in self.offers.values():
            request.offers.append(offer_to_pb(offer))
        for name, reason in self.unusable.items():
            request.unavailable.add(name=name, reason=reason)
        client = ControlClient(address, self.config.tls, timeout)
        since = time.monotonic()  # the server's lease on this session begins after this
        opening = ""  # once the handshake is done: the data connection under way, for the error
        handshake: asyncio.Future[control_pb2.HandshakeResponse] | None = None
        # (the handshake call's deadline too, which begins a little later: no answer comes after it)
        until = asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout_at(until):
                # (shielded: a connect given up while the answer was on its way still learns of
                # the session the server opened, and ends it: _give_up)
                handshake = asyncio.ensure_future(client.handshake(request, timeout))
                resp = await asyncio.shield(handshake)
                answer = _checked_answer(resp, address, preference, self.offers, require, self.transports)
                chosen = answer.chosen
                transport = self.transports[chosen.name]
                session = Session(
                    resp.session_id, resp.session_secret, self.node_id, resp.server_node_id, self.config.limits
                )
                dial = transport.dial_address(chosen.address, host)
                opening = f"{chosen.name} data connection"
                if transport.connect_sees_server_go:
                    channel = await transport.connect(dial, session)
                else:
                    channel = await self._open_data(client, transport.connect(dial, session), opening, address)
        except TimeoutError as exc:
            await self._give_up(client, handshake, until)
            # a handshake with no answer: what listens there is most likely no tensorwire node (a
            # port nobody listens on is refused at once), or its packets are dropped on the way
            where = (
                f": the control-plane handshake was done, the {opening} did not open (the server's log may say why)"
                if opening
                else f": nothing answered the handshake. {address} may not be a tensorwire node (check the address "
                "and port), a firewall may drop the connection, or the node is too busy to answer in time"
            )
            raise ConnectTimeout(f"connecting to {address} took longer than {timeout} s{where}") from exc
        except BaseException:
            await self._give_up(client, handshake, until)
            raise
        if self._closed:  # closed while we were connecting: nobody would ever close this peer
            channel.abort()
            await client.aclose()
            raise ClosedResourceError("node is closed")
        if self._session_taken(resp.session_id, resp.session_secret):  # (checked here: no await until adopted)
            channel.abort()
            await client.aclose()
            raise NegotiationError(
                f"{address} answered the handshake with a session id that names another session of this node "
                "(no honest server does: it chooses a new random one): the server is broken or hostile "
                "(check what serves there)"
            )
        choice = Choice(chosen.name, answer.passed_over)
        peer = Peer(
            self,
            channel,
            remote_node=resp.server_node_id,
            remote_instance=resp.server_instance_id,
            remote_address=address,
            path=self._path(choice, channel),
            control=client,
            session=session,
        )
        self._adopt(peer, "connect")
        peer._start_heartbeat(resp.session_id, answer.lease, since)
        log.info("connected to %s: %s", address, peer.path)
        return peer

    async def _give_up(
        self, client: ControlClient, handshake: asyncio.Future[control_pb2.HandshakeResponse] | None, until: float
    ) -> None:
        """A connect ends without a peer (cancelled, timed out, failed, its node closing): close
        its control connection. Where the server answered the handshake, or may yet (its call is
        under way and its deadline, ``until`` in loop time, has not passed: the answer may be on
        its way), first tell it that the session ends (``Leave``), in the background and within
        ``goodbye_seconds`` for each step, so as not to hold up the cancel: it waited for the
        data connection that will never come for its whole connect_timeout (10 s), and then
        warned that the peer never opened it. A data connection that did reach it ends too."""
        if handshake is None or (
            _answered(handshake) is None and (handshake.done() or asyncio.get_running_loop().time() >= until)
        ):
            # no answer, and none can come: close at once. Waiting for the call's end (gRPC's
            # word of its deadline comes late on a loaded machine) kept the channel open past
            # the end of gRPC's connection attempt, which then dialled again (_leave_unopened)
            if handshake is not None:
                handshake.cancel()
            await client.aclose()
            return
        self._retire(_leave_unopened(client, handshake, until, self.config.goodbye_seconds))

    def _retire(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in a task of its own, held until it ends; the node's close waits for it
        (``_retiring``: after its peers and transports have closed)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task

    def _drop_opening(self, session_id: str) -> bool:
        """The client of ``session_id``, whose data connection is still awaited here, gave up its
        connect (it said goodbye, proved): stop waiting for it. Whether one was waiting."""
        task = self._opening.get(session_id)
        if task is None or task.done():
            return False
        task.cancel()  # (a data connection that came meanwhile is dropped: see _expect_peer)
        return True

    async def _open_data(
        self, client: ControlClient, opening: Coroutine[Any, Any, Channel], what: str, address: str
    ) -> Channel:
        """Open the data connection (``opening``) of a transport that does not see the server go
        (``connect_sees_server_go``) while watching the control connection the handshake came
        over: a server that closes or dies before it takes the data connection shuts that at
        once. (Over ucx, whose endpoints carry no peer error handling, nothing else said so,
        and the connect waited out handshake_seconds; over tcp the data listener refuses us as
        fast.) A data connection made as the caller gave up is dropped, which tells the server."""
        connect = asyncio.ensure_future(opening)
        lost = asyncio.ensure_future(client.until_lost())
        try:
            await asyncio.wait([connect, lost], return_when=asyncio.FIRST_COMPLETED)
            if not connect.done() and lost.exception() is None:
                connect.cancel()
                await asyncio.wait([connect])
                if connect.cancelled() or connect.exception() is not None:
                    cause = None if connect.cancelled() else connect.exception()
                    raise ConnectError(
                        f"{what} to {address} failed: the server went away during the connect (its control "
                        "connection shut after the handshake, and a new one is refused: the node closed or "
                        "died); connect again once it serves"
                    ) from cause
            return await connect  # (a watch that failed leaves the connect to its own timeout)
        except BaseException:
            connect.cancel()
            connect.add_done_callback(_drop_channel)  # (also if the wait below is cancelled in turn)
            if not connect.done():
                await asyncio.wait([connect])  # it cleans up while the transport is surely open
            raise
        finally:
            lost.cancel()
            if lost.done() and not lost.cancelled() and lost.exception() is not None:
                log.debug("watching the control connection to %s failed: %r", address, lost.exception())

    def _precheck(self, require: str, preference: tuple[str, ...]) -> None:
        """Fail fast, without a round trip, when this node alone cannot meet ``require``."""
        attr = "rdma" if require == "rdma" else "gpudirect"
        reasons = []
        for name in preference:
            offer = self.offers.get(name)
            if offer is None:
                reasons.append(f"{name}: {self.unusable.get(name, 'not enabled')}")
            elif getattr(offer.capabilities, attr):
                return
            else:
                reasons.append(f"{name}: no {require} on this node")
        raise NegotiationError(f"require={require!r} cannot be met by this node ({'; '.join(reasons)})")

    async def accept(self) -> Peer:
        """Wait for the next peer that connects to this node. One that left before it was
        handed out is skipped, unless it left messages to receive. (Until accept() is first
        called, the node keeps the latest ``MAX_DEPARTED`` (64) of those and drops older ones
        with their messages, warning; from then on it keeps them all.)"""
        self._accepts = True
        while True:
            self._check_open("node.accept")
            if self._incoming:
                peer = self._incoming.popleft()
                self._departed.pop(peer, None)
                return peer
            self._incoming_ready.clear()
            await self._incoming_ready.wait()

    async def __aiter__(self) -> AsyncIterator[Peer]:
        """Peers as they connect, until the node closes."""
        while True:
            try:
                yield await self.accept()
            except ClosedResourceError:
                return

    def _forget(self, peer: Peer, *, closed: bool = False) -> None:
        """``peer`` is gone; ``closed``: closed here (``Peer.aclose``), which lets go of its
        messages, so it leaves the accept queue too (one that had gone with messages was kept
        there for an accept(): a stage's link, taken without one, was kept with them)."""
        if peer in self.peers:
            self.peers.remove(peer)
        if closed and peer in self._incoming:
            self._incoming.remove(peer)
            self._departed.pop(peer, None)

    def _check_open(self, what: str) -> None:
        """Every public call but abort() and aclose() passes here (connect, accept, expose,
        unexpose): refused on a closed node, on one never started, and anywhere but the node's
        loop."""
        if self._closed:
            raise ClosedResourceError("node is closed")
        if self._loop is None:  # (made by hand: it has no transports, and nobody serves its port)
            raise ConfigurationError(
                f"{what}: this node is not started; make nodes with tensorwire.start(address, ...), which "
                "starts them (await it, or use it in 'async with')"
            )
        check_home(self._loop, what)

    async def aclose(self) -> None:
        """Close peers, then listeners and the control plane; idempotent. The closing runs to
        its end even if the caller is cancelled meanwhile (say, an RPC method of this node that
        closes it: closing the peers cancels the method), and every call waits for it."""
        check_home(self._loop, "node.aclose", closing=True)
        if closed_by_hand(self._loop, self._closing):
            self._closed = True  # (the node went with its loop: see closed_by_hand)
            return
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._close(), name="tensorwire-node-close")
        await asyncio.shield(self._closing)

    async def _until_loop_ends(self) -> AsyncGenerator[None, None]:
        """Closes the node if it is still open when its event loop shuts down. The node holds
        this generator, started, until it closes. ``asyncio.run`` (and ``asyncio.Runner``)
        shutting its loop down first cancels every task and waits for them, then closes the
        async generators still open (``loop.shutdown_asyncgens``), the loop still running: so
        the node closes here once its own tasks, and gRPC's, have ended, and before the loop
        closes. (Left open, its ports stayed bound, and its gRPC server, which nobody stopped,
        made a later ``gc.collect()`` wait forever for gRPC's poller thread, grpc/grpc#22365.)
        A loop closed without shutdown_asyncgens never gets here: the node, which gRPC keeps
        alive then, holds its ports until the process exits."""
        try:
            yield
        finally:
            self._loop_end = None  # (this generator: closing the node must not close it again)
            if not self._closed:
                # an async generator that owns the node (``async with start(...)`` around a
                # ``yield``) is being closed now too: its first step closes the node, so let it
                await asyncio.sleep(0)
            closing = self._closing
            # (a closing that began, by abort() or an aclose() in a task, and that the loop's
            # shutdown cancelled part way, runs again: each of its steps may be run twice)
            if closing is None or closing.cancelled():
                leaked = not self._closed
                self._closed = True
                self._closing = asyncio.get_running_loop().create_task(self._close(), name="tensorwire-node-close")
                try:
                    await self._closing
                finally:
                    if leaked:  # last: a filter that makes it an error still leaves the node closed
                        warnings.warn(
                            f"node {self.node_id[:12]} at {self.address} was not closed: use 'async with "
                            "tensorwire.start(...)' or aclose(); it was closed as its event loop shut down",
                            ResourceWarning,
                            source=self,
                            stacklevel=1,  # (from the loop's shutdown: no caller of the user's to point at)
                        )

    async def _close(self) -> None:
        for task in list(self._waiting):
            task.cancel()
        connecting = list(self._connecting)
        for attempt in connecting:
            attempt.cancel()
        # they clean up (their control channel, a half-open data connection) while the
        # transports they use are still open
        await asyncio.gather(*connecting, return_exceptions=True)
        self._incoming_ready.set()  # wake every accept(): the node is closed
        if self._watchdog is not None:
            self._watchdog.cancel()
        # (bounded: a dead node never delays the close for long)
        self._goodbye = asyncio.get_running_loop().create_task(say_goodbye(self, list(self.peers)))
        await self._goodbye
        await asyncio.gather(*[p.aclose() for p in list(self.peers)], return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=0.2)
        # the transports first: a ucx worker may still serve a closed peer's gets and puts from
        # and into exposed memory (UCX's emulated one-sided operations over tcp: its endpoint's
        # close goes on for as long as they do), and only its shutdown ends that for certain.
        # Unexposed tensors waiting for it (``UcxChannel.settled``) are let go after it, and
        # the exposed ones too: let go before, a get still served crashed the process (SIGSEGV)
        await asyncio.gather(*[t.aclose() for t in self.transports.values()], return_exceptions=True)
        await asyncio.gather(*self._retiring, return_exceptions=True)  # their peers are closed
        self.exposures.clear()  # no peer can reach them now: unregister, let the tensors go
        await asyncio.gather(*self._waiting, return_exceptions=True)
        loop_end, self._loop_end = self._loop_end, None
        if loop_end is not None:
            await loop_end.aclose()

    def abort(self) -> None:
        """Forceful close: every peer's connection drops at once (its pending operations fail),
        and the node closes (no new peers; listeners and control plane stop) in the background.
        ``aclose()`` waits for that to finish. Safe from any thread: called where the node's
        loop is not running, it refuses the node at once and hands the rest to that loop."""
        if elsewhere(self._loop, self.abort):
            self._closed = True
            return
        for p in list(self.peers):
            p.abort()
        if self._closing is None:
            self._closed = True
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to close on: the node is refused from now on, aclose() ends it
                return
            self._closing = loop.create_task(self._close(), name="tensorwire-node-close")

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _load_transports(names: tuple[str, ...], *, checksum: bool = False) -> None:
    """Import the transports' modules (ucx's: the UCX libraries and ucxx too; crc32c where the
    node asks for checksums) in a worker thread, so that the loop goes on meanwhile; the probes
    that follow on the loop find them imported.
    Nothing to do on a later start. Never raises: where no worker thread can be had (the loop's
    default executor shut down), what is left imports in the probes, on the loop, as it did."""
    if transport_registry.loaded(names, checksum=checksum):
        return
    try:
        await asyncio.to_thread(transport_registry.load, names, checksum=checksum)
    except RuntimeError as exc:  # ("cannot schedule new futures after shutdown")
        log.debug("loading the transports on the loop: %r", exc)


def _drop_channel(connect: asyncio.Future[Channel]) -> None:
    """A data connection that opened after its connect gave up: nobody will use it. Aborting
    it tells the server, which would otherwise keep its peer until the lease ran out."""
    if not connect.cancelled() and connect.exception() is None:
        connect.result().abort()


def _answered(handshake: asyncio.Future[control_pb2.HandshakeResponse]) -> control_pb2.HandshakeResponse | None:
    """The server's answer to a connect's handshake call; None while the call is under way, or
    where it failed or was cancelled."""
    if handshake.done() and not handshake.cancelled() and handshake.exception() is None:
        return handshake.result()
    return None


async def _leave_unopened(
    client: ControlClient,
    handshake: asyncio.Future[control_pb2.HandshakeResponse],
    until: float,
    seconds: float,
) -> None:
    """Tell the server of a connect that gave up that the session its handshake opened ends
    (``Node._give_up``), once the answer has come (within ``seconds``, goodbye_seconds: a server that has
    not answered by then most likely never will), then close the control connection. Best
    effort: a server not told forgets the session at its connect_timeout, as before.

    The wait ends at the handshake call's deadline (``until``, loop time) too: no answer comes
    after it, and gRPC's connection attempt, which it bounds (``ControlClient``), may end then.
    A channel still open when an attempt ends without a connection dials again, with an attempt
    of its backoff (1.6 s, then 2.56 s, ...) that goes on after the channel closes: against a
    node that takes connections and never answers, one left open seconds after the connect."""
    try:
        if not handshake.done():
            # (a timeout already past returns at once)
            await asyncio.wait([handshake], timeout=min(seconds, until - asyncio.get_running_loop().time()))
        if (resp := _answered(handshake)) is not None:
            await client.leave([(resp.session_id, leave_proof(resp.session_secret, resp.session_id))], seconds)
    except Exception as exc:  # (it is gone, or closing)
        log.debug("goodbye for the unopened session to %s failed: %r", client.target, exc)
    finally:
        handshake.cancel()  # (one not answered in time: nobody waits for it)
        await client.aclose()


class _Starting:
    """``await start(...)`` gives a Node; ``async with start(...) as node`` also closes it."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def __await__(self) -> Generator[Any, None, Node]:
        return self._node._start().__await__()

    async def __aenter__(self) -> Node:
        return await self._node._start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._node.aclose()


@check_arguments
def start(address: str = "127.0.0.1:0", *, config: NodeConfig | None = None, **options: Any) -> _Starting:
    """Start a node serving at ``address`` (port 0 picks a free port; read ``node.address``).

    Options are NodeConfig fields: ``transports``, ``auth_token``, ``limits``,
    ``connect_timeout``, ``lease_seconds``, ``checksum``, ``tls``, ``node_id``, ``ucx_options``,
    ``goodbye_seconds``.
    A bad address, option or value raises ConfigurationError here, before anything starts.
    """
    if config is not None and not isinstance(config, NodeConfig):
        raise ConfigurationError(f"config must be a tensorwire.NodeConfig, not {config!r}")
    cfg = config or NodeConfig()
    if options:
        check_options("start()", options, [f.name for f in dataclasses.fields(NodeConfig)])
        cfg = dataclasses.replace(cfg, **options)
    return _Starting(Node(address, cfg))
