"""In-process transport: peers in the same process, no serialization, one copy per tensor.

The header is never encoded: the receiver gets the sender's tree and specs as objects. The
payload is copied once (the sender may reuse its tensor as soon as send returns), in chunks
that yield to the event loop so that a large copy never stalls it. Credit and rendezvous work
as on every other transport, so the conformance suite holds here too.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
import uuid
import weakref
from collections import deque

from ..errors import ClosedResourceError, ConnectError, PeerDisconnected, ProtocolError, TransferError
from ..tensors import Outgoing
from ._base import Capabilities, Channel, ChannelState, Receipt, Session, Transport, TransportContext
from ._frames import PeerLimits
from ._mailbox import Arrival, SenderAborted, _settle

__all__ = ["InprocChannel", "InprocTransport"]

_CHUNK = 4 << 20
_REPOST_AFTER = 64 * 1024
_LISTENERS: weakref.WeakValueDictionary[str, InprocTransport] = weakref.WeakValueDictionary()


class _Source:
    """A rendezvous payload still in the sender's memory."""

    __slots__ = ("aborted", "done", "segs")

    def __init__(self, segs: list[memoryview]) -> None:
        self.segs = segs
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.aborted = False


async def _copy(segs: list[memoryview], arrival: Arrival, source: _Source | None = None) -> None:
    """Copy the sender's bytes into the arrival's current destination, yielding between chunks."""
    pos = 0
    for seg in segs:
        off = 0
        while off < len(seg):
            if source is not None and source.aborted:
                return
            dst = arrival.view(pos + off, _CHUNK)
            dst[:] = seg[off : off + len(dst)]
            off += len(dst)
            arrival.written = pos + off
            if arrival.written < arrival.nbytes:
                await asyncio.sleep(0)
        pos += len(seg)


