"""Peer: one connected remote node, and the three verbs that move tensors to and from it."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Never

from . import _onesided
from ._checks import MISSING, check_arguments, hide_misspelt, refuse_misspelt, take_missing
from ._leases import Renewals, plan_goodbye, renewals_for, send_goodbye
from ._loops import check_home, closed_by_hand, elsewhere, running_loop
from ._onesided import RemoteHandle, check_handle_name
from .control._auth import heartbeat_proof, lookup_proof
from .control._client import ControlClient, NodeClosing, SessionLost, nothing_listens
from .errors import (
    ClosedResourceError,
    ConfigurationError,
    ControlPlaneError,
    HandleNotFound,
    PeerDisconnected,
    TensorWireError,
)
from .rpc import CallReceipt
from .rpc import _client as _rpc
from .tensors import prepare_off_loop
from .tensors._message import Preparing
from .transports import Channel, ChannelState, Receipt, Session
from .transports._credit import OWN_TAGS

if TYPE_CHECKING:
    from ._node import Node
    from ._path import Path

__all__ = ["Peer", "tag_id"]

_I64 = 1 << 63


@functools.lru_cache(maxsize=4096)
def _str_tag(tag: str) -> int:
    try:
        raw = tag.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: no bytes every process would agree on
        raise ConfigurationError(f"tag {tag!r} cannot be encoded as UTF-8: {exc.reason}") from None
    wire = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    if wire in RESERVED_TAGS:  # (1 name in 65,536) moved out of tensorwire's own range, which
        wire ^= _OUT_OF_RESERVED  # takes slots the user's messages may not (transports/_credit.py)
    return wire


def _listed(what: str, items: object) -> list[Any]:
    """A batch argument of ``read_many`` / ``write_many`` as a list: a sequence (or another
    iterable) of handles, buffers or sources. One handle is not a batch of its rows."""
    if isinstance(items, RemoteHandle):
        raise ConfigurationError(
            f"{what}: a list of handles, not one handle ({items.name!r}); peer.read(h) and "
            "peer.write(h, src) take one, and [h[i] for i in range(h.shape[0])] lists its rows"
        )
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ConfigurationError(f"{what} must be a sequence, one entry per handle, not {type(items).__name__}")
    return list(items)


# tensorwire's own tags (rpc, one-sided requests and replies, bench, pipeline stages' hellos and
# aborts) all lie in this range, whose messages the transports give slots of their own. The
# public verbs refuse them (tag_id); tensorwire's layers send and receive on them through
# Peer._send_own / _recv_own / _recv_own_with_receipt
RESERVED_TAGS = OWN_TAGS
_RESERVED_FIRST, _RESERVED_LAST = RESERVED_TAGS[0], RESERVED_TAGS[-1]
_OUT_OF_RESERVED = 1 << 62  # (keeps the sign: the result is a 64-bit tag outside the range)


def tag_id(tag: int | str) -> int:
    """The 64-bit wire tag for a user's ``tag``; strings hash the same in every process.

    An int in ``RESERVED_TAGS`` is refused: a user's message there would take the slots kept
    for tensorwire's own messages, and a user's recv there would take one of them (an RPC
    reply, a one-sided request) from the layer waiting for it, which then waits for good.
    """
    if isinstance(tag, bool) or not isinstance(tag, (int, str)):
        raise ConfigurationError(f"tag must be an int or a str, not {type(tag).__name__}")
    if isinstance(tag, str):
        return _str_tag(tag)
    if not -_I64 <= tag < _I64 or _RESERVED_FIRST <= tag <= _RESERVED_LAST:  # (one branch on the hot path)
        if not -_I64 <= tag < _I64:
            raise ConfigurationError(f"tag {tag} does not fit in 64 bits")
        raise ConfigurationError(
            f"tag {tag} is one of tensorwire's own (the ints {_RESERVED_FIRST:#_x} to {_RESERVED_LAST:#_x}, "
            "tensorwire._peer.RESERVED_TAGS, carry its rpc, one-sided, bench and pipeline messages); "
            "use an int outside that range, or a string tag"
        )
    return tag


def _cancelling() -> bool:
    """Whether the running task has been asked to cancel (and has not taken it back)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _OnItsLoop(AsyncIterator[Any]):
    """A stream (``peer.stream``), read only on its peer's loop, as every other call: its
    generator runs on whichever loop reads it, and read from another one it used the channel
    from there, and that loop's end (``asyncio.run`` closing its async generators) closed the
    stream under its own loop, the items left lost. Refused there at once, it goes on here."""

    __slots__ = ("_home", "_items", "_what")

    def __init__(self, items: AsyncGenerator[Any, None], home: asyncio.AbstractEventLoop | None, what: str) -> None:
        self._items, self._home, self._what = items, home, what

    def __aiter__(self) -> _OnItsLoop:
        return self

    def __anext__(self) -> Awaitable[Any]:
        if running_loop() is not self._home:
            check_home(self._home, self._what)
        return self._items.__anext__()

    def aclose(self) -> Awaitable[None]:
        """Leave the stream early: the method is cancelled on the server (as ``break`` does)."""
        if running_loop() is not self._home:
            check_home(self._home, self._what, closing=True)
        return self._items.aclose()


