"""The data-plane contract every transport implements.

A ``Transport`` says what it can do before it is used (``probe()``, no side effects), listens
and publishes an opaque address blob that the control plane carries without parsing, and opens
``Channel``s to peers. A ``Channel`` moves tagged messages both ways; matching sends to recvs,
buffering and backpressure live in the shared ``Mailbox`` so that every transport behaves the same.
"""

from __future__ import annotations

import asyncio
import enum
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .. import _metrics
from .._checks import check_arguments, check_int, check_seconds
from .._loops import wait_out
from ..errors import ClosedResourceError, ProtocolError, TensorWireError, TransferError, fresh

if TYPE_CHECKING:
    from ..tensors._device import Streams
    from ._frames import PeerLimits

__all__ = [
    "Capabilities",
    "BYE_GRACE",
    "Channel",
    "ChannelState",
    "Limits",
    "PendingSessions",
    "Receipt",
    "Session",
    "Transport",
    "TransportContext",
    "fresh",  # (tensorwire.errors.fresh, which every transport uses)
    "still_writing",
    "unsettled",
]

MiB = 1 << 20
# a graceful close's goodbye (every transport's): what the channel owes its peer (payloads UCX
# or the peer's RDMA READs are moving, frames queued) goes first, and a goodbye received lets
# the transfers in flight end first, this long at most in all
BYE_GRACE = 1.0

# failures told to an operation whose native request may still write into its buffers (a UCX
# receive or get the hardware cannot take back, outlasting its grace): ``still_writing``
_STILL_WRITING: weakref.WeakSet[BaseException] = weakref.WeakSet()


def still_writing(exc: BaseException) -> BaseException:
    """Mark ``exc`` as a failure after which the operation's memory may still be written (or,
    for a send, read by a peer that only stopped);
    returns it. A cancellation of that operation raises it in place of ``CancelledError``
    (``unsettled``): its caller must not take the buffer back as its own."""
    _STILL_WRITING.add(exc)
    return exc


def unsettled(failures: Collection[BaseException | None]) -> BaseException | None:
    """The first of ``failures`` marked by ``still_writing``, or None. A cancelled operation
    raises it rather than ``CancelledError``: a plain cancel (an ``asyncio.timeout``'s
    TimeoutError) would say that the operation is over and its buffer the caller's again, while
    the native request may still write into it."""
    return next((exc for exc in failures if exc is not None and exc in _STILL_WRITING), None)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do on this machine, known before it is used.

    tcp_only: every lane this transport could use goes through the kernel's TCP stack (UCX
        with only its tcp transport, say); negotiation then prefers tensorwire's own tcp
        transport, which moves the same bytes with less machinery, and says so.
    """

    memory_kinds: tuple[str, ...] = ("host",)
    one_sided: bool = False
    rdma: bool = False
    gpudirect: bool = False
    lanes: tuple[str, ...] = ()
    tcp_only: bool = False


@check_arguments
@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds that keep a node's memory and a peer's claims in check.

    recv_buffer_bytes: bytes of messages that arrived before their recv that one peer may
        have buffered here; past it the sender waits for the recv (rendezvous), never the heap.
        Over tcp it also bounds the page-locked chunks a message into CUDA memory may take past
        the staging ring while its consumer's stream is busy, so the reader goes on.
    max_unexpected: messages (headers) one peer may have waiting here for a recv; tensorwire's
        own messages (calls, one-sided requests) have as many again (``_credit.own_slots``).
    max_message_bytes: the largest message accepted from a peer.
    max_header_bytes: the largest message header accepted from a peer; at least
        MIN_HEADER_BYTES, so that a short error reply (an RPC's reply of last resort) always fits.
    chunk_bytes: payload frame size, so that concurrent messages interleave on one stream; at
        least MIN_CHUNK_BYTES.
    inline_bytes: the most payload bytes a transport may carry with a message's header (ucx,
        verbs).
    handshake_seconds: how long an incoming data connection has to prove its session.

    Every field is checked here (ConfigurationError): the byte counts are ints that the wire's
    limits record can carry (recv_buffer_bytes and max_message_bytes below 2**64, from 0;
    max_unexpected from 1, and max_header_bytes, below 2**32), and handshake_seconds is a
    finite number of seconds above 0. recv_buffer_bytes=0 is valid: every message then waits
    for its recv (rendezvous).
    """

    MIN_HEADER_BYTES: ClassVar[int] = 1024  # below it not even a short RPC error reply fits
    MIN_CHUNK_BYTES: ClassVar[int] = 4096

    recv_buffer_bytes: int = 64 * MiB
    max_unexpected: int = 1024
    max_message_bytes: int = 1 << 40
    max_header_bytes: int = 1 * MiB
    chunk_bytes: int = 4 * MiB
    inline_bytes: int = 64 * 1024
    handshake_seconds: float = 10.0

    def __post_init__(self) -> None:
        u32, u64 = (1 << 32) - 1, (1 << 64) - 1  # the fields of the wire's LIMITS record (_frames.py)
        for name, lo, hi in (
            ("recv_buffer_bytes", 0, u64),
            ("max_unexpected", 1, u32),
            ("max_message_bytes", 0, u64),
            ("max_header_bytes", self.MIN_HEADER_BYTES, u32),
            ("chunk_bytes", self.MIN_CHUNK_BYTES, u64),
            ("inline_bytes", 0, u64),
        ):
            object.__setattr__(self, name, check_int(f"Limits.{name}", getattr(self, name), lo, hi))
        object.__setattr__(self, "handshake_seconds", check_seconds("Limits.handshake_seconds", self.handshake_seconds))


