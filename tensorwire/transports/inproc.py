"""In-process transport: peers in the same process, no serialization, one copy per tensor.

The header is not encoded: the receiver gets the sender's tree and specs as objects (only a
message whose header may be past the peer's ``max_header_bytes`` has it encoded, to measure it
and refuse it as every transport does). The payload is copied once (the sender may reuse its
tensor as soon as send returns), in chunks that yield to the event loop so that a large copy
never stalls it. Credit and rendezvous work as on every other transport, so the conformance
suite holds here too: sends hand their messages over in the order they were entered (the user's
in one line, tensorwire's own in another, so that a user's send waiting for a slot holds up no
request or reply of tensorwire's; see ``_credit``), and a channel closing or failing ends both
sides at once, as a shut connection would.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
import uuid
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..errors import ClosedResourceError, ConnectError, PeerDisconnected, ProtocolError, TransferError
from ..tensors import Outgoing
from ._base import Capabilities, Channel, ChannelState, Receipt, Session, Transport, TransportContext, fresh
from ._credit import own_slots, own_tag
from ._frames import PeerLimits
from ._mailbox import Arrival, SenderAborted, _settle
from ._order import SendOrder

__all__ = ["InprocChannel", "InprocTransport"]

# A copy gives the loop a turn after this many bytes, or after this long, whichever comes first:
# a recv into memory not yet touched pays a page fault per 4 KiB, and in a VM 4 MiB of those
# took 90-150 ms (a 1 GiB recv without out= held the loop that long at every chunk). It copies in
# pieces of _PIECE so that the clock is read often enough (at that rate a piece takes 10-20 ms;
# into warm memory, 0.1 ms, and the pieces cost 1-2% of a large copy's time).
_CHUNK = 4 << 20
_PIECE = 512 << 10
_YIELD_SECONDS = 0.005
_REPOST_AFTER = 64 * 1024
_LISTENERS: weakref.WeakValueDictionary[str, InprocTransport] = weakref.WeakValueDictionary()


class _Source:
    """A rendezvous payload still in the sender's memory."""

    __slots__ = ("aborted", "arrival", "aside", "done", "segs")

    def __init__(self, segs: list[memoryview], arrival: Arrival) -> None:
        self.segs = segs
        self.arrival = arrival  # (its header, in the receiver's mailbox)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.aborted = False
        self.aside = 0  # the bytes its copy copied aside first (``_copy``)


async def _copy(segs: list[memoryview], arrival: Arrival, source: _Source | None = None) -> int:
    """Copy the sender's bytes into the arrival's current destination, yielding to the loop every
    ``_CHUNK`` bytes or ``_YIELD_SECONDS``. Stops once the arrival is done before its copy is: it
    failed (a channel closed or failed under it; the recv has returned, and its out= is the
    caller's again) or its sender gave up. Returns how many bytes it copied aside first
    (``_apart``): they land from that copy of ours, and neither end's receipt says direct."""
    aside = 0
    if arrival.direct:  # (only the caller's out= can be memory being sent: the rest is ours)
        apart = _apart(segs, arrival.dest)
        aside = sum(len(new) for new, old in zip(apart, segs, strict=True) if new is not old)
        arrival.count_copied(aside)
        segs = apart
    pos = 0
    unyielded = 0
    turn = time.perf_counter()
    for seg in segs:
        off = 0
        while off < len(seg):
            if arrival.done.done() or (source is not None and source.aborted):
                return aside
            # (within the segment: a payload dropped to scratch lands in pieces that span segments)
            dst = arrival.view(pos + off, min(_PIECE, len(seg) - off))
            dst[:] = seg[off : off + len(dst)]
            off += len(dst)
            unyielded += len(dst)
            arrival.written = pos + off
            arrival.mark(pos + off)
            if arrival.written < arrival.nbytes and (
                unyielded >= _CHUNK or time.perf_counter() - turn >= _YIELD_SECONDS
            ):
                await asyncio.sleep(0)
                unyielded = 0
                turn = time.perf_counter()
        pos += len(seg)
    return aside


def _apart(segs: list[memoryview], dest: Sequence[object] | None) -> list[memoryview]:
    """``segs``, each one whose bytes a host tensor of ``dest`` shares replaced by a copy. In
    one process a recv's out= may be memory that is being sent to it (``recv(out=[y, x])`` of
    ``send([x, y])``, ``out=buf[1:]`` of ``buf[:-1]``): copied piece by piece, tensor by
    tensor, later bytes would be read after earlier ones had overwritten them. ``dest`` is that
    out= (``Arrival.direct``), whose tensors share no memory with each other (out= is checked),
    so each segment is looked up among them by address."""
    if not dest:
        return segs
    spans = sorted((a.__array_interface__["data"][0], a.nbytes) for a in dest if type(a) is np.ndarray and a.nbytes)
    if not spans:
        return segs
    starts = [start for start, _ in spans]
    out = segs
    for i, seg in enumerate(segs):
        low = np.frombuffer(seg, np.uint8).__array_interface__["data"][0]
        k = bisect_left(starts, low + len(seg)) - 1  # the last destination starting before seg ends
        if k >= 0 and starts[k] + spans[k][1] > low:
            if out is segs:
                out = list(segs)
            out[i] = memoryview(bytes(seg))
    return out


