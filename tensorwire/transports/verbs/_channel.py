"""The verbs channel: tagged messages over one RC queue pair, one-sided reads and writes by rkey.

Two-sided messages. A message header (and a payload of at most ``inline_bytes``) travels as
SEND frames into the peer's ring of pre-posted, registered receive buffers (``_wire.py``). A
larger payload stays where it is: the sender registers it (through the registration cache, so
the same tensor is registered once) and sends segment descriptors; the receiver moves it with
RDMA READ straight into the recv's ``out=`` (registered once and cached too), or, when no recv
is waiting for an eager message, into a buffer of its own; then it sends FIN and the sender's
``send`` returns. A message within the receiver's buffer credit is read at once (*eager*); one
beyond it waits until a recv is posted (*rendezvous*).

Two kinds of credit keep both sides in bounds. The mailbox's (``_credit.py``): buffer bytes and
message slots per peer, as on every transport. The ring's: a frame may only be sent into a ring
slot the peer has posted again, which the peer reports as its count of frames processed,
carried on every frame; a few slots are kept for CREDIT frames alone, so reports always get
through and nothing ever meets RNR (``rnr_retry`` is infinite as a backstop, not a mechanism).
CREDIT frames are reported too, lazily, so that neither side starves nor do they trade them
for ever (``_on_frame``, docs/verbs.md).

Cancellation: a recv cancelled while RDMA READs write into its ``out=`` lets them finish first
(then the message is requeued whole); one cancelled before any was posted (its memory being
faulted in) gives the message back unread at once (``take_back``); a send cancelled before its
MSG frame left is withdrawn; one cancelled later sends ABORT and waits for the receiver's FIN:
dropped, or read whole. The peer's goodbye (``_ending``) ends the sends waiting on it the same
way: one waiting for a slot fails, one whose MSG frame has not left is withdrawn, one whose MSG
left is asked back (ABORT) and fails once the peer dropped it, or returns if the peer had read
it whole.

Completion errors become tensorwire errors: retries exhausted (the peer's port or host is gone)
-> PeerDisconnected, anything else -> TransferError; either breaks the channel (an RC queue
pair in the error state is done). The bootstrap TCP connection stays open as a liveness signal:
its end breaks the channel at once, failing every pending operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import (
    BrokenResourceError,
    ClosedResourceError,
    MessageRefused,
    PeerDisconnected,
    ProtocolError,
    TensorWireError,
    TransferError,
)
from ...tensors import Outgoing, decode_header
from .._base import BYE_GRACE, Channel, ChannelState, Limits, Receipt, fresh
from .._credit import FLUSH_DELAY, ReceiveBudget, SendWindow, fail_waiting_sends
from .._frames import PeerLimits
from .._mailbox import Arrival
from .._order import SendOrder, Turn
from ._memory import FAULT_IN_BYTES, MemoryCache, Region, fault_in
from ._queue import WC_FLUSH, WC_RETRY_EXC, WC_RNR_RETRY_EXC, QueuePair, wc_status_name
from ._verbs import pv
from ._wire import FRAME, SEG, Flag, Kind, check_flags, kind_of

log = logging.getLogger(__name__)

__all__ = ["RemoteKey", "VerbsChannel"]

RESERVE = 4  # ring slots only CREDIT and BYE frames may use
_SEND_BIT = 1 << 62
_RDMA_BIT = 1 << 61
_U32 = (1 << 32) - 1
_MAX_SEGS = 65535


def _host(a: object) -> np.ndarray:
    """A payload array in host memory (``send`` stages device tensors first: ``stage_device``)."""
    if not isinstance(a, np.ndarray):
        raise TransferError(f"the verbs channel moves host memory, not {type(a).__name__}")
    return a


class RemoteKey:
    """A peer's rkey as this channel uses it (verbs rkeys need no unpacking)."""

    __slots__ = ("handle", "rkey")

    def __init__(self, rkey: int) -> None:
        self.rkey = rkey
        self.handle: int | None = rkey

    def close(self) -> None:
        self.handle = None


class _Out:
    """One frame waiting for a ring slot at the peer and a send buffer here."""

    __slots__ = ("arg", "body", "ctrl", "flags", "kind", "meta_len", "msg_id", "nseg", "payload_len", "posted")

    def __init__(
        self,
        kind: Kind,
        body: bytes = b"",
        *,
        flags: int = 0,
        nseg: int = 0,
        meta_len: int = 0,
        msg_id: int = 0,
        arg: int = 0,
        payload_len: int = 0,
        ctrl: bool = False,
    ) -> None:
        self.kind = kind
        self.body = body
        self.flags = flags
        self.nseg = nseg
        self.meta_len = meta_len
        self.msg_id = msg_id
        self.arg = arg
        self.payload_len = payload_len
        self.ctrl = ctrl
        self.posted = False


class _Incoming:
    """A message whose payload is (or will be) read from the sender's memory."""

    __slots__ = ("arrival", "asked_back", "cut", "faulting", "pending", "pulled", "regions", "rendezvous", "segs")

    def __init__(self, arrival: Arrival, segs: list[tuple[int, int, int]], rendezvous: bool) -> None:
        self.arrival = arrival
        self.segs = segs
        self.rendezvous = rendezvous
        self.pulled = False  # a recv reads it (and sends the FIN once it has returned)
        # the fault-in of the memory its READs are to land in, under way (``_read``): none of
        # them is posted before it ends, so a recv cancelled meanwhile can give it back unread
        self.faulting: asyncio.Future[None] | None = None
        self.pending = 0
        self.regions: list[Region] = []
        self.cut = False  # our BYE went before its FIN could: its sender fails it (``aclose``)
        self.asked_back = False  # its sender's ABORT came while it was being read: it is read whole