class Peer:
    """A connected remote node. Either side may send and recv; messages match per tag, FIFO.

    Use it as an async context manager, or call ``aclose()``. ``path`` says which transport
    carries the bytes and why faster ones were not used. ``remote_node`` is the other node's
    ``node_id``, a name for people that other nodes may share (a hostname, in containers);
    ``remote_instance`` is its ``Node.instance_id``, which tells running nodes apart: the same
    for every peer of one node, whatever address reached it, and new when the node restarts.
    """

    def __init__(
        self,
        node: Node,
        channel: Channel,
        *,
        remote_node: str,
        remote_instance: str,
        remote_address: str,
        path: Path,
        control: ControlClient | None = None,
        session: Session | None = None,
        control_address: str = "",
        control_name: str | None = None,
    ) -> None:
        self.node = node
        self._home = node._loop  # every call but abort() must come from there (check_home)
        self.channel = channel
        self.remote_node = remote_node
        self.remote_instance = remote_instance
        self.remote_address = remote_address
        self.path = path
        self._control = control
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._renewals: Renewals | None = None  # (we connected) what renews our session's lease
        self._said_goodbye = False  # (its node was told this session ends, or is being: plan_goodbye)
        self._goodbye: asyncio.Future[None] | None = None  # (that call, where this peer's close makes it)
        self._remote_closing = False  # (its node said goodbye to us: Node._peer_left)
        self.session = session
        self._control_address = control_address  # the remote's control plane, for lookups
        self._control_name = control_name  # (TLS) the name its certificate there must carry (callback_name)
        self._tasks: set[asyncio.Task[None]] = set()
        # the session's lease, and when the other side last proved it alive: our own renewal
        # was sent (we connected), or its renewal reached us (it connected). See _lease_fence.
        self._lease: float | None = None
        self._confirmed = time.monotonic()
        self._renewed = asyncio.Event()
        # per tag, the last send still packing (or behind one that is): a later send on the tag
        # waits until it has entered the channel (``_send_in_order``)
        self._packing: dict[int, asyncio.Future[None]] = {}
        self._sends = 0  # the user's sends called and not returned yet (``send``), for ``repr``

    def __repr__(self) -> str:
        # the user's recvs and sends under way, apart: one in_flight count summed the user's
        # recvs with every send the channel was moving, tensorwire's own among them (an owner's
        # answers to reads, RPC requests and replies), and left out sends still packing
        state = self.channel.state
        said = " (it said goodbye)" if self._remote_closing and state is ChannelState.OPEN else ""
        return (
            f"<Peer {self.remote_node[:12]} at {self.remote_address} via {self.path.transport} "
            f"{'closing' if said else state.value}{said} recvs={self.channel.mailbox.in_flight} sends={self._sends}>"
        )

    @property
    def closed(self) -> bool:
        """True once the channel to this peer is no longer open (closed by either side, broken,
        or the lease ran out). Still False after the other node said goodbye (``remote_closing``)
        until its close reaches the data connection: messages that came before it are received."""
        return self.channel.state is not ChannelState.OPEN

    @property
    def remote_closing(self) -> bool:
        """True once the other node said goodbye to this peer (its node, or the peer alone, began
        to close, and told this node on the control plane), even while ``closed`` is still False:
        a send begun then raises PeerDisconnected, and messages that came before it can still be
        received until the channel closes. False for a peer that went without a goodbye (an
        ``abort()``, a dead process: ``closed`` tells)."""
        return self._remote_closing

    @hide_misspelt
    async def send(self, obj: Any, *, tag: int | str = 0, **_misspelt: Never) -> Receipt:
        """Send a tensor or a pytree of tensors and scalars; returns how it went.

        Returns once the bytes have left the caller's buffers, which may then be reused. Waits
        (backpressure) when the peer holds more unreceived messages than its limits allow.
        """
        if _misspelt or obj is MISSING:  # (check_arguments' frame costs 2-3% of a small round trip: see hide_misspelt)
            refuse_misspelt(Peer.send, _misspelt, obj=obj)
        wire = tag_id(tag)
        # (``_send_own`` written out: a coroutine less per message)
        if running_loop() is not self._home:
            check_home(self._home, "peer.send")
        preparing = prepare_off_loop(obj)
        msg = preparing.ready
        self._sends += 1
        try:
            if msg is not None and wire not in self._packing:
                return await self.channel.send(wire, msg)
            return await self._send_in_order(wire, preparing)
        finally:
            self._sends -= 1

    async def _send_own(self, obj: Any, *, tag: int) -> Receipt:
        """``send`` on a wire tag as it is: tensorwire's own messages, on the reserved tags the
        public verbs refuse (RESERVED_TAGS)."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.send")
        preparing = prepare_off_loop(obj)
        msg = preparing.ready
        if msg is not None and tag not in self._packing:
            return await self.channel.send(tag, msg)
        return await self._send_in_order(tag, preparing)

    async def _send_in_order(self, tag: int, preparing: Preparing) -> Receipt:
        """Send a message whose packing runs in a copy thread, or one called after such a send
        on its tag, in the order the sends were called (FIFO per tag, whichever packing ends
        first): each enters the channel, which keeps that order from there on, once every
        earlier send on the tag has entered it or given up."""
        ahead = self._packing.get(tag)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._packing[tag] = mine
        try:
            msg = await preparing
            if ahead is not None:
                await asyncio.shield(ahead)
        except BaseException:
            # nothing of ours goes: those behind follow the sends ahead, never overtake them
            if ahead is None or ahead.done():
                self._entered(tag, mine)
            else:
                ahead.add_done_callback(lambda _: self._entered(tag, mine))
            raise
        # those behind wake in a later turn of the loop, after the channel has taken our place
        # on the tag (a channel's send does so before it first awaits)
        self._entered(tag, mine)
        return await self.channel.send(tag, msg)

    def _entered(self, tag: int, mine: asyncio.Future[None]) -> None:
        if not mine.done():
            mine.set_result(None)
        if self._packing.get(tag) is mine:
            del self._packing[tag]  # nothing behind it: sends on the tag go straight in again

    @hide_misspelt
    async def recv(self, *, tag: int | str = 0, out: Any = None, device: Any = None, **_misspelt: Never) -> Any:
        """Receive the next message on ``tag``. With ``out=``, bytes land in the caller's
        tensors (same pytree structure, dtypes and shapes; host or CUDA) and ``out`` is returned.

        ``device=`` ("cpu", "cuda", "cuda:1", 1 or a torch.device) says where the received
        tensors are allocated; by default where the sender's were (CUDA where this process has
        it). CUDA tensors come back safe to use on the caller's current stream.
        """
        if _misspelt:
            refuse_misspelt(Peer.recv, _misspelt)
        wire = tag_id(tag)
        if running_loop() is not self._home:  # (``_recv_own`` written out: a coroutine less per message)
            check_home(self._home, "peer.recv")
        value, _ = await self.channel.recv(wire, out, device)
        return value

    async def _recv_own(self, *, tag: int, out: Any = None, device: Any = None) -> Any:
        """``recv`` on a wire tag as it is (tensorwire's own messages: see ``_send_own``)."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.recv")
        value, _ = await self.channel.recv(tag, out, device)
        return value

    @hide_misspelt
    async def recv_with_receipt(
        self, *, tag: int | str = 0, out: Any = None, device: Any = None, **_misspelt: Never
    ) -> tuple[Any, Receipt]:
        """Like ``recv``, and also say how the message came (protocol, direct or staged, memory, time)."""
        if _misspelt:
            refuse_misspelt(Peer.recv_with_receipt, _misspelt)
        return await self._recv_own_with_receipt(tag=tag_id(tag), out=out, device=device)

    async def _recv_own_with_receipt(self, *, tag: int, out: Any = None, device: Any = None) -> tuple[Any, Receipt]:
        """``recv_with_receipt`` on a wire tag as it is (tensorwire's own: see ``_send_own``)."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.recv_with_receipt")
        return await self.channel.recv(tag, out, device)

    # -- tensor RPC ------------------------------------------------------------------------
    @take_missing
    async def call(
        self, name: str, /, *args: Any, _deadline: float | None = None, _out: Any = None, **kwargs: Any
    ) -> Any:
        """Run the peer's method ``name`` with these arguments and return its result.

        ``_deadline`` (seconds) travels with the call and the server enforces it too
        (DeadlineExceeded). ``_out`` (tensors with the result's structure) receives the result in
        place and is returned. No method may take parameters of those names. Cancelling the
        caller cancels the method. The method's exception comes back as a RemoteError.
        """
        if name is MISSING:
            refuse_misspelt(Peer.call, (), name=name)
        if running_loop() is not self._home:
            check_home(self._home, "peer.call")
        value, _ = await _rpc.call(self, name, args, kwargs, _deadline, _out)
        return value

    @take_missing
    async def call_with_receipt(
        self, name: str, /, *args: Any, _deadline: float | None = None, _out: Any = None, **kwargs: Any
    ) -> tuple[Any, CallReceipt]:
        """Like ``call``, and also say how the call's bytes moved: a ``CallReceipt`` with the
        Receipt of the request (arguments inline in it, or not), of the arguments sent apart
        when they were too large to ride inline, and of the result (direct into ``_out=`` or
        staged), and the call's wall time. A call that fails raises as ``call`` does."""
        if name is MISSING:
            refuse_misspelt(Peer.call_with_receipt, (), name=name)
        if running_loop() is not self._home:
            check_home(self._home, "peer.call_with_receipt")
        value, receipt = await _rpc.call(self, name, args, kwargs, _deadline, _out, want_receipt=True)
        assert receipt is not None
        return value, receipt

    @take_missing
    def stream(self, name: str, /, *args: Any, _deadline: float | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """``async for item in peer.stream("name", ...)``: the items a streaming method yields.
        ``_deadline`` covers the whole stream (no item is handed out past it); leaving the loop
        early cancels the method. There is no ``_out=`` (ConfigurationError)."""
        if name is MISSING:
            refuse_misspelt(Peer.stream, (), name=name)
        if running_loop() is not self._home:
            check_home(self._home, "peer.stream")
        return _OnItsLoop(_rpc.stream(self, name, args, kwargs, _deadline), self._home, "peer.stream")

    @take_missing
    def stream_with_receipts(
        self, name: str, /, *args: Any, _deadline: float | None = None, **kwargs: Any
    ) -> AsyncIterator[tuple[Any, Receipt]]:
        """Like ``stream``, each item as ``(item, Receipt)``: how the message that carried it came."""
        if name is MISSING:
            refuse_misspelt(Peer.stream_with_receipts, (), name=name)
        if running_loop() is not self._home:
            check_home(self._home, "peer.stream_with_receipts")
        items = _rpc.stream(self, name, args, kwargs, _deadline, receipts=True)
        return _OnItsLoop(items, self._home, "peer.stream_with_receipts")

    def _start_heartbeat(self, session_id: str, lease: float, since: float) -> None:
        """``since``: when the handshake was sent, which is before the server's lease began. The
        lease is renewed with those of the node's other sessions with that server (_leases)."""
        assert self.session is not None and self.session.id == session_id
        self._lease, self._confirmed = lease, since
        self._renewals = renewals_for(self.node, self.remote_address, lease)
        self._renewals.add(self)

    def _stop_renewing(self) -> None:
        if self._renewals is not None:
            self._renewals.discard(self)

    async def _renew_once(self, session_id: str, deadline: float) -> None:
        """One lease renewal (we connected); a renewal the server answered proves the session
        alive as of when it was sent. SessionLost fails the channel and raises PeerDisconnected."""
        assert self._control is not None
        assert self.session is not None  # (a peer we connected has its session)
        proof = heartbeat_proof(self.session.secret, session_id)
        sent = time.monotonic()
        try:
            await self._control.heartbeat(session_id, proof, deadline=deadline)
        except SessionLost as exc:
            raise self._session_lost(exc) from exc
        self._confirmed = max(self._confirmed, sent)

    def _session_lost(self, exc: SessionLost) -> PeerDisconnected:
        """The node there no longer knows our session (it restarted, or declared us dead): the
        peer is gone; fail its channel, and return the error to raise."""
        err = PeerDisconnected(str(exc))
        self.channel.fail(err)
        return err

    def _confirm(self) -> None:
        """The other side renewed its lease with us (we accepted its connection)."""
        self._confirmed = time.monotonic()
        self._renewed.set()

    def _lease_fresh(self) -> bool:
        return self._lease is None or time.monotonic() - self._confirmed < self._lease * 0.75

    async def _lease_fence(self) -> None:
        """Before a direct one-sided operation: make sure the other side cannot yet have declared
        this session dead. An owner that did (its lease ran out while we were stalled: SIGSTOP,
        swap, a long pause) may already have unregistered and reused the memory, and a put over
        shared memory (UCX's cma) reaches it all the same. The other side declares us dead no
        sooner than a whole lease after the last proof of life we know of, so we post only
        within three quarters of a lease of it (renewals come every third); past that we renew
        first (we connected) or wait for its next renewal (it connected), and fail the
        operation if the session is gone."""
        if self._lease_fresh():
            return
        lease = self._lease
        assert lease is not None
        if self._renewals is not None and self._control is not None and self.session is not None:
            try:
                await self._renew_once(self.session.id, lease / 3)
            except PeerDisconnected:
                raise
            except TensorWireError as exc:
                raise PeerDisconnected(
                    f"{self.remote_address} did not confirm the session for a one-sided operation: {exc}"
                ) from exc
        else:
            try:
                async with asyncio.timeout(lease / 2):  # its renewals come every third of a lease
                    while not self._lease_fresh():
                        self._renewed.clear()
                        await self._renewed.wait()
            except TimeoutError:
                pass
        self.channel.check_open()
        if not self._lease_fresh():
            raise PeerDisconnected(
                f"{self.remote_address} has not renewed its {lease} s lease for "
                f"{time.monotonic() - self._confirmed:.1f} s: it may have declared this session dead, "
                "so one-sided access to its memory is refused"
            )

    # -- one-sided ---------------------------------------------------------------------------
    @check_arguments
    async def lookup(self, name: str) -> RemoteHandle:
        """Resolve a tensor the peer exposed under ``name`` (HandleNotFound if it has none).

        Over a one-sided transport (ucx) the handle carries the registered memory's key, and
        reads and writes through it move the bytes without the owner's code (``handle.direct``);
        otherwise they go through the owner's node. A handle works on the peer that looked it up:
        on any other (another Peer object, or a peer of the same node_id restarted at that
        address) it is HandleNotFound, so it never reaches memory it was not looked up for.
        """
        if running_loop() is not self._home:
            check_home(self._home, "peer.lookup")
        if not isinstance(name, str):
            raise ConfigurationError(f"lookup takes the name a tensor was exposed under, not {type(name).__name__}")
        check_handle_name(name)
        if self.session is None:
            raise ConfigurationError("this peer has no session to authenticate a lookup")
        if self._closed:  # (and a control connection opened now would never be closed)
            raise ClosedResourceError(f"the peer {self.remote_address} is closed")
        self.channel.check_open()  # its session is gone with the channel: say why, not "refused"
        if self._control is None:
            if not self._control_address:
                raise ControlPlaneError(f"{self.remote_address} did not say where its control plane listens")
            self._control = ControlClient(
                self._control_address, self.node.config.tls, self.node.config.connect_timeout, self._control_name
            )
        try:
            proof = lookup_proof(self.session.secret, name)
            resp = await self._control.lookup(self.session.id, name, proof, deadline=self.node.config.connect_timeout)
        except SessionLost as exc:  # the node there restarted, or declared us dead: so is the peer
            raise self._session_lost(exc) from exc
        except (ClosedResourceError, ControlPlaneError) as exc:
            if isinstance(exc, HandleNotFound) or self._closed:
                raise
            # The channel ended under the call (the peer closed, or its lease ran out) and took
            # the control connection with it, or the node there cancelled the call as it closed:
            # the peer went away, as every pending operation says, not "closed by this side".
            self.channel.check_open()
            if isinstance(exc, NodeClosing):
                # that node closed its peers before its control plane stopped: this channel has
                # not read its close yet (it fails on its own once it does; failing it here could
                # drop messages still on their way)
                raise PeerDisconnected(f"{self.remote_address} went away during the lookup: {exc}") from exc
            if type(exc) is ControlPlaneError and await nothing_listens(self._control_address, 1.0):
                # nothing listens where its control plane did: its node is gone (a process
                # killed, whose channel has not noticed yet: over ucx only the lease tells)
                raise PeerDisconnected(
                    f"{self.remote_address} went away: nothing listens at its control plane "
                    f"({self._control_address}) any more"
                ) from exc
            raise
        handle = RemoteHandle(
            resp.name,
            resp.dtype,
            tuple(resp.shape),
            resp.nbytes,
            resp.generation,
            self.remote_node,
            resp.transport,
            resp.remote_key,
            resp.writable,
            memory=resp.memory or "host",
            session=self.session.id,
        )
        if handle.direct:
            _onesided.remember(self, handle)
        return handle

    @hide_misspelt
    async def read(self, handle: RemoteHandle, *, out: Any = None, device: Any = None, **_misspelt: Never) -> Any:
        """Read a peer's exposed tensor, or the rows a handle names (``handle[4:8]``), into
        ``out``: a host or CUDA tensor of the handle's dtype and shape (else ShapeMismatchError),
        ready for use on the stream current at the call. Without ``out`` it is allocated on
        ``device`` ("cpu", "cuda:N", as recv), by default where the owner's tensor lives
        (``handle.memory``) if this process can hold it there. HandleNotFound once revoked."""
        if _misspelt or handle is MISSING:
            refuse_misspelt(Peer.read, _misspelt, handle=handle)
        if running_loop() is not self._home:
            check_home(self._home, "peer.read")
        value, _ = await _onesided.read(self, handle, out, device=device, want_receipt=False)
        return value

    @hide_misspelt
    async def read_with_receipt(
        self, handle: RemoteHandle, *, out: Any = None, device: Any = None, **_misspelt: Never
    ) -> tuple[Any, Receipt]:
        """Like ``read``, and also say how the bytes came ("one-sided", "one-sided-emulated" where
        the transport emulates get/put and the owner's progress serves it, or "owner-assisted")."""
        if _misspelt or handle is MISSING:
            refuse_misspelt(Peer.read_with_receipt, _misspelt, handle=handle)
        if running_loop() is not self._home:
            check_home(self._home, "peer.read_with_receipt")
        value, receipt = await _onesided.read(self, handle, out, device=device)
        assert receipt is not None
        return value, receipt

    @hide_misspelt
    async def write(self, handle: RemoteHandle, src: Any, **_misspelt: Never) -> Receipt:
        """Overwrite a peer's exposed tensor, or the rows a handle names, with ``src`` (a host or
        CUDA tensor of the handle's dtype and shape; a CUDA one is read after the work queued on
        its stream before the call). Returns once the bytes are in the owner's memory. A
        cancelled write may leave the target partly written."""
        if _misspelt or handle is MISSING or src is MISSING:
            refuse_misspelt(Peer.write, _misspelt, handle=handle, src=src)
        if running_loop() is not self._home:
            check_home(self._home, "peer.write")
        return await _onesided.write(self, handle, src)

    @check_arguments
    async def read_many(
        self, handles: Sequence[RemoteHandle], *, outs: Sequence[Any] | None = None, device: Any = None
    ) -> list[Any]:
        """Read many handles of this peer (rows of one tensor, or of several) as one batch:
        each into its ``outs`` entry (allocated where None). One-sided, the gets are posted at
        once and waited for together; through the owner, one request answers up to 256 of them.
        Everything is checked before anything moves. Returns the tensors in order."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.read_many")
        values, _ = await _onesided.read_many(
            self,
            _listed("handles", handles),
            None if outs is None else _listed("outs", outs),
            device=device,
            want_receipt=False,
        )
        return values

    @check_arguments
    async def read_many_with_receipt(
        self, handles: Sequence[RemoteHandle], *, outs: Sequence[Any] | None = None, device: Any = None
    ) -> tuple[list[Any], Receipt]:
        """Like ``read_many``; the receipt counts the bytes of all of them."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.read_many_with_receipt")
        values, receipt = await _onesided.read_many(
            self, _listed("handles", handles), None if outs is None else _listed("outs", outs), device=device
        )
        assert receipt is not None
        return values, receipt

    @check_arguments
    async def write_many(self, handles: Sequence[RemoteHandle], srcs: Sequence[Any]) -> Receipt:
        """Write ``srcs[i]`` into ``handles[i]`` for all of them as one batch (puts then one
        flush, one-sided); returns once every byte is in the owner's memory."""
        if running_loop() is not self._home:
            check_home(self._home, "peer.write_many")
        return await _onesided.write_many(self, _listed("handles", handles), _listed("srcs", srcs))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Close the data channel and the control connection; idempotent. The other node hears
        of it on the control plane too (``Leave``, beside the channel's close, given up after
        ``goodbye_seconds``), so its one-sided operations under way end at once where the close
        on the data connection may be held up; not again where this peer's node said it for all
        its peers as it closes. The closing runs to its end even if the caller is cancelled
        meanwhile, and every call waits for it. A closing that was itself cancelled part way
        runs again at the next call (each of its steps may run twice): ``asyncio.run`` ending
        cancels every task, a peer's closing under way too, and then the node's close calls
        this for the peers it still has (before, that call, and every later one, raised the
        closing's CancelledError, and the peer was left to its transport's close). Once that
        loop has closed, nothing can run there any more."""
        check_home(self._home, "peer.aclose", closing=True)
        if closed_by_hand(self._home, self._closing):
            self._closed = True
            return
        while True:
            if self._closing is None or (self._closing.cancelled() and not self._closing.get_loop().is_closed()):
                self._closed = True
                self._stop_renewing()
                for task in list(self._tasks):
                    task.cancel()
                self._closing = asyncio.get_running_loop().create_task(
                    self._close(), name=f"tensorwire-peer-close {self.remote_address}"
                )
            closing = self._closing
            if closing.cancelled():  # (its loop is closed)
                return
            try:
                await asyncio.shield(closing)
                return
            except asyncio.CancelledError:
                if not closing.cancelled() or _cancelling():
                    raise  # the caller is cancelled

    async def _close(self) -> None:
        # tell the other node (Leave) while the channel closes: its one-sided operations, and
        # its sends waiting on us, end at once where this close would sit behind more than the
        # socket buffers. Planned before the channel closes (then the peer is closed, and its
        # control connection winding down), made beside it: this side's operations end at the
        # call, as they did, not a control round trip later. None where this node's close
        # told already, for all its peers, or a close before this one (cancelled) planned it
        calls = plan_goodbye([self])
        if calls:
            self._goodbye = asyncio.ensure_future(send_goodbye(self.node, calls))
        try:
            await self.channel.aclose()
        finally:
            await self._close_control(self._control)
            self.node._forget(self, closed=True)

    async def _close_control(self, control: ControlClient | None) -> None:
        """Close ``control`` once the goodbyes under way, which may be calling over it, are
        answered or given up (``send_goodbye``: ``goodbye_seconds`` each call): this peer's own
        (``_close``), and its node's as the node closes (``Node._close``: it calls over one of
        its peers' connections for all the sessions with that node)."""
        goodbyes = [g for g in (self._goodbye, self.node._goodbye) if g is not None]
        if goodbyes:
            await asyncio.wait(goodbyes)  # (never raises)
        if control is not None:
            await control.aclose()

    def _wind_down(self) -> asyncio.Task[None] | None:
        """The channel closed: stop renewing the lease and close the control connection, after
        the goodbye this peer's close is saying over it, if any (a later ``aclose`` still closes
        the rest). Returns the closing task, if any."""
        self._stop_renewing()
        if self._control is None:
            return None
        return asyncio.get_running_loop().create_task(self._close_control(self._control))

    def abort(self) -> None:
        """Drop the connection at once; pending operations fail. Safe from any thread: called
        where the peer's loop is not running, it drops the connection on that loop's next turn.
        No goodbye on the control plane (``aclose`` says one): nothing here waits for the
        network, so the other node may learn of it from its lease."""
        if elsewhere(self.node._loop, self.abort):
            return
        self.channel.abort()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