def _failure(fut: asyncio.Future[None]) -> BaseException | None:
    """What ``fut`` failed with; None while it is pending or if it succeeded."""
    return fut.exception() if fut.done() else None


# the keys of an inproc channel's SendOrder: its sends are ordered across tags, the user's in one
# line and tensorwire's own in the other (which may take the slots kept for them, see _credit)
_USER_LINE = 0
_OWN_LINE = 1

# At most the bytes a tensor's spec takes in an encoded header beyond its strings and dims (tags
# and length varints of the spec and its six fields, nbytes), and each dim (shape and strides).
_SPEC_BYTES = 7 * 11
_DIM_BYTES = 2 * 10


def _header_len(msg: Outgoing, limit: int) -> int:
    """The length of ``msg``'s header as a wire would carry it, or 0 when it surely fits in
    ``limit`` bytes: a bound taken from its tree and specs spares encoding the header of any
    message that is not near the limit."""
    bound = 11 + msg.tree.ByteSize()
    for s in msg.specs:
        if bound > limit:
            break
        bound += _SPEC_BYTES + len(s.dtype) + len(s.device) + len(s.framework) + _DIM_BYTES * len(s.shape)
    return len(msg.header) if bound > limit else 0


class InprocChannel(Channel):
    transport = "inproc"
    lanes = ("in-process copy",)

    def __init__(self, transport: InprocTransport) -> None:
        super().__init__()
        self._promise = PeerLimits.of(transport.ctx)  # what its peer may send it
        self._remote = self._promise  # what its peer accepts (set by _link)
        self.peer: InprocChannel | None = None
        self._send_credit = 0
        self._send_slots = 0  # free at the peer, counted here: the peer's release gives them back
        self._kept_slots = 0  # the last free ones: tensorwire's own messages only
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._sources: dict[int, _Source] = {}
        self._next_id = 1
        self._sending = 0
        self._pulls: set[asyncio.Task[None]] = set()
        # sends hand their messages over in the order they were entered, all tags in one line
        self._order = SendOrder()

    def __repr__(self) -> str:
        return f"<InprocChannel {self.state.value} in_flight={self.in_flight}>"

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight + self._sending

    def _link(self, other: InprocChannel) -> None:
        self.peer = other
        self._remote = other._promise
        self._send_credit = self._remote.recv_buffer_bytes
        self._kept_slots = own_slots(self._remote.max_unexpected)
        self._send_slots = self._remote.max_unexpected + self._kept_slots

    def _other(self) -> InprocChannel:
        self._check_going()  # (after the peer's goodbye too: its node would drop the message)
        assert self.peer is not None
        if self.peer.state is not ChannelState.OPEN:
            raise PeerDisconnected("in-process peer closed its channel")
        return self.peer

    async def send(self, tag: int, msg: Outgoing) -> Receipt:
        t0 = time.perf_counter()
        self._other()
        self._remote.check_send(msg.nbytes, _header_len(msg, self._remote.max_header_bytes))
        # Sends hand their messages to the peer's mailbox in the order they were entered, as
        # frames go out on a stream (FIFO per tag): each waits for the send entered before it
        # to hand its message over, however long that one's staging, yields or slot wait last.
        own = own_tag(tag)
        turn = self._order.enter(_OWN_LINE if own else _USER_LINE)
        self._sending += 1
        try:
            try:
                await self.stage_device(msg)  # no device lanes here: through host memory
                await turn.wait()
                if msg.nbytes >= _REPOST_AFTER:
                    # let a receiver that just got our last message post its next recv, so that
                    # back-to-back large messages land in its out= (not in a buffer of ours, then
                    # copied); inside our turn, so no send entered after ours goes first meanwhile
                    for _ in range(3):
                        await asyncio.sleep(0)
                while self._send_slots <= (0 if own else self._kept_slots):
                    self._check_going()
                    fut = asyncio.get_running_loop().create_future()
                    self._slot_waiters.append(fut)
                    await fut
                peer = self._other()
                self._send_slots -= 1
                eager = msg.nbytes <= self._send_credit
                if eager:
                    self._send_credit -= msg.nbytes
                msg_id = self._next_id
                self._next_id += 1
                arrival = Arrival(
                    peer,
                    tag,
                    msg.tree,
                    msg.specs,
                    msg_id=msg_id,
                    rendezvous=not eager,
                    protocol="eager" if eager else "rendezvous",
                )
                arrival.landed = 0  # _copy lands the payload in order, and marks it as it goes
                segs = msg.segments()
                source = None if eager else _Source(segs, arrival)
                if source is not None:
                    peer._sources[msg_id] = source
                peer.mailbox.arrive(arrival)
            finally:
                turn.passed()
            try:
                if eager:
                    if arrival.dest is None:
                        try:
                            arrival.allocate()
                        except TransferError as exc:
                            # the receiver has no memory to keep it: not delivered, and this
                            # sender, which still holds the message, is told so
                            peer.mailbox.abort(arrival)
                            peer.release(arrival)
                            raise TransferError(
                                f"the in-process receiver could not keep the message, nothing was delivered: {exc}"
                            ) from exc
                    aside = await _copy(segs, arrival)
                    failure = _failure(arrival.done)
                    if failure is not None:
                        # a channel closed or failed under the copy, which stopped: the message
                        # was not delivered (the recv has failed), so neither is the send
                        self.check_open()  # our own side closed or broke: that
                        raise PeerDisconnected("in-process peer closed its channel") from failure
                    arrival.complete()
                else:
                    assert source is not None
                    await asyncio.shield(source.done)
                    aside = source.aside
            except asyncio.CancelledError:
                if source is not None:
                    source.aborted = True
                    peer._sources.pop(msg_id, None)
                if not arrival.done.done():
                    peer.mailbox.abort(arrival)
                    peer.release(arrival)
                raise
        finally:
            self._sending -= 1
        return self._send_receipt(msg, arrival.protocol, t0, tag, copied=2 * aside > msg.nbytes)

    async def pull(self, arrival: Arrival) -> None:
        # the source stays in our sources until its copy has ended, so that a channel closing
        # first, even before the copy's task has run, fails its send there (it waited for good)
        source = self._sources.get(arrival.msg_id)
        if source is None or source.aborted:  # the sender gave up first: the recv waits for the next
            raise SenderAborted("sender cancelled the message before it was pulled")
        # The copy runs as a task of its own, like a transfer on a wire: a recv cancelled part way
        # leaves the message requeued (pulling) and the copy goes on into the arrival's current
        # destination, so the next recv of the tag gets it and the sender's send returns.
        task = asyncio.get_running_loop().create_task(self._pull(source, arrival))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        if not arrival.done.done():
            await arrival.completed()  # (woken by complete/fail: a loop turn sooner than a shield)
        arrival.done.result()

    def unread(self, arrival: Arrival) -> bool:
        # a rendezvous message matched but not pulled: its bytes are still the sender's, and
        # nothing copies them (into any dest) before a recv pulls it (``pull`` starts the copy)
        return arrival.rendezvous and not arrival.pulling and self._sources.get(arrival.msg_id) is not None

    async def _pull(self, source: _Source, arrival: Arrival) -> None:
        try:
            source.aside = await _copy(source.segs, arrival, source)
        except BaseException as exc:
            # cancelled because the channel closed: the recv reports the closing, as elsewhere
            failure = self.mailbox.failure
            why = fresh(failure) if failure is not None else TransferError(f"in-process copy failed: {exc!r}")
            arrival.fail(why)
            _settle(source.done, PeerDisconnected("in-process peer closed its channel"))
            raise
        finally:
            self._sources.pop(arrival.msg_id, None)
        if source.aborted:
            arrival.fail(SenderAborted("sender cancelled the message while it was being pulled"))
            return
        arrival.complete()
        if not source.done.done():
            source.done.set_result(None)

    def release(self, arrival: Arrival) -> None:
        sender = self.peer
        if sender is None:
            return
        sender._send_slots += 1
        if not arrival.rendezvous:
            sender._send_credit += arrival.nbytes
        while sender._slot_waiters:
            f = sender._slot_waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _ending(self, exc: BaseException) -> None:
        """The peer said goodbye (``Channel._ending``): the sends waiting on it fail with ``exc``,
        as over tcp and ucx: for a message slot, or for their rendezvous message's pull (which
        would never come, or copy into a node that drops it), those messages withdrawn from the
        peer's mailbox; sends that begin later raise it (``_other``). A payload the peer is
        pulling already lands, and its send returns."""
        super()._ending(exc)
        if self.state is not ChannelState.OPEN:  # (our own close fails them with its own error)
            return
        for f in self._slot_waiters:
            _settle(f, fresh(exc))
        self._slot_waiters.clear()
        peer = self.peer
        if peer is None:
            return
        for msg_id, src in list(peer._sources.items()):  # (ours: the messages we sent it)
            if src.arrival.pulling or src.aborted:
                continue
            src.aborted = True
            del peer._sources[msg_id]
            if not src.arrival.done.done():
                peer.mailbox.abort(src.arrival)
                peer.release(src.arrival)
            _settle(src.done, fresh(exc))

    def _fail(self, state: ChannelState, exc: BaseException) -> None:
        self._closed(state, exc)
        self._order.fail(exc)
        for f in self._slot_waiters:
            _settle(f, fresh(exc))  # (each a copy of its own: see ``fresh``)
        self._slot_waiters.clear()
        for src in self._sources.values():
            _settle(src.done, PeerDisconnected("in-process peer closed its channel"))
        self._sources.clear()
        for task in self._pulls:
            task.cancel()

    def _shut(self, state: ChannelState, exc: BaseException, told: PeerDisconnected, theirs: ChannelState) -> None:
        """Close or break our side with ``exc``, then the peer's as a wire would: our own
        rendezvous sends waiting in the peer's sources fail with ``exc`` too (first, so that
        they say what happened here), and the peer's pending work fails with ``told``, its
        channel left in state ``theirs``."""
        if self.state is not ChannelState.OPEN:
            return
        self._fail(state, exc)
        peer = self.peer
        if peer is None:
            return
        for src in peer._sources.values():
            _settle(src.done, fresh(exc))
        if peer.state is ChannelState.OPEN:
            peer._fail(theirs, told)

    async def aclose(self) -> None:
        # the peer's channel is closed, not broken, as tcp's and ucx's are by their goodbye
        # (it was broken, as if this side had died)
        self._shut(
            ChannelState.CLOSED,
            ClosedResourceError("channel closed"),
            PeerDisconnected("in-process peer closed its channel"),
            ChannelState.CLOSED,
        )

    def fail(self, exc: BaseException) -> None:
        # a lost lease or session: both ends fail now, as a shut socket fails both on tcp,
        # rather than the peer's work hanging until its own lease of us runs out
        told = PeerDisconnected(f"in-process peer's channel failed: {exc}")
        self._shut(ChannelState.BROKEN, exc, told, ChannelState.BROKEN)

    def abort(self) -> None:
        # forceful, with no goodbye: the peer's channel breaks, as tcp's does when the
        # connection drops
        self._shut(
            ChannelState.CLOSED,
            ClosedResourceError("channel aborted"),
            PeerDisconnected("in-process peer aborted its channel"),
            ChannelState.BROKEN,
        )