@dataclass(frozen=True, slots=True)
class Session:
    """What the control plane agreed for one peer: identity, secret and limits."""

    id: str
    secret: bytes = field(repr=False)  # never printed
    local_node: str
    remote_node: str
    limits: Limits


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a node gives each of its transports."""

    node_id: str
    host: str
    limits: Limits
    checksum: bool = False  # ask for crc32c on every payload frame where the transport can


@dataclass(slots=True)
class Receipt:
    """How one transfer went: which path carried it, how many bytes, how long it took.

    protocol: "eager" (sent without waiting for the recv), "rendezvous" (payload moved once the
        recv was posted, straight into its buffer) or "inline".
    direct: bytes went between the caller's buffer and the wire with no copy by tensorwire
        (never "inline": those bytes are copied into the header's frame, and out of it; nor a
        tcp message most of whose payload the receiver copied out of the channel's read-ahead
        buffer: it counts the bytes each message took from there, not read straight into the
        recv's memory, and labels the message by where most went. The header read takes up to
        16 KiB of payload along and a rest under 64 KiB goes through that buffer too: up to
        about 80 KiB none lands in place; above, the copied head is 17% of 96 KiB, 6% of
        256 KiB, 1.5% of 1 MiB; nor a message that a recv cancelled after most of its payload
        had landed in its out= gave back: those bytes were copied from there into ours).
    staged: bytes passed through a tensorwire buffer (received before the recv was posted).
    packed: the bytes went from a copy tensorwire made: a non-contiguous tensor packed into C
        order, or a torch view with the conj or neg bit resolved (never ``direct`` then).
    memory: "cuda" if the tensors were (sending) or are now (receiving) in CUDA memory, else
        "host"; with ``staged`` such bytes went through host staging buffers of tensorwire's.
    parts: a one-sided batch (``read_many``, ``write_many``) whose handles moved in different
        ways, some one-sided and some served by their owner (``protocol="mixed"``): one receipt
        per way, the one-sided part first, each with its handles' bytes and flags (which handle
        went which way is its ``direct``). Empty for every other transfer.
    lanes: the lanes the transfer could take: those of the channel's endpoint, or, where
        ``route`` is set, the ones the transport below says the payload took.
    route: the transport below tensorwire's own name for how it moved the payload, where it says:
        over ucx, for a send whose payload segments are each 4 MiB or more, the protocol UCX
        selected for them ("rendezvous zero-copy read from remote" over cma, "rendezvous
        zero-copy fenced write to remote" over tcp), and for a read or write (a batch too)
        whose gets or puts are each 4 MiB or more, the one it selected for those ("zero-copy"
        over cma; over tcp "software emulation" for a get, "zero-copy" for the tcp transport's
        put, which the owner's worker serves all the same: "one-sided-emulated"); a mixed
        batch says it in its one-sided part. ``lanes`` are then the lanes that protocol used
        ("cma/memory"; "tcp/lo", "tcp/eth0"). Empty elsewhere: tcp and inproc (their protocol
        says it all), a ucx recv (UCX keeps no protocol on a receive in its release builds), a
        smaller ucx payload, get or put (asking costs UCX 5-8 us a request), one UCX completed
        within the call that posted it, and device memory moved through staging chunks.

    Not frozen: one is built per message, and a frozen dataclass's ``__init__`` costs about
    four times as much (every field through ``object.__setattr__``). Treat it as read-only.
    """

    transport: str
    lanes: tuple[str, ...]
    nbytes: int
    seconds: float
    protocol: str
    direct: bool
    staged: bool
    packed: bool
    memory: str = "host"
    parts: tuple[Receipt, ...] = ()
    route: str = ""

    @property
    def gbps(self) -> float:
        """The transfer's rate in GB/s (1e9 bytes per second); inf where it took no measurable time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class ChannelState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    BROKEN = "broken"


class Channel(ABC):
    """A bidirectional data-plane connection to one peer."""

    transport: str
    lanes: tuple[str, ...]
    # device memory kinds this channel writes and reads itself ("cuda", and "host-engine", the
    # host stand-in of tests); other device tensors are staged through host memory around it
    device_kinds: frozenset[str] = frozenset()
    # one-sided channels: gets and puts take memory of those kinds by pointer as well
    rma_device: bool = False
    # one-sided channels: a get/put reaches the peer's memory without its CPU (cma, RDMA); False
    # where the transport emulates it and the peer's own progress serves it (UCX over tcp lanes)
    one_sided_direct: bool = True
    # what the peer promised to accept (its Limits), exchanged as the channel opened: every
    # transport sets it before it hands the channel out
    _remote: PeerLimits
    _ended: asyncio.Future[None] | None = None  # ``ended``, made when first asked for

    @property
    def remote_limits(self) -> PeerLimits:
        """The peer's limits: its message slots, credit, largest message and header."""
        return self._remote

    def __init__(self) -> None:
        from ._mailbox import Mailbox

        self.state = ChannelState.OPEN
        self.mailbox = Mailbox(self)
        self._on_close: list[Callable[[BaseException | None], Any]] = []

    @abstractmethod
    async def send(self, tag: int, msg: Any) -> Receipt:
        """Send one prepared message (tensors.Outgoing) on ``tag``. Device tensors of a kind the
        channel does not move itself are staged first (``stage_device``)."""

    async def stage_device(self, msg: Any) -> None:
        """Before a send: device tensors of a memory kind this channel does not move itself
        (``device_kinds``) go to host memory of ours first (``Outgoing.to_host``), once their
        producers' streams are done; a wait the channel's end cuts short (``ended``). A copy
        that fails (a device error) raises TransferError with the device's error as its cause:
        nothing of the message was sent, and the channel goes on, as when a tcp send's copy
        down fails. (The device's error came out bare, and an owner serving a read answers
        TensorWireErrors only: the read waited for good.)"""
        if msg.on_device and msg.memory not in self.device_kinds:
            try:
                await msg.to_host(self.ended)
            except TensorWireError:  # (the channel's end cut the wait short: its failure)
                raise
            except Exception as exc:
                raise TransferError(
                    f"the message could not be copied out of device memory ({exc!r}); nothing of it was "
                    "sent, and the channel goes on"
                ) from exc

    @property
    def ended(self) -> asyncio.Future[None]:
        """A future that fails with the channel's failure once it is closed or broken: what a
        send's wait for its producer stream ends with (``wait_event(..., until=)``). That stream
        stays busy for as long as the caller's device work runs, or for good; the send raises
        what it would have raised had the channel been closed before it began (``check_open``:
        ClosedResourceError for our own close, PeerDisconnected for the peer's), and its bytes
        never go."""
        fut = self._ended
        if fut is None:
            fut = self._ended = asyncio.get_running_loop().create_future()
            if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
                why = self.mailbox.failure or ClosedResourceError(f"{self.transport} channel is {self.state.value}")
                _end(fut, fresh(why))
        return fut

    def recv(
        self, tag: int, out: object | None, device: object = None, *, streams: Streams | None = None, keep: bool = True
    ) -> Coroutine[Any, Any, tuple[Any, Receipt]]:
        """Receive the next message on ``tag`` (a coroutine: ``Mailbox.recv``'s own, which counts
        it in the metrics; a coroutine of this method around it cost a frame per message).
        ``streams``: the consumer's streams, taken by a caller inside the library at its own
        call (one that awaited since, when another task may have made other streams current);
        by default taken when the coroutine starts. ``keep=False``: the message's bytes are
        wanted nowhere but in ``out=``."""
        return self.mailbox.recv(tag, out, device, streams=streams, keep=keep)

    def wait_briefly(self, fut: Any) -> None:
        """A recv just posted ``fut``: a transport that can progress inline (without the loop)
        may do so for a short, bounded time, so that an answer due within microseconds is
        taken without a trip through the event loop. Never blocks for long; default: nothing."""
        return None

    @abstractmethod
    async def pull(self, arrival: Any) -> None:
        """Move a rendezvous arrival's payload into ``arrival.dest`` (the recv is posted)."""

    def discard(self, arrival: Any) -> bool:
        """Drop a message its receiver will never take, one that waits unread because there was
        no memory for it here (``Arrival.adopt`` failed) though its sender has already handed its
        payload over and cannot take it back (eager): its payload lands nowhere, its sender's send
        completes, and it leaves its tag's queue, failed (TransferError). A rendezvous message
        not yet pulled goes the same way where the transport can let its payload land nowhere
        (ucx: UCX truncates it into a byte of scratch; verbs: answered as an ABORT, nothing
        read). False, and nothing changed, where only its sender can take it back (tcp: ``pull``
        or the sender's abort) or the transport never keeps such a message (it drops it as it
        arrives). Default: False."""
        return False

    def take_back(self, arrival: Any) -> bool:
        """The recv that ``arrival`` is landing for (its payload being written into ``dest``,
        perhaps that recv's out=) was cancelled: if none of the payload has begun to land there,
        stop it from landing there at all and return True; the message is then unread again
        (``unread``), as before its recv took it, and goes back to its tag's queue. False, and
        nothing changed, where some of it may be landing (the recv waits for that). ucx: its
        payload receives are cancelled if none has matched (a sender that has not sent the
        payload yet, or stopped first). Default: False."""
        return False

    def unread(self, arrival: Any) -> bool:
        """Whether nothing of ``arrival``'s payload has been, or will be, written into its
        ``dest`` until a recv pulls it: a rendezvous message matched but not pulled, an eager
        one whose read waits for its recv's task. A recv cancelled then gives the message back
        with no buffer (``Arrival.detach``), since nothing landed in its out=. Default: False
        (the transport writes as the bytes come, and says how far in ``Arrival.landed``)."""
        return False

    def settled(self) -> Awaitable[None] | None:
        """What to wait for, once the peer has gone (closed, said goodbye, declared dead), until
        nothing of the peer's reaches this node's memory through the channel any more: an owner
        lets an unexposed tensor go only then. None: nothing (the default: the transport serves
        none of the peer's operations once the channel has shut). ucx: until the channel has
        shut and its endpoint closed (``UcxChannel.settled``)."""
        return None

    @abstractmethod
    def release(self, arrival: Any) -> None:
        """The recv consumed ``arrival``: give its buffer credit and slot back to the sender."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close gracefully; idempotent. What is owed to the peer goes first (``BYE_GRACE`` at
        most); pending operations then fail with ClosedResourceError."""

    @abstractmethod
    def abort(self) -> None:
        """Close at once, waiting for nothing (what is owed to the peer is dropped); the peer
        sees the connection end, as it would a dropped one."""

    @abstractmethod
    def fail(self, exc: BaseException) -> None:
        """Break the channel from outside (e.g. the lease ran out): pending work fails with ``exc``."""

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight

    def _send_receipt(self, msg: Any, protocol: str, t0: float, tag: int, *, copied: bool = False) -> Receipt:
        """The receipt of a send of ``msg`` (tensors.Outgoing) on ``tag`` that began at ``t0``,
        counted in the metrics (a transport that builds its own calls ``_metrics.transferred``).
        ``copied``: most of the payload went from a copy the transport made of it (not direct)."""
        seconds = time.perf_counter() - t0
        packed, staged = msg.packed, msg.staged
        direct = not packed and protocol != "inline" and not staged and not copied
        # (positional: half the cost of keywords, per message) transport, lanes, nbytes, seconds,
        # protocol, direct, staged, packed, memory
        receipt = Receipt(self.transport, self.lanes, msg.nbytes, seconds, protocol, direct, staged, packed, msg.memory)
        _metrics.transferred("send", receipt, tag)
        return receipt

    async def _finish_posted(self, futs: Collection[asyncio.Future[None]]) -> None:
        """Wait until every one of ``futs`` (operations the hardware cannot take back: UCX
        requests, RDMA work requests) has completed, then raise the first failure. A
        cancellation waits too and is raised after, in place of any failure but one that says
        the memory may still be written (``still_writing``), which is raised instead.

        Whatever the channel's state: while CLOSING its ``aclose`` is still trading goodbyes
        (for a second at most) and its operations may still be writing into the caller's
        memory; a shutdown resolves each once it no longer can (verbs destroys the queue pair
        first and fails them; ucx lets UCX complete them, bounded by a grace after which the
        failure says the memory may still be written). Raising a cancel at once after the
        shutdown would return while the operation may still write. One at a time (``wait_out``:
        a ``Pledge`` is awaited directly, a loop turn sooner than through ``asyncio.wait``)."""
        cancelled = False
        for fut in futs:
            try:
                await wait_out(fut)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            # the failure (a shutdown's, mostly) is not what the caller asked about, unless it
            # says that the memory may still be written
            late = unsettled([None if fut.cancelled() else fut.exception() for fut in futs])
            if late is not None:
                raise late
            raise asyncio.CancelledError
        for fut in futs:
            fut.result()

    def check_open(self) -> None:
        if self.state is ChannelState.CLOSING:  # our own aclose is under way
            raise ClosedResourceError(f"{self.transport} channel is closing")
        if self.state is not ChannelState.OPEN:
            exc = self.mailbox.failure
            if exc is not None:
                raise fresh(exc)
            raise ClosedResourceError(f"{self.transport} channel is {self.state.value}")

    def add_close_callback(self, cb: Callable[[BaseException | None], Any]) -> None:
        self._on_close.append(cb)

    def _ending(self, exc: BaseException) -> None:
        """Fail ``ended`` before the channel shuts: the peer's close is known while bytes it sent
        before it are still unread (tcp's reader waiting for a consumer's stream)."""
        _end(self.ended, exc)

    def _check_going(self) -> None:
        """``check_open`` for a send about to wait on the peer (a slot, a CTS): it raises also once
        ``ended`` failed while the channel is still open (the peer said goodbye), as that wait
        would never end (the transports fail the waits already under way in ``_ending``)."""
        self.check_open()
        ended = self._ended
        if ended is not None and ended.done() and (exc := ended.exception()) is not None:
            raise fresh(exc)

    def _closed(self, state: ChannelState, exc: BaseException) -> None:
        """Mark the channel closed or broken and fail everything pending with ``exc``."""
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            return
        self.state = state
        self.mailbox.fail(exc)
        if self._ended is not None:
            _end(self._ended, fresh(exc))
        for cb in self._on_close:
            cb(exc)

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _end(fut: asyncio.Future[None], exc: BaseException) -> None:
    """Fail a channel's ``ended`` with ``exc``, marked retrieved (no wait may be listening)."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


class PendingSessions:
    """The sessions a transport's server side waits for a data connection for, each with the
    future its channel resolves (``Transport.expect``). A HELLO is admitted against its entry;
    an entry leaves once its future is done, and closing the transport cancels what still waits."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[Session, asyncio.Future[Channel]]] = {}

    def expect(self, session: Session) -> asyncio.Future[Channel]:
        fut: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()
        self._by_id[session.id] = (session, fut)

        def forget(_: object) -> None:
            entry = self._by_id.get(session.id)
            if entry is not None and entry[1] is fut:  # not a later expect of the same id
                del self._by_id[session.id]

        fut.add_done_callback(forget)
        return fut

    def admit(self, sid: bytes | str, proven: Callable[[Session], bool]) -> tuple[Session, asyncio.Future[Channel]]:
        """The waiting entry a peer's HELLO names, if ``proven(session)`` says the HELLO's proof
        of the session secret holds; ProtocolError saying which check failed otherwise."""
        key = sid if isinstance(sid, str) else sid.decode("utf-8", "replace")
        entry = self._by_id.get(key)
        if entry is None:
            raise ProtocolError("unknown or already used session id")
        if not proven(entry[0]):
            raise ProtocolError("wrong session secret")
        if entry[1].done():
            raise ProtocolError("session no longer pending")
        return entry

    def __len__(self) -> int:
        """How many sessions are still waiting (or done, for one more loop turn)."""
        return len(self._by_id)

    def cancel_all(self) -> None:
        for _, fut in list(self._by_id.values()):
            fut.cancel()


class Transport(ABC):
    """A way to move bytes between nodes. One instance per node."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    extra: ClassVar[str | None] = None  # the pip extra that installs what it needs
    # whether connect() fails at once by itself when the server goes away before it takes the
    # data connection (a socket refused or shut); where not, the node watches the control
    # connection meanwhile, which the server's going shuts
    connect_sees_server_go: ClassVar[bool] = True
    # whether checksum=True protects its payloads (a crc32c on each frame, or no wire to cross);
    # where not, a node that asked for checksums warns as a peer opens over it
    checks_payloads: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def probe(cls) -> Capabilities | None:
        """What this transport can do here, or None if it cannot run. No side effects."""

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``probe()`` returned None, in words a user can act on."""
        return f"{cls.name} cannot run on this machine"

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        self.ctx = ctx
        self.capabilities = capabilities
        self.sessions = PendingSessions()

    def accepts(self, address: bytes) -> str | None:
        """None if a peer offering ``address`` is reachable, else why not (cheap, local check)."""
        return None

    def endpoint_lanes(self, address: bytes) -> tuple[str, ...]:
        """The lanes a connection to the peer at ``address`` (already checked by ``accepts``)
        would really use, where they can be fewer than this transport lists (UCX: shared memory
        only on one machine); ``()`` when the transport cannot tell or has one way only."""
        return ()

    def stranded(self) -> tuple[int, int]:
        """Requests of closed channels that this transport could not finish and still keeps
        memory for (ucx: those UCX has not completed, mostly rendezvous sends to peers that
        died, which it never completes; receives cut off while their message was landing), and
        those bytes: the metrics' ``tensorwire_stranded_requests`` and ``_bytes``."""
        return 0, 0

    def dial_address(self, address: bytes, dialled_host: str) -> bytes:
        """Client side: where to connect for a peer that offered ``address``, whose control plane
        we reached at ``dialled_host`` (a transport whose address names a listening host
        replaces a wildcard one with it)."""
        return address

    @abstractmethod
    async def listen(self) -> bytes:
        """Start accepting data-plane connections; return the opaque address blob."""

    def expect(self, session: Session) -> Awaitable[Channel]:
        """Server side: await the peer's data connection for ``session`` (secret checked: the
        transport admits the peer's HELLO through ``self.sessions``)."""
        return self.sessions.expect(session)

    @abstractmethod
    async def connect(self, address: bytes, session: Session) -> Channel:
        """Client side: open the data connection for ``session`` to ``address``."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop listening and close every channel; idempotent."""