class VerbsChannel(Channel):
    transport = "verbs"
    # (rma_device stays False: one-sided operations take host arrays only; device memory would
    # need a dma-buf registration, _dmabuf.py, not wired here, so the caller stages it)

    def __init__(
        self,
        qp: QueuePair,
        memory: MemoryCache,
        *,
        limits: Limits,
        remote: PeerLimits,
        remote_slots: int,
        remote_slot_bytes: int,
        max_rdma: int,
        max_msg: int,
        name: str,
        on_shutdown: Callable[[], None],
    ) -> None:
        super().__init__()
        self._qp = qp
        self._mem = memory
        self._limits = limits
        self._remote = remote
        self._peer_ring = remote_slots
        self._frame_max = min(qp.slot_bytes, remote_slot_bytes) - FRAME.size
        # how much payload rides inline is each sender's own choice (its Limits.inline_bytes,
        # which the peer is never told); what a receiver accepts is the bound both sides derive
        # alike from the ring geometry they traded, so nodes with different inline_bytes agree
        self._inline_max = 4 * self._frame_max
        self._inline = min(limits.inline_bytes, self._inline_max)
        self._max_rdma = max_rdma
        self._chunk = max(4096, min(max_msg, 4 << 20))
        self.name = name
        self._on_shutdown = on_shutdown
        self.lanes = (f"rc/{qp.port.device}:{qp.port.port}",)
        self._loop = asyncio.get_running_loop()
        e = pv().enums
        self._read_access = e.IBV_ACCESS_REMOTE_READ
        self._write_access = e.IBV_ACCESS_LOCAL_WRITE
        # ring credit
        self._sent = 0  # frames posted to the peer
        self._peer_processed = 0  # frames the peer took from its ring (so re-posted)
        self._processed = 0  # frames taken from our ring
        self._unreported = 0  # non-CREDIT frames processed since our count last went out
        self._unreported_credit = 0  # CREDIT frames processed since then (reported lazily: _on_frame)
        self._report_timer: asyncio.TimerHandle | None = None
        self._credit_wanted = False
        self._outq: deque[_Out] = deque()
        self._send_free = list(range(qp.send_slots))
        self._send_cbs: dict[int, Callable[[BaseException | None], None]] = {}
        # RDMA operations
        self._rdma_q: deque[tuple[bool, int, int, int, int, int, Callable[[BaseException | None], None]]] = deque()
        self._rdma_cbs: dict[int, Callable[[BaseException | None], None]] = {}
        self._rdma_ids = 0
        # mailbox credit
        # the last eighth of the credit kept for small messages (``SendWindow``): a ping beside large
        # eager sends the peer has not taken yet still goes eager, not behind their reads
        self._window = SendWindow(remote, keep_for_small=True)
        self._budget = ReceiveBudget(limits, self._want_credit)
        self._next_id = 1
        self._fins: dict[int, asyncio.Future[int]] = {}
        self._fins_due: set[int] = set()  # FINs of messages recvs returned, to go next loop turn (pull)
        # each send waiting for its FIN: its frames, bytes and whether it went eager (``_ending``)
        self._described: dict[int, tuple[list[_Out], int, bool]] = {}
        # the sends asked back (ABORT) at the peer's goodbye: a FIN saying dropped fails them with it
        self._asked_back: dict[int, BaseException] = {}
        self._frags: dict[int, list[bytes]] = {}
        self._waiting: dict[int, _Incoming] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._eager: set[Arrival] = set()
        self._futs: set[asyncio.Future[Any]] = set()
        self._order = SendOrder()  # FIFO per tag, however long a send waits to post
        self._sending = 0
        self._progress: asyncio.Future[None] | None = None  # aclose waits for a completion batch
        self.stats = {"frames_out": 0, "frames_in": 0, "reads": 0, "writes": 0, "credit_frames": 0}

    def __repr__(self) -> str:
        return f"<VerbsChannel {self.name} [{', '.join(self.lanes)}] {self.state.value} in_flight={self.in_flight}>"

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight + self._sending

    def start(self) -> None:
        self._qp.start()
        self._qp.drain()  # anything that landed before the loop watched the descriptor

    # -- completions ------------------------------------------------------------------------------
    def _completions(self, wcs: list[Any]) -> None:
        if any(wc.status for wc in wcs):
            # after an error every outstanding request completes as 'flushed', not always
            # after the one that failed: name the cause
            wcs = sorted(wcs, key=lambda wc: wc.status == WC_FLUSH)
        for wc in wcs:
            if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
                return
            wr_id = wc.wr_id
            status = wc.status
            err: BaseException | None = None
            if status:
                err = self._wc_error(status, wr_id)
            if wr_id & _SEND_BIT:
                slot = wr_id & 0xFFFF
                self._send_free.append(slot)
                cb = self._send_cbs.pop(slot, None)
                if cb is not None:
                    cb(err)
            elif wr_id & _RDMA_BIT:
                rcb = self._rdma_cbs.pop(wr_id, None)
                if rcb is not None:
                    rcb(err)
            elif err is None:
                try:
                    self._on_frame(wr_id, wc.byte_len)
                except ProtocolError as exc:
                    log.warning("closing verbs channel %s: %s", self.name, exc)
                    self._shutdown(ChannelState.BROKEN, exc)
                    return
                except TensorWireError as exc:
                    self._shutdown(ChannelState.BROKEN, exc)
                    return
                except Exception as exc:  # a bug must not leave recvs hanging
                    log.exception("verbs frame handler failed")
                    self._shutdown(ChannelState.BROKEN, BrokenResourceError(f"verbs frame handler failed: {exc!r}"))
                    return
            if err is not None:
                if self.state is ChannelState.OPEN or self.state is ChannelState.CLOSING:
                    log.warning("verbs channel %s: %s", self.name, err)
                self._shutdown(ChannelState.BROKEN, err)
                return
        self._pump()
        self._pump_rdma()
        self._wake_closer()

    def _wake_closer(self) -> None:
        if self._progress is not None and not self._progress.done():
            self._progress.set_result(None)

    def _wc_error(self, status: int, wr_id: int) -> BaseException:
        what = "send" if wr_id & _SEND_BIT else "RDMA operation" if wr_id & _RDMA_BIT else "receive"
        text = f"verbs {what} failed: {wc_status_name(status)}"
        if status == WC_FLUSH and self.mailbox.failure is not None:
            return fresh(self.mailbox.failure)  # (a copy of its own for each: see ``fresh``)
        if status in (WC_RETRY_EXC, WC_RNR_RETRY_EXC):
            return PeerDisconnected(text)
        return TransferError(text)

    # -- frames out -------------------------------------------------------------------------------
    def _enqueue(self, out: _Out) -> None:
        self._outq.append(out)
        self._pump()

    def _ring_free(self) -> int:
        return self._peer_ring - (self._sent - self._peer_processed)

    def _pump(self) -> None:
        if self.state not in (ChannelState.OPEN, ChannelState.CLOSING):
            return
        while self._outq and self._send_free:
            out = self._outq[0]
            if self._ring_free() <= (0 if out.ctrl else RESERVE):
                break
            self._outq.popleft()
            self._post(out)
        if self._credit_wanted and self._send_free and self._ring_free() > 0:
            self._post(_Out(Kind.CREDIT, ctrl=True))

    def _post(self, out: _Out, done: Callable[[BaseException | None], None] | None = None) -> None:
        credit, slots = self._budget.take_returns()
        self._credit_wanted = False
        self._unreported = self._unreported_credit = 0
        if self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        slot = self._send_free.pop()
        qp = self._qp
        off = slot * qp.slot_bytes
        view = qp.send_view
        FRAME.pack_into(
            view.data,
            off,
            out.kind,
            out.flags,
            out.nseg,
            out.meta_len,
            out.msg_id,
            out.arg,
            out.payload_len,
            credit,
            slots,
            self._processed & _U32,
        )
        n = FRAME.size + len(out.body)
        if out.body:
            view[off + FRAME.size : off + n] = np.frombuffer(out.body, np.uint8)
        if done is not None:
            self._send_cbs[slot] = done
        try:
            qp.post_send(_SEND_BIT | slot, slot, n)
        except (pv().pyverbs_error.PyverbsError, BrokenResourceError) as exc:
            self._send_free.append(slot)
            self._send_cbs.pop(slot, None)
            self._shutdown(ChannelState.BROKEN, TransferError(f"verbs post_send failed: {exc}"))
            return
        out.posted = True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s > %s flags=%d id=%d len=%d", self.name, out.kind.name, out.flags, out.msg_id, n)
        self._sent += 1
        self.stats["frames_out"] += 1
        if out.kind is Kind.CREDIT:
            self.stats["credit_frames"] += 1

    def _want_credit(self) -> None:
        """Something is owed to the peer (ring slots or mailbox credit): send a CREDIT frame
        (also while closing: a peer whose FIN waits for ring slots must hear of them)."""
        if self.state not in (ChannelState.OPEN, ChannelState.CLOSING):
            return
        self._credit_wanted = True
        self._pump()

    def _schedule_report(self) -> None:
        if self._unreported >= (self._qp.slots - RESERVE) // 4:
            self._want_credit()
        elif self._report_timer is None:
            self._report_timer = self._loop.call_later(FLUSH_DELAY, self._report_due)

    def _report_due(self) -> None:
        self._report_timer = None
        if self._unreported:
            self._want_credit()

    def _send_body(
        self, kind: Kind, body: bytes, *, flags: int, nseg: int, meta_len: int, msg_id: int, tag: int, nbytes: int
    ) -> list[_Out]:
        """Queue a MSG whose body may span several frames (FRAG ... MSG)."""
        outs = []
        step = self._frame_max
        pos = 0
        while len(body) - pos > step:
            outs.append(_Out(Kind.FRAG, body[pos : pos + step], msg_id=msg_id))
            pos += step
        outs.append(
            _Out(
                kind,
                body[pos:],
                flags=flags,
                nseg=nseg,
                meta_len=meta_len,
                msg_id=msg_id,
                arg=tag,
                payload_len=nbytes,
            )
        )
        for out in outs:
            self._outq.append(out)
        self._pump()
        return outs

    # -- sending ------------------------------------------------------------------------------------
    async def send(self, tag: int, msg: Outgoing) -> Receipt:
        self.check_open()
        header = msg.header
        self._remote.check_send(msg.nbytes, len(header))
        t0 = time.perf_counter()
        # its turn now, before any await (staging device memory, a slot): FIFO per tag
        turn = self._order.enter(tag)
        try:
            return await self._send_in_turn(tag, msg, header, t0, turn)
        finally:
            turn.passed()  # (a no-op once passed)

    async def _send_in_turn(self, tag: int, msg: Outgoing, header: bytes, t0: float, turn: Turn) -> Receipt:
        await self.stage_device(msg)  # no device lanes here: through host memory
        self._sending += 1
        try:
            await turn.wait()
            # (``_check_going``: after the peer's goodbye a send raises, a small inline one too,
            # where it returned for a message the closing peer would drop)
            await self._window.take_slot(tag, self._check_going)
            nbytes = msg.nbytes
            eager = self._window.reserve(nbytes)
            msg_id = self._next_id
            self._next_id += 1
            if eager and nbytes <= self._inline:
                body = b"".join([header, *msg.segments()]) if nbytes else header
                outs = self._send_body(
                    Kind.MSG,
                    body,
                    flags=Flag.INLINE,
                    nseg=0,
                    meta_len=len(header),
                    msg_id=msg_id,
                    tag=tag,
                    nbytes=nbytes,
                )
                if not outs[-1].posted and self.state is not ChannelState.OPEN:
                    # its post failed at once (``_post``: the channel broke, the queue dropped):
                    # the message never left, so no receipt (the channel was open before it)
                    self.check_open()
                turn.passed()
                protocol = "inline" if nbytes else "eager"  # as the receiver names it
            else:
                await self._send_described(msg, header, msg_id, tag, eager, turn)
                protocol = "eager" if eager else "rendezvous"
        finally:
            self._sending -= 1
        return self._send_receipt(msg, protocol, t0, tag)

    async def _send_described(
        self, msg: Outgoing, header: bytes, msg_id: int, tag: int, eager: bool, turn: Turn
    ) -> None:
        """Register the payload, send its descriptors (then the next send on the tag may go:
        ``turn``), wait for the receiver's FIN."""
        arrays = [_host(a) for a in msg.arrays if a.nbytes]
        if len(arrays) > _MAX_SEGS:
            self._window.unspend(msg.nbytes, eager)
            raise MessageRefused(f"a message of {len(arrays)} tensors exceeds the {_MAX_SEGS} a verbs message carries")
        regions: list[Region] = []
        try:
            for a in arrays:
                regions.append(self._mem.acquire(a, self._read_access))
        except BaseException:
            for r in regions:
                self._mem.release(r)
            self._window.unspend(msg.nbytes, eager)
            raise
        descs = b"".join(
            SEG.pack(a.__array_interface__["data"][0], a.nbytes, r.rkey, 0)
            for a, r in zip(arrays, regions, strict=True)
        )
        fin: asyncio.Future[int] = self._loop.create_future()
        self._fins[msg_id] = fin
        outs = self._send_body(
            Kind.MSG,
            header + descs,
            flags=0 if eager else Flag.RENDEZVOUS,
            nseg=len(arrays),
            meta_len=len(header),
            msg_id=msg_id,
            tag=tag,
            nbytes=msg.nbytes,
        )
        self._described[msg_id] = (outs, msg.nbytes, eager)
        turn.passed()
        try:
            try:
                flags = await asyncio.shield(fin)  # a cancellation must not cancel fin itself
            except asyncio.CancelledError:
                if not any(o.posted for o in outs):  # nothing went out: withdraw the message
                    if not fin.done():  # (else the peer's goodbye withdrew it: _ending)
                        self._withdraw(outs, msg.nbytes, eager)
                    raise
                if self.state in (ChannelState.OPEN, ChannelState.CLOSING):
                    self._enqueue(_Out(Kind.ABORT, msg_id=msg_id))
                # the peer may be reading our memory: it answers with FIN (read whole, or dropped)
                while not fin.done():
                    try:
                        await asyncio.shield(fin)
                    except asyncio.CancelledError:
                        continue
                    except TensorWireError:
                        break
                raise
        finally:
            self._fins.pop(msg_id, None)
            self._described.pop(msg_id, None)
            goodbye = self._asked_back.pop(msg_id, None)
            for r in regions:
                self._mem.release(r)
        if flags & Flag.FAILED:
            raise TransferError("the peer could not read the message's payload")
        if goodbye is not None and flags & Flag.DROPPED:  # (asked back at its goodbye: _ending)
            raise fresh(goodbye)

    def _withdraw(self, outs: list[_Out], nbytes: int, eager: bool) -> None:
        """Take a message none of whose frames has left out of the send queue, and give back the
        credit it spent (a send cancelled, or ended by the peer's goodbye, before then)."""
        for o in outs:
            if o in self._outq:
                self._outq.remove(o)
        self._window.unspend(nbytes, eager)

    # -- frames in ----------------------------------------------------------------------------------
    def _on_frame(self, slot: int, nbytes: int) -> None:
        qp = self._qp
        if nbytes < FRAME.size:
            raise ProtocolError(f"verbs frame of {nbytes} bytes is shorter than its header")
        buf = qp.slot_view(slot, nbytes)
        fields = FRAME.unpack_from(buf.data, 0)
        kind_v, flags_v, nseg, meta_len, msg_id, arg, payload_len, credit, slots, processed = fields
        body = buf[FRAME.size :].tobytes()
        qp.post_recv(slot)  # the bytes are ours now: the slot goes back to the ring
        self._processed += 1
        self.stats["frames_in"] += 1
        kind = kind_of(kind_v)
        flags = check_flags(flags_v)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s < %s flags=%d id=%d len=%d", self.name, kind.name, flags, msg_id, nbytes)
        delta = (processed - self._peer_processed) & _U32
        if delta > self._sent - self._peer_processed:
            raise ProtocolError("peer reported more frames processed than were sent")
        self._peer_processed += delta
        self._window.grant(credit, slots)
        if kind is Kind.CREDIT:
            # a CREDIT frame took a slot of our ring too, and the peer counts that slot as
            # taken until we report it: a peer that only returns credit (its recvs consume a
            # burst of ours while we wait for its answer) would see our ring fill up and could
            # not send the answer (a data frame needs more than RESERVE free slots). Reported
            # at once, each CREDIT frame would answer one: the two sides would trade them
            # forever. So they are reported once half the unreserved ring is theirs: a peer
            # blocked for data has at least slots - RESERVE frames unreported here, so either
            # one of them is a data frame (reported within FLUSH_DELAY) or enough of them are
            # CREDIT frames; and a CREDIT frame sent for this reason takes (slots - RESERVE) // 2
            # (at least 2) of the peer's, so CREDIT frames alone die out (docs/verbs.md)
            self._unreported_credit += 1
            if self._unreported_credit >= (self._qp.slots - RESERVE) // 2:
                self._want_credit()
        else:
            self._unreported += 1
            self._schedule_report()
        if kind is Kind.MSG:
            self._on_msg(flags, nseg, meta_len, msg_id, arg, payload_len, body)
        elif kind is Kind.FRAG:
            # an honest sender queues a message's FRAG frames and its MSG back to back (one
            # FIFO, _send_body; only CREDIT and BYE frames go around it), so there is one
            # partial message at a time: FRAGs under ever new ids would make us hold a partial
            # body per id until the channel closes
            if self._frags and msg_id not in self._frags:
                raise ProtocolError("verbs FRAG frame of a new message before the last one's MSG")
            parts = self._frags.setdefault(msg_id, [])
            parts.append(body)
            limit = self._limits.max_header_bytes + self._inline_max + _MAX_SEGS * SEG.size
            if sum(len(p) for p in parts) > limit:
                raise ProtocolError("fragmented verbs message body exceeds the limits")
        elif kind is Kind.FIN:
            fut = self._fins.get(msg_id)
            if fut is not None and not fut.done():
                fut.set_result(int(flags))
        elif kind is Kind.ABORT:
            entry = self._waiting.pop(msg_id, None)
            if entry is not None:
                self.mailbox.abort(entry.arrival)
                self.release(entry.arrival)
                self._enqueue(_Out(Kind.FIN, flags=Flag.DROPPED, msg_id=msg_id))
            else:  # a message being read gets its FIN when the read is done
                inc = self._incoming.get(msg_id)
                if inc is not None:
                    inc.asked_back = True  # (and is not given back unread: ``take_back``)
        elif kind is Kind.BYE:
            self._shutdown(ChannelState.CLOSED, PeerDisconnected("peer closed the channel"))

    def _on_msg(
        self, flags: Flag, nseg: int, meta_len: int, msg_id: int, tag: int, payload_len: int, body: bytes
    ) -> None:
        limits = self._limits
        parts = self._frags.pop(msg_id, None)
        if self._frags:
            raise ProtocolError("verbs MSG frame amid another message's FRAG frames")
        if parts:
            body = b"".join([*parts, body])
        inline = bool(flags & Flag.INLINE)
        rndv = bool(flags & Flag.RENDEZVOUS)
        if meta_len > limits.max_header_bytes:
            raise ProtocolError(f"message header of {meta_len} bytes exceeds the limit")
        expect = meta_len + (payload_len if inline else nseg * SEG.size)
        if len(body) != expect or (inline and (nseg or rndv or payload_len > self._inline_max)):
            raise ProtocolError("malformed verbs MSG frame")
        if msg_id in self._waiting or msg_id in self._incoming:
            raise ProtocolError(f"duplicate message id {msg_id}")
        tree, specs = decode_header(body[:meta_len], max_message_bytes=limits.max_message_bytes)
        nbytes = sum(s.nbytes for s in specs)
        segs: list[tuple[int, int, int]] = []
        if inline:
            if payload_len != nbytes:
                raise ProtocolError(f"MSG frame carries {payload_len} inline bytes of a {nbytes}-byte message")
        else:
            for k in range(nseg):
                addr, length, rkey, _ = SEG.unpack_from(body, meta_len + k * SEG.size)
                segs.append((addr, length, rkey))
            if sum(s[1] for s in segs) != nbytes or payload_len != nbytes or not nbytes:
                raise ProtocolError("verbs segment descriptors do not match the message header")
        self._budget.admit(nbytes, eager=not rndv, tag=tag)
        protocol = "rendezvous" if rndv else "inline" if inline and nbytes else "eager"
        arrival = Arrival(self, tag, tree, specs, msg_id=msg_id, rendezvous=not inline, protocol=protocol)
        if not rndv:
            self._eager.add(arrival)
        self.mailbox.arrive(arrival)
        if inline:
            if arrival.dest is None:
                arrival.buffer()  # (dropped, and its recv told, if memory is short)
            pos = meta_len
            while pos - meta_len < nbytes:
                view = arrival.view(pos - meta_len, nbytes)
                view[:] = body[pos : pos + len(view)]
                pos += len(view)
            arrival.written = nbytes
            arrival.complete()
            return
        entry = _Incoming(arrival, segs, rndv)
        self._waiting[msg_id] = entry
        if rndv:
            return  # the recv pulls it
        if arrival.dest is None:
            self._adopt(entry)  # nobody waits: read it into a buffer of our own now, within the credit
        else:
            self._loop.call_soon(self._check_pulled, arrival)  # the recv's task reads into out=

    def _check_pulled(self, arrival: Arrival) -> None:
        """An eager message matched a recv with out=, whose task should have pulled it by now; if
        that recv was cancelled first, the message was requeued into our own buffer: read it."""
        entry = self._waiting.get(arrival.msg_id)
        if entry is None or entry.arrival is not arrival or self.state is not ChannelState.OPEN:
            return
        if arrival.direct and not arrival.pulling:
            self._loop.call_soon(self._check_pulled, arrival)
            return
        if not arrival.pulling:
            self._adopt(entry)

    def _adopt(self, entry: _Incoming) -> None:
        if entry.arrival.adopt():  # (no memory for it now: it waits unread in the sender's memory)
            self._read(entry)

    def _read(self, entry: _Incoming) -> None:
        """RDMA READ the sender's segments into ``arrival.dest``; FIN when all have landed.

        Memory not registered yet that the READs land in is faulted in by a worker thread first
        (``_faulting_in``), and the message counts as being read meanwhile. Registering it on
        the loop faulted it in there: a 64 MiB recv without ``out=`` held the loop 0.76 s of
        its 5.4 s in the emulated guest, and the longer the larger the message."""
        arrival = entry.arrival
        self._waiting.pop(arrival.msg_id, None)
        assert arrival.dest is not None
        try:
            dests = [_host(a) for a in arrival.dest if a.nbytes]
        except TensorWireError as exc:
            self._read_failed(entry, exc)
            return
        self._incoming[arrival.msg_id] = entry
        faulting = self._faulting_in(dests)
        if faulting is None:
            self._post_reads(entry, dests)
        else:
            entry.faulting = faulting
            faulting.add_done_callback(lambda _: self._post_reads(entry, dests))

    def _faulting_in(self, arrays: list[np.ndarray]) -> asyncio.Future[None] | None:
        """A worker thread faulting in ``arrays``, memory for RDMA to write into, where
        registering them would fault it in on the loop (large, not registered yet): its future;
        None where registering them now is cheap. It never fails."""
        untouched = [a for a in arrays if a.nbytes >= FAULT_IN_BYTES and not self._mem.cached(a, self._write_access)]
        if not untouched:
            return None
        try:
            return self._loop.run_in_executor(None, fault_in, untouched)
        except RuntimeError:  # (no worker threads any more: the interpreter is exiting)
            return None

    def _post_reads(self, entry: _Incoming, dests: list[np.ndarray]) -> None:
        arrival = entry.arrival
        if self._incoming.get(arrival.msg_id) is not entry or self.state is not ChannelState.OPEN:
            # the channel shut while the memory was faulted in (and failed it), or is closing (it
            # will); or the recv was cancelled meanwhile and gave the message back (``take_back``):
            # ``dests`` is its out=, and a recv that pulls the message again reads it as a new entry
            return
        entry.faulting = None
        try:
            for a in dests:
                entry.regions.append(self._mem.acquire(a, self._write_access))
        except TensorWireError as exc:
            self._read_failed(entry, exc)
            return
        pieces = []
        di, doff, si, soff = 0, 0, 0, 0
        while di < len(dests) and si < len(entry.segs):
            d, region = dests[di], entry.regions[di]
            saddr, slen, rkey = entry.segs[si]
            n = min(d.nbytes - doff, slen - soff, self._chunk)
            pieces.append((d.__array_interface__["data"][0] + doff, region.lkey, n, saddr + soff, rkey))
            doff += n
            soff += n
            if doff == d.nbytes:
                di, doff = di + 1, 0
            if soff == slen:
                si, soff = si + 1, 0
        entry.pending = len(pieces)
        done = functools.partial(self._read_done, entry)
        for laddr, lkey, n, raddr, rkey in pieces:
            self._rdma(True, laddr, lkey, n, raddr, rkey, done)
        self._pump_rdma()

    def _read_failed(self, entry: _Incoming, exc: BaseException) -> None:
        arrival = entry.arrival
        self._release_regions(entry)
        self._incoming.pop(arrival.msg_id, None)
        arrival.fail(exc)
        self.release(arrival)
        self._enqueue(_Out(Kind.FIN, flags=Flag.FAILED, msg_id=arrival.msg_id))

    def _release_regions(self, entry: _Incoming) -> None:
        regions, entry.regions = entry.regions, []
        for r in regions:
            self._mem.release(r)

    def _read_done(self, entry: _Incoming, err: BaseException | None) -> None:
        if err is not None:
            return  # the channel breaks (_completions), which fails the arrival
        entry.pending -= 1
        self.stats["reads"] += 1
        if entry.pending:
            return
        arrival = entry.arrival
        if entry.cut:  # its sender took our BYE for "not read": it must not arrive here either
            self._release_regions(entry)
            self._incoming.pop(arrival.msg_id, None)
            arrival.fail(ClosedResourceError("channel closed before the message was read whole"))
            self.release(arrival)
            return
        self._release_regions(entry)
        self._incoming.pop(arrival.msg_id, None)
        arrival.written = arrival.nbytes
        arrival.complete()
        if not entry.pulled or self.state is ChannelState.CLOSING:
            # (closing: the FIN goes now, ahead of the BYE, not once the recv has returned)
            entry.pulled = False
            self._fin(arrival.msg_id)

    def _fin_due(self, msg_id: int) -> None:
        """The FIN of a message a recv has returned (``pull``), if not sent yet (``aclose``)."""
        if msg_id in self._fins_due:
            self._fins_due.discard(msg_id)
            self._fin(msg_id)

    def _fin(self, msg_id: int) -> None:
        # also while closing: the message is read whole (a recv may have returned it), and its
        # sender's send must say so (aclose sends this before its BYE)
        if self.state in (ChannelState.OPEN, ChannelState.CLOSING):
            self._enqueue(_Out(Kind.FIN, msg_id=msg_id))

    async def pull(self, arrival: Arrival) -> None:
        self.check_open()
        entry = self._waiting.get(arrival.msg_id)
        if entry is None or entry.arrival is not arrival:
            inc = self._incoming.get(arrival.msg_id)
            if inc is None or inc.arrival is not arrival:
                if arrival.done.done():
                    arrival.done.result()
                    return
                raise TransferError("message is no longer pending")
        else:
            entry.pulled = True
            self._read(entry)
        # RDMA READs may be writing into arrival.dest (perhaps the caller's out=): a
        # cancellation waits for them to finish (or for the channel to fail)
        cancelled = False
        while not arrival.done.done():
            try:
                await arrival.completed()  # (woken by complete/fail: a loop turn sooner than a shield)
            except asyncio.CancelledError:
                if not cancelled and self.take_back(arrival):
                    raise  # no READ posted: it goes back unread (``Mailbox._requeue``)
                cancelled = True
        if entry is not None and entry.pulled and arrival.done.done() and arrival.done.exception() is None:
            # the sender's send returns on FIN: let this recv return (and its caller post the
            # next one) first, so that a sender going back to back finds the next recv waiting
            self._fins_due.add(arrival.msg_id)
            self._loop.call_soon(self._fin_due, arrival.msg_id)
        if cancelled:
            raise asyncio.CancelledError
        arrival.done.result()

    def take_back(self, arrival: Arrival) -> bool:
        """The recv that pulled ``arrival`` was cancelled while the memory its READs land in (its
        out=, or a buffer of ours) is faulted in by a worker thread (``_read``): no READ has been
        posted, so the message is given back unread, its sender still waiting for its FIN (or
        free to withdraw it: ABORT), and the cancel ends now. (It waited for the whole fault-in
        and the READs, and the message was then copied out of out= into a buffer of ours.) The
        message waits in a new entry: the fault-in, when it ends, finds its own entry gone
        (``_post_reads``) and posts no READ into the cancelled recv's memory, though a recv
        pulls the message again meanwhile. False, nothing changed, once READs may be posted,
        or where its sender has asked for it back (ABORT, ignored while it is being read: it
        is read whole, and the FIN ends that send, rather than wait unread for a recv)."""
        entry = self._incoming.get(arrival.msg_id)
        if (
            self.state is not ChannelState.OPEN
            or entry is None
            or entry.arrival is not arrival
            or not entry.pulled
            or entry.faulting is None
            or entry.asked_back
            or arrival.done.done()
        ):
            return False
        del self._incoming[arrival.msg_id]
        self._waiting[arrival.msg_id] = _Incoming(arrival, entry.segs, entry.rendezvous)
        arrival.pulling = False  # (``unread`` now: its recv gives it back without its out=)
        if not entry.rendezvous:
            # eager: read into a buffer of ours unless a recv pulls it first (``_check_pulled``)
            self._loop.call_soon(self._check_pulled, arrival)
        return True

    def discard(self, arrival: Arrival) -> bool:
        """Drop a message kept unread here: an eager one there was no memory for (``_adopt``), or
        a rendezvous one not pulled yet. Its payload waits in the sender's memory and its
        sender's send for our FIN, which would hold it (an RPC server's call, its slot) until
        the channel closes. It is answered as an ABORT is: FIN dropped, nothing read; the send
        completes and the message fails here. (A rendezvous one was refused, its sender being
        able to abort it: an RPC server with no memory for a rendezvous request could neither
        drop nor take it, and its request reader stopped for good.)"""
        entry = self._waiting.get(arrival.msg_id)
        if entry is None or entry.arrival is not arrival or entry.pulled or arrival.pulling:
            return False  # (not kept unread here: being read, or read)
        if self.state is not ChannelState.OPEN:
            return False
        del self._waiting[arrival.msg_id]
        gone = TransferError(f"a {arrival.nbytes}-byte message on this tag was dropped unread: its receiver gave it up")
        self.mailbox.remove(arrival, gone)
        if not arrival.settled:
            arrival.settled = True
            self.release(arrival)
        self._enqueue(_Out(Kind.FIN, flags=Flag.DROPPED, msg_id=arrival.msg_id))
        return True

    def unread(self, arrival: Arrival) -> bool:
        # still waiting for its RDMA READs (a rendezvous message matched but not pulled, an
        # eager one whose recv's task is to read it): ``_read`` takes it from ``_waiting``
        entry = self._waiting.get(arrival.msg_id)
        return entry is not None and entry.arrival is arrival

    def release(self, arrival: Arrival) -> None:
        eager = arrival in self._eager
        self._eager.discard(arrival)
        self._budget.release(arrival.nbytes, eager, arrival.tag, schedule=self.state is ChannelState.OPEN)

    # -- RDMA operations ----------------------------------------------------------------------------
    def _rdma(
        self,
        read: bool,
        laddr: int,
        lkey: int,
        n: int,
        raddr: int,
        rkey: int,
        done: Callable[[BaseException | None], None],
    ) -> None:
        self._rdma_q.append((read, laddr, lkey, n, raddr, rkey, done))

    def _pump_rdma(self) -> None:
        # nothing new once closing: what is queued fails at _shutdown, after the queue pair is
        # gone, so a caller waiting for its operations (a cancelled get) returns only once no
        # RDMA READ can write into its buffer any more
        if self.state is not ChannelState.OPEN:
            return
        qp = self._qp
        while self._rdma_q and len(self._rdma_cbs) < self._max_rdma:
            read, laddr, lkey, n, raddr, rkey, done = self._rdma_q.popleft()
            self._rdma_ids += 1
            wr_id = _RDMA_BIT | self._rdma_ids
            self._rdma_cbs[wr_id] = done
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s %s %d bytes %#x <- %#x rkey %#x", self.name, "READ" if read else "WRITE", n, laddr, raddr, rkey
                )
            try:
                qp.post_rdma(wr_id, read, laddr, lkey, n, raddr, rkey)
            except (pv().pyverbs_error.PyverbsError, BrokenResourceError) as exc:
                # its callback stays in _rdma_cbs: the shutdown fails it with the rest (taken out
                # first, it was never called, and a get or put of one chunk waited for good)
                self._shutdown(ChannelState.BROKEN, TransferError(f"verbs post_send failed: {exc}"))
                return

    # -- one-sided ----------------------------------------------------------------------------------
    def remote_key(self, packed: bytes) -> RemoteKey:
        """A peer's verbs key (``RemoteKeyBlob.key``: the rkey, 4 bytes little endian)."""
        self.check_open()
        if len(packed) != 4:
            raise ProtocolError("a verbs remote key is 4 bytes")
        return RemoteKey(int.from_bytes(packed, "little"))

    async def rma(self, op: str, ptr: int, n: int, remote_addr: int, rkey: RemoteKey, keep: object) -> None:
        """Read (``op="get"``) ``n`` bytes at ``remote_addr`` into ``ptr``, or write them from ``ptr``
        (``op="put"``); returns once they are in place (an RC completion follows the peer's ack).
        ``keep`` is the numpy array over ``ptr`` (registered through the cache)."""
        await self.rma_many(op, [(ptr, n, remote_addr, rkey, keep)])

    async def rma_many(self, op: str, items: list[tuple[int, int, int, RemoteKey, object]]) -> None:
        """``rma`` for a batch of ``(ptr, n, remote_addr, rkey, keep)``: every RDMA READ or WRITE
        posted at once (the send queue's depth permitting), one future for all; returns once all
        completed. Nothing posted can be recalled, so a cancellation waits for it too. ``keep``
        is the numpy array that holds the ``n`` bytes at ``ptr`` (they, or a staging chunk they
        lie in: what is registered, and found again in the cache)."""
        self.check_open()
        read = op == "get"
        work = []
        for ptr, n, remote_addr, rkey, keep in items:
            if rkey.handle is None:
                raise ClosedResourceError("remote key is closed")
            if not isinstance(keep, np.ndarray) or not _holds(keep, ptr, n):
                raise TransferError("verbs one-sided operations take a numpy array that holds the bytes they move")
            if read and not keep.flags.writeable:
                raise TransferError("get needs a writable destination")
            if n:
                work.append((ptr, n, remote_addr, rkey, keep))
        if not work:
            return
        if read:  # (its local memory is written: fault it in off the loop, as _read does)
            faulting = self._faulting_in(list({id(keep): keep for *_, keep in work}.values()))
            if faulting is not None:
                # a cancellation need not wait for it: faulting in changes no byte, and the
                # worker holds the arrays until it is done (it waited out the whole fault-in:
                # seconds for GiBs, past the caller's deadline)
                await asyncio.shield(faulting)
                self.check_open()
        regions = []
        fut: asyncio.Future[None] = self._loop.create_future()
        pending = [0]

        def done(err: BaseException | None) -> None:
            pending[0] -= 1
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
                fut.exception()
            elif pending[0] == 0:
                fut.set_result(None)

        try:
            for *_, keep in work:  # every registration before anything is queued
                regions.append(self._mem.acquire(keep, self._write_access if read else 0))
            for (ptr, n, remote_addr, rkey, _), region in zip(work, regions, strict=True):
                pos = 0
                while pos < n:
                    k = min(self._chunk, n - pos)
                    self._rdma(read, ptr + pos, region.lkey, k, remote_addr + pos, rkey.rkey, done)
                    pending[0] += 1
                    pos += k
            self.stats["reads" if read else "writes"] += pending[0]
            self._pump_rdma()
            self._futs.add(fut)
            await self._finish_posted([fut])  # an RDMA operation cannot be recalled: let it finish
        finally:
            self._futs.discard(fut)
            for region in regions:
                self._mem.release(region)

    async def get(self, remote_addr: int, rkey: RemoteKey, dest: Any) -> None:
        arr = _bytes_of(dest)
        await self.rma("get", arr.__array_interface__["data"][0], arr.nbytes, remote_addr, rkey, arr)

    async def put(self, src: Any, remote_addr: int, rkey: RemoteKey) -> None:
        arr = _bytes_of(src)
        await self.rma("put", arr.__array_interface__["data"][0], arr.nbytes, remote_addr, rkey, arr)

    # -- lifecycle ----------------------------------------------------------------------------------
    def _ending(self, exc: BaseException) -> None:
        """Fail ``ended`` (``Channel._ending``), and end the sends waiting on the peer (it said
        goodbye), as tcp and ucx do, without giving back memory the peer may be reading. A send
        waiting for a message slot fails (nothing of it went out). One waiting for its FIN: if
        none of its frames left, it is withdrawn and fails (as a cancelled one is); if its MSG
        frame left, the peer may be RDMA-reading its payload now (or a recv of its may begin to,
        until its channel closes), which this side cannot see and cannot stop: it is asked back
        with ABORT, as a cancelled send is, and ends at the peer's FIN: dropped (not being read:
        it fails with ``exc``) or read whole (delivered: it returns). Its memory stays
        registered, and the send unreturned (its caller may not reuse the buffer), until then.
        Sends that begin later raise ``exc`` before they wait or send (``_check_going``; no
        message goes eager: ``SendWindow.end``)."""
        super()._ending(exc)
        if self.state is not ChannelState.OPEN:  # (our own close fails them with its own error)
            return
        fail_waiting_sends(self._window, {}, exc)
        for msg_id, (outs, nbytes, eager) in list(self._described.items()):
            fin = self._fins.get(msg_id)
            if fin is None or fin.done() or msg_id in self._asked_back:
                continue
            if not any(o.posted for o in outs):  # nothing went out: withdraw it
                self._withdraw(outs, nbytes, eager)
                fin.set_exception(fresh(exc))  # (each a copy of its own: see ``fresh``)
                fin.exception()
            else:
                self._asked_back[msg_id] = exc
                self._enqueue(_Out(Kind.ABORT, msg_id=msg_id))

    def peer_gone(self) -> None:
        """The bootstrap connection ended: take what completed, then fail what is pending."""
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            return
        if self.state is ChannelState.CLOSING:  # our own aclose: the peer took our BYE
            self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel closed"))
            return
        try:
            self._qp.drain()
        except Exception as exc:
            log.debug("draining the CQ of a lost peer failed: %s", exc)
        self._shutdown(ChannelState.BROKEN, PeerDisconnected("peer's connection ended (closed or died)"))

    def _shutdown(self, state: ChannelState, exc: BaseException) -> None:
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            return
        self._qp.close()  # first: no DMA touches our memory after this
        self._closed(state, exc)
        self._budget.close()
        self._window.fail(exc)
        if self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        self._order.fail(exc)
        # each operation fails with a copy of its own (``fresh``): raised by many callers, the
        # one object would gather their frames, and one caller keeping it would keep the
        # others' tensors and registrations alive
        for fut in [*self._fins.values(), *self._futs]:
            if not fut.done():
                fut.set_exception(fresh(exc))
                fut.exception()
        callbacks = [*self._rdma_cbs.values(), *(q[-1] for q in self._rdma_q), *self._send_cbs.values()]
        self._rdma_cbs.clear()
        self._rdma_q.clear()
        self._send_cbs.clear()
        for cb in callbacks:
            try:
                cb(fresh(exc))
            except Exception:
                log.exception("verbs completion callback failed during shutdown")
        for entry in [*self._waiting.values(), *self._incoming.values()]:
            self._release_regions(entry)
            entry.arrival.fail(fresh(exc))
        self._waiting.clear()
        self._incoming.clear()
        self._outq.clear()
        self._frags.clear()
        self._wake_closer()
        self._on_shutdown()

    async def aclose(self) -> None:
        """Send what is owed to the peer, then BYE (``BYE_GRACE`` in all), then shut down.

        Owed: every frame queued (an inline message whose send has returned, a FIN for a
        message read whole), and the peer's FINs for our sends whose payload it may be reading
        (RDMA READs cannot be recalled). The BYE used to go at once, around the queue (frames
        waiting for ring or send slots were dropped: sends that had returned lost their
        messages, a send whose message was delivered failed), and a send in flight failed with
        "channel closed" while its receiver may have been reading it."""
        if self.state is not ChannelState.OPEN:
            return
        self.state = ChannelState.CLOSING
        deadline = self._loop.time() + BYE_GRACE
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._owed_sent()
            if self.state is ChannelState.CLOSING and self._send_free and self._ring_free() > 0:
                sent: asyncio.Future[None] = self._loop.create_future()

                def done(err: BaseException | None) -> None:
                    if not sent.done():
                        sent.set_result(None)

                # READs still under way (the grace ran out): the BYE reaches the peer before
                # their FINs, and it fails their sends, so their recvs fail too, though the READs
                # finish before the queue pair goes (the BYE's completion waits for them); a recv
                # that returned the message left its send failed, and a caller that sent it again
                # delivered it twice
                # and a message a recv has returned gets its FIN now, ahead of the BYE (``pull``
                # queues it for the next loop turn, which the grace may not have left)
                for entry in self._incoming.values():
                    entry.cut = True
                for msg_id in sorted(self._fins_due):
                    self._fin_due(msg_id)
                self._post(_Out(Kind.BYE, ctrl=True), done)
                async with asyncio.timeout_at(max(deadline, self._loop.time() + 0.1)):
                    await sent  # the peer's ring took it
        except Exception:  # the peer may be gone already; closing goes on
            pass
        finally:
            self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel closed"))

    async def _owed_sent(self) -> None:
        """Until the queue is empty, no send waits for its FIN, no RDMA operation posted is
        under way, and BYE has a send slot and a ring slot (or the channel shut meanwhile).

        Posted RDMA READs of a peer's message cannot be recalled: they finish, and its recv
        returns it, so its FIN must go before the BYE (``_read_done``); a BYE posted behind
        them reached the peer ahead of the FIN, and its send failed though the message arrived."""
        # a recv that returned before this close schedules its message's FIN (pull, call_soon):
        # let it be queued first
        await asyncio.sleep(0)
        while self.state is ChannelState.CLOSING:
            fins = [f for f in self._fins.values() if not f.done()]
            if fins:
                await asyncio.wait(fins)
            elif self._rdma_cbs or self._outq or not self._send_free or self._ring_free() <= 0:
                self._progress = self._loop.create_future()
                await self._progress  # the next completion batch (or the shutdown)
            else:
                return

    def abort(self) -> None:
        self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel aborted"))

    def fail(self, exc: BaseException) -> None:
        self._shutdown(ChannelState.BROKEN, exc)


def _bytes_of(buf: Any) -> np.ndarray:
    """The bytes of ``buf`` (a numpy array or any buffer, C-contiguous) as a flat uint8 array.
    A numpy array's own bytes keep its ``base`` chain, so that the registration cache finds
    them again by their owner; one taken through a new memoryview had that memoryview for its
    owner, and was registered and deregistered on every get and put."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TransferError("verbs get and put take C-contiguous memory")
        return buf.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buf).cast("B")
    except (TypeError, ValueError) as exc:  # not a buffer, or not a C-contiguous one
        raise TransferError(f"verbs get and put take C-contiguous memory: {exc}") from exc
    return np.frombuffer(view, np.uint8)


def _holds(arr: np.ndarray, ptr: int, n: int) -> bool:
    """``arr`` is C-contiguous and its memory holds the ``n`` bytes at ``ptr``."""
    base = int(arr.__array_interface__["data"][0])
    return bool(arr.flags.c_contiguous) and base <= ptr and ptr + n <= base + arr.nbytes