class InprocTransport(Transport):
    name = "inproc"
    checks_payloads = True  # nothing crosses a wire

    @classmethod
    def probe(cls) -> Capabilities | None:
        return Capabilities(memory_kinds=("host",), lanes=("in-process copy",))

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        super().__init__(ctx, capabilities)
        self._token = f"{os.getpid()}/{uuid.uuid4().hex}"
        self._channels: set[InprocChannel] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # its node's (``listen``)

    async def listen(self) -> bytes:
        self._loop = asyncio.get_running_loop()
        _LISTENERS[self._token] = self
        return self._token.encode()

    def accepts(self, address: bytes) -> str | None:
        token = address.decode("utf-8", "replace")
        if token.split("/", 1)[0] != str(os.getpid()):
            return "peer is in another process"
        listener = _LISTENERS.get(token)
        if listener is None:
            return "peer's in-process listener is closed"
        if listener._loop is not self._loop:
            # both ends of a channel run on one loop: its futures and mailboxes are that loop's
            return "peer's node runs on another event loop of this process"
        return None

    async def connect(self, address: bytes, session: Session) -> Channel:
        server = _LISTENERS.get(address.decode("utf-8", "replace"))
        if server is None:
            raise ConnectError("in-process peer is not listening (another process, or closed)")
        if server._loop is not asyncio.get_running_loop():
            raise ConnectError("in-process peer's node runs on another event loop of this process")
        try:
            _, fut = server.sessions.admit(session.id, lambda s: hmac.compare_digest(s.secret, session.secret))
        except ProtocolError as exc:
            raise ConnectError(f"in-process peer rejected the session: {exc}") from None
        mine, theirs = InprocChannel(self), InprocChannel(server)
        mine._link(theirs)
        theirs._link(mine)
        self._track(mine)
        server._track(theirs)
        fut.set_result(theirs)
        return mine

    def _track(self, channel: InprocChannel) -> None:
        """Hold ``channel`` until it closes (or this transport does), no longer: a closed
        channel and the messages it never delivered are let go with its peer."""
        self._channels.add(channel)
        channel.add_close_callback(lambda _exc: self._channels.discard(channel))

    async def aclose(self) -> None:
        _LISTENERS.pop(self._token, None)
        self.sessions.cancel_all()
        for ch in list(self._channels):
            await ch.aclose()
        self._channels.clear()