class InprocChannel(Channel):
    transport = "inproc"
    lanes = ("in-process copy",)

    def __init__(self, transport: InprocTransport) -> None:
        super().__init__()
        self._promise = PeerLimits.of(transport.ctx)  # what its peer may send it
        self._remote = self._promise  # what its peer accepts (set by _link)
        self.peer: InprocChannel | None = None
        self._send_credit = 0
        self._send_slots = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._sources: dict[int, _Source] = {}
        self._next_id = 1
        self._sending = 0
        self._pulls: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<InprocChannel {self.state.value} in_flight={self.in_flight}>"

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight + self._sending

    def _link(self, other: InprocChannel) -> None:
        self.peer = other
        self._remote = other._promise
        self._send_credit = self._remote.recv_buffer_bytes
        self._send_slots = self._remote.max_unexpected

    def _other(self) -> InprocChannel:
        self.check_open()
        assert self.peer is not None
        if self.peer.state is not ChannelState.OPEN:
            raise PeerDisconnected("in-process peer closed its channel")
        return self.peer

    async def send(self, tag: int, msg: Outgoing) -> Receipt:
        t0 = time.perf_counter()
        peer = self._other()
        self._remote.check_send(msg.nbytes, 0)  # no header limit: headers are never encoded here
        await self.stage_device(msg)  # no device lanes here: through host memory
        self._sending += 1
        try:
            if msg.nbytes >= _REPOST_AFTER:
                for _ in range(3):  # let a receiver that just got our last message post its next recv
                    await asyncio.sleep(0)
                peer = self._other()
            while self._send_slots <= 0:
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
            segs = msg.segments()
            source = None if eager else _Source(segs)
            if source is not None:
                peer._sources[msg_id] = source
            peer.mailbox.arrive(arrival)
            try:
                if eager:
                    if arrival.dest is None:
                        arrival.allocate()
                    await _copy(segs, arrival)
                    arrival.complete()
                else:
                    assert source is not None
                    await asyncio.shield(source.done)
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
        return self._send_receipt(msg, arrival.protocol, t0)

    async def pull(self, arrival: Arrival) -> None:
        source = self._sources.pop(arrival.msg_id, None)
        if source is None or source.aborted:  # the sender gave up first: the recv waits for the next
            raise SenderAborted("sender cancelled the message before it was pulled")
        # The copy runs as a task of its own, like a transfer on a wire: a recv cancelled part way
        # leaves the message requeued (pulling) and the copy goes on into the arrival's current
        # destination, so the next recv of the tag gets it and the sender's send returns.
        task = asyncio.get_running_loop().create_task(self._pull(source, arrival))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        await asyncio.shield(arrival.done)

    async def _pull(self, source: _Source, arrival: Arrival) -> None:
        try:
            await _copy(source.segs, arrival, source)
        except BaseException as exc:
            # cancelled because the channel closed: the recv reports the closing, as elsewhere
            why = self.mailbox.failure or TransferError(f"in-process copy failed: {exc!r}")
            arrival.fail(why)
            _settle(source.done, PeerDisconnected("in-process peer closed its channel"))
            raise
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

    def _fail(self, state: ChannelState, exc: BaseException) -> None:
        self._closed(state, exc)
        for f in self._slot_waiters:
            if not f.done():
                f.set_exception(exc)
                f.exception()
        self._slot_waiters.clear()
        for src in self._sources.values():
            if not src.done.done():
                src.done.set_exception(PeerDisconnected("in-process peer closed its channel"))
                src.done.exception()
        self._sources.clear()
        for task in self._pulls:
            task.cancel()

    async def aclose(self) -> None:
        self.abort()

    def fail(self, exc: BaseException) -> None:
        if self.state is ChannelState.OPEN:
            self._fail(ChannelState.BROKEN, exc)

    def abort(self) -> None:
        if self.state is not ChannelState.OPEN:
            return
        closed = ClosedResourceError("channel closed")
        self._fail(ChannelState.CLOSED, closed)
        if self.peer is not None:  # our own rendezvous sends wait in the peer's sources: we closed
            for src in self.peer._sources.values():
                if not src.done.done():
                    src.done.set_exception(closed)
                    src.done.exception()
        if self.peer is not None and self.peer.state is ChannelState.OPEN:
            self.peer._fail(ChannelState.BROKEN, PeerDisconnected("in-process peer closed its channel"))


class InprocTransport(Transport):
    name = "inproc"

    @classmethod
    def probe(cls) -> Capabilities | None:
        return Capabilities(memory_kinds=("host",), lanes=("in-process copy",))

    def __init__(self, ctx: TransportContext, capabilities: Capabilities) -> None:
        super().__init__(ctx, capabilities)
        self._token = f"{os.getpid()}/{uuid.uuid4().hex}"
        self._channels: set[InprocChannel] = set()

    async def listen(self) -> bytes:
        _LISTENERS[self._token] = self
        return self._token.encode()

    def accepts(self, address: bytes) -> str | None:
        token = address.decode("utf-8", "replace")
        if token.split("/", 1)[0] != str(os.getpid()):
            return "peer is in another process"
        if token not in _LISTENERS:
            return "peer's in-process listener is closed"
        return None

    async def connect(self, address: bytes, session: Session) -> Channel:
        server = _LISTENERS.get(address.decode("utf-8", "replace"))
        if server is None:
            raise ConnectError("in-process peer is not listening (another process, or closed)")
        try:
            _, fut = server.sessions.admit(session.id, lambda s: hmac.compare_digest(s.secret, session.secret))
        except ProtocolError as exc:
            raise ConnectError(f"in-process peer rejected the session: {exc}") from None
        mine, theirs = InprocChannel(self), InprocChannel(server)
        mine._link(theirs)
        theirs._link(mine)
        self._channels.add(mine)
        server._channels.add(theirs)
        fut.set_result(theirs)
        return mine

    async def aclose(self) -> None:
        _LISTENERS.pop(self._token, None)
        self.sessions.cancel_all()
        for ch in list(self._channels):
            await ch.aclose()
        self._channels.clear()
