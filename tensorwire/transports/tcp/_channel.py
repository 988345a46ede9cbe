"""The staged-TCP channel: one full-duplex stream per peer, credit-based flow control.

A message smaller than the credit the receiver granted goes *eager*: header and payload right
away, landing in the posted recv's buffer or in a bounded buffer here. A larger one goes
*rendezvous*: the header goes first and the payload follows when the receiver's recv is posted
(CTS), straight into the recv's ``out=``. Payloads move in ``chunk_bytes`` frames so that
concurrent messages interleave; while small messages go out beside a large host payload (one
within ``QUICK_SECONDS``), its frames shrink to ``QUICK_CHUNK``, so the next small one waits
behind less. Credit and message slots come back piggybacked on any frame, or
in a CREDIT frame when no traffic flows the other way.

CUDA tensors are staged (``tensorwire.memory``): on the way out, chunks are copied from the
device into a ring of page-locked host chunks on a lane of our own (after the producer stream's
event), and chunk k goes on the wire while the copies of chunks k+1.. run; on the way in, each
DATA frame is read into a page-locked chunk whose copy to the device is queued at once, so the
next frame is read while it runs, and the recv's stream waits for the last copy. A device
tensor's frames are at most one staging chunk long (never mixed with other tensors' bytes).
Behind a consumer stream that stays busy the reader goes on past the ring (``_Overflow``), and
a copy the device refuses fails that message alone (``_device_failed``), not the channel; a
send that fails part way withdraws its message (ABORT), as a cancelled one does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from ... import _metrics
from ...errors import (
    BrokenResourceError,
    ClosedResourceError,
    IntegrityError,
    PeerDisconnected,
    ProtocolError,
    TensorWireError,
    TransferError,
)
from ...memory import CopyEngine, Event, StageIn, hand_back, stage_out, wait_event
from ...tensors import DeviceTensor, Outgoing, decode_header, decode_header_sized
from .. import _frames
from .._base import BYE_GRACE, Channel, ChannelState, Limits, Receipt, fresh
from .._credit import ReceiveBudget, SendWindow, fail_waiting_sends
from .._frames import (
    CHECKSUM,
    FLAG_CHECKSUM,
    HEADER,
    RENDEZVOUS,
    TRAILER,
    FrameType,
    PeerLimits,
    pack,
    unpack_fields,
)
from .._mailbox import Arrival
from .._order import SendOrder, Turn
from ._sockio import Buffer, Sent, SockIO, advance

log = logging.getLogger(__name__)

# A small message (an eager MSG of QUICK_BYTES or less) written while a larger host payload is
# being sent makes the host payload frames written in the next QUICK_SECONDS QUICK_CHUNK long at
# most: the next small one then waits behind at most that much (a whole chunk_bytes frame otherwise,
# 4.7 ms behind 4 MiB on a 2-core loopback, ~1 ms behind 512 KiB). Bulk alone keeps chunk_bytes
# frames (smaller ones cost it ~8% of the loopback rate). docs/benchmarks.md, tcp_hol.py.
QUICK_BYTES = 64 << 10
QUICK_CHUNK = 512 << 10
QUICK_SECONDS = 0.1

__all__ = ["TcpChannel"]


def _slices(segs: list[memoryview], start: int, end: int) -> list[memoryview]:
    out = []
    pos = 0
    for s in segs:
        n = len(s)
        if pos + n > start and pos < end:
            out.append(s[max(start - pos, 0) : min(end - pos, n)])
        pos += n
        if pos >= end:
            break
    return out


_REPOST_AFTER = 64 * 1024
# frames up to this size (header, metadata, payload, trailer) whole in the receive buffer are
# handled in the socket's readable callback (``TcpChannel._on_frames``), not by the reader task
_FAST_FRAME = 16 * 1024
_MSG, _CTS, _CREDIT = FrameType.MSG, FrameType.CTS, FrameType.CREDIT


async def _let_recvs_repost(arrival: Arrival) -> None:
    """After a large message, let the task that received it run and post its next recv before
    the next header is read: otherwise back-to-back messages miss their recv and are staged
    through a buffer of ours (measured: 29 of 30 staged without this, 0 with it). One loop turn
    does it where the recv waited for it (``Arrival.completed``): the turns after the first are
    for one that comes later (the recv task was busy), and end once a recv is posted on the tag."""
    if arrival.nbytes >= _REPOST_AFTER:
        mailbox = arrival.channel.mailbox
        for _ in range(3):  # complete -> recv task -> next recv posted
            await asyncio.sleep(0)
            if mailbox.has_posted(arrival.tag):
                break


def _crc_of(bufs: list[Buffer], n: int, crc: int = 0) -> int:
    """The crc32c of the first ``n`` bytes of ``bufs``, going on from ``crc``."""
    for b in bufs:
        if n <= 0:
            break
        k = min(n, len(b))
        crc = _frames.crc32c(b if k == len(b) else memoryview(b)[:k], crc)
        n -= k
    return crc


class _Summed:
    """The rest of a checksummed frame that the socket took only part of at once, written with
    its crc32c taken over its bytes as the socket takes them (``SockIO.send_now``'s ``sent``:
    right after each write, with no loop turn between), and its trailer once they all went."""

    __slots__ = ("crc", "trailed")

    def __init__(self, crc: int) -> None:
        self.crc = crc
        self.trailed = False

    def __call__(self, bufs: list[Buffer], n: int) -> list[Buffer]:
        if not self.trailed:
            self.crc = _crc_of(bufs, n, self.crc)
        rest = advance(bufs, n)
        if not rest and not self.trailed:
            self.trailed = True
            return [TRAILER.pack(self.crc)]
        return rest


class _Landed:
    """``SockIO.read_into``'s ``landed`` for a checksummed frame's host payload: marks how far it
    has landed (``Arrival.mark``) and sums the bytes written since, right after each write, from
    where they were written. Summed once the frame had landed, they were read back from the
    destination, where another write may have landed meanwhile (an exposed tensor that two
    peers write at once: reads and writes of the same bytes are not ordered), and the channel
    broke on a crc32c mismatch the wire had not made."""

    __slots__ = ("arrival", "crc", "pos")

    def __init__(self, arrival: Arrival, pos: int, crc: int) -> None:
        self.arrival = arrival
        self.pos = pos
        self.crc = crc

    def __call__(self, end: int) -> None:
        arrival, pos, crc = self.arrival, self.pos, self.crc
        while pos < end:
            view = arrival.view(pos, end - pos)
            crc = _frames.crc32c(view, crc)
            pos += len(view)
        self.pos, self.crc = pos, crc
        arrival.mark(end)


class _Turn:
    """Whose turn it is to write a frame on the stream, in FIFO order. The turn passes straight
    from one writer to the next (``busy`` stays True), so a writer that finds it free may write
    a frame at once, with no await, and nobody is overtaken."""

    __slots__ = ("_waiters", "busy")

    def __init__(self) -> None:
        self.busy = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def take(self) -> None:
        if not self.busy:
            self.busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give()  # handed over just as we were cancelled: pass it on
            else:
                with suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.busy = False


def _read_ahead(arrival: Arrival, copied: int) -> None:
    """Count ``copied`` payload bytes that ``read_into`` took out of the read-ahead buffer rather
    than reading them straight into ``arrival.dest``. The message is "copied", not direct, once
    most of its payload went that way (a message whose head alone came in with the header read
    is direct: 16 KiB at most per frame); a message on its way to device memory is staged anyway."""
    arrival.count_copied(copied)


def _on_device(arrival: Arrival) -> bool:
    return arrival.dest is not None and any(isinstance(d, DeviceTensor) for d in arrival.dest)


class _Redirected(Exception):
    """A staging chunk read for a device tensor went to host memory instead (``_redirect``)."""


def _redirect(arrival: Arrival, pos: int, chunk: memoryview) -> bool:
    """The payload bytes at ``pos`` (in staging ``chunk``, read for a device tensor that is no
    longer ``arrival``'s destination) into its destination now, if that is in host memory: a
    recv cancelled as they landed moved the message there (no device memory for it), or its
    bytes go to scratch. True if so; False where a device tensor of ours took the caller's
    place, which the chunk's copy finds by itself."""
    i, _, _ = arrival.locate(pos)
    assert arrival.dest is not None
    if isinstance(arrival.dest[i], DeviceTensor):
        return False
    done = 0
    while done < len(chunk):
        view = arrival.view(pos + done, len(chunk) - done)
        view[:] = chunk[done : done + len(view)]
        done += len(view)
    arrival.mark(pos + done)
    return True


class _Overflow:
    """A message landing in device memory whose consumer stream stays busy.

    Its copies up wait for that stream, and their staging chunks with them (parked out of the
    pool's depth, ``PinnedPool.park``); once a ring's depth of this message's chunks wait so
    (``parked``), the staging pipeline waits for the oldest to free (``StageIn._acquire``), and
    so did the reader, and every message behind this one on the stream with it: other tags, RPC
    replies, one-sided answers, the peer's close. Measured with the host engine standing in for a
    GPU (3 chunks of 64 KiB), a 7-byte message on another tag took 3.0 s behind a 768 KiB one
    into a stream held busy for 3 s (inproc and ucx: 1-4 ms); were that stream's work to wait
    for such a message, both would wait for good. So the rest of the message's bytes for that
    device go on through more chunks of the pool, each parked as the ring's are, their copies
    queued at once behind the same stream, and the reader goes on.

    The cost: page-locked memory (a copy up from pageable memory would make CUDA wait for the
    stream on the host, the loop), ``room`` of it at most: the rest of the message for that
    device, taken only if it fits in what is left of ``Limits.recv_buffer_bytes`` for the
    channel, the bound a receiver already sets on what one peer may have buffered here (tcp's
    eager buffers); it comes back to that allowance once the copies have run. The pool keeps
    the chunks for the transfers after, as it keeps every parked one (``PinnedPool.configure``
    frees idle ones): a busy stream raises its high-water mark by that much at most, past the
    ring (32 MiB by default). inproc and ucx's staged path hold every device message whole in
    host memory of theirs. A message whose rest does not fit waits for its stream as before.
    """

    __slots__ = ("engine", "last", "parked", "refused", "room", "size")

    def __init__(self) -> None:
        self.parked = 0  # this message's staging chunks given back behind its consumer's stream
        self.refused = False  # asked for the allowance once already
        self.engine: CopyEngine | None = None  # the device its overflow is for
        self.size = 0  # bytes of the channel's allowance it holds
        self.room = 0  # of which not used yet
        self.last: Event | None = None  # after its last copy up

    def due(self, stage: StageIn) -> bool:
        """Whether the message should go on through overflow chunks now: its next staging
        chunk would wait for the consumer's stream."""
        return not self.refused and self.parked >= stage.pool.depth and stage.behind_consumer()

    def takes(self, d: DeviceTensor) -> bool:
        """Whether more bytes for ``d`` go through overflow chunks."""
        return self.room > 0 and d.engine is self.engine


class TcpChannel(Channel):
    transport = "tcp"
    device_kinds = frozenset({"cuda", "host-engine"})

    def __init__(self, io: SockIO, limits: Limits, remote: PeerLimits, *, name: str, checksum: bool = False) -> None:
        super().__init__()
        self._io = io
        self._limits = limits
        self._remote = remote
        self.checksum = bool(checksum) or bool(remote.flags & FLAG_CHECKSUM)  # compared with != per frame
        self.lanes = (f"tcp x1 stream {name}",)
        self._loop = asyncio.get_running_loop()
        self._turn = _Turn()  # the stream's writers take turns, one whole frame each
        # what we may still send: the receiver's grants, the last eighth of the credit kept for
        # small messages (a ping beside 64 MiB eager sends went rendezvous: 0.3 -> 8 ms)
        self._window = SendWindow(remote, keep_for_small=True)
        self._next_id = 1
        self._cts: dict[int, asyncio.Future[None]] = {}
        self._order = SendOrder()  # FIFO per tag, however long a send waits for a slot
        self._sending = 0
        self._data_out = 0  # sends of host payloads over QUICK_BYTES under way
        self._quick_until = 0.0  # (loop time) till then those frames are QUICK_CHUNK at most
        self._budget = ReceiveBudget(limits, self._flush_credit)  # what the peer holds of our grants
        self._aux: set[asyncio.Task[None]] = set()
        self._incoming: dict[int, Arrival] = {}  # payload being received
        self._waiting: dict[int, Arrival] = {}  # rendezvous headers waiting for a recv
        self._overflows: dict[int, _Overflow] = {}  # messages landing behind a busy consumer stream
        self._overflowing = 0  # bytes of overflow chunks they hold (Limits.recv_buffer_bytes at most)
        self._reader = self._loop.create_task(self._read_loop(), name=f"tensorwire-tcp-reader {name}")
        io.on_frames = self._on_frames
        io.checked = self.checksum  # every frame from here carries a header check

    def __repr__(self) -> str:
        return f"<TcpChannel {self.lanes[0]} {self.state.value} in_flight={self.in_flight}>"

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight + self._sending

    # -- sending ----------------------------------------------------------------------------
    def _frame(
        self, ftype: FrameType, flags: int, meta: bytes, payload: list[memoryview] | None, msg_id: int, arg: int
    ) -> list[Buffer]:
        """The buffers of one frame, returned credit piggybacked; to be written at once."""
        credit, slots = self._budget.take_returns()
        plen = sum(len(p) for p in payload) if payload else 0
        if self._data_out and ftype is FrameType.MSG and not flags & RENDEZVOUS and plen <= QUICK_BYTES:
            self._quick_until = self._loop.time() + QUICK_SECONDS  # a small message beside bulk
        summed = self.checksum and (ftype is FrameType.MSG or ftype is FrameType.DATA)
        if summed:
            flags |= CHECKSUM
        bufs: list[Buffer] = [pack(ftype, flags, len(meta), plen, msg_id, arg, credit, slots, checked=self.checksum)]
        if meta:
            bufs.append(meta)
        if payload:
            bufs.extend(payload)
        if summed:
            crc = 0
            for b in bufs:
                crc = _frames.crc32c(b, crc)
            bufs.append(TRAILER.pack(crc))
        return bufs

    def _rest(self, ftype: FrameType, bufs: list[Buffer], rest: list[Buffer]) -> tuple[list[Buffer], Sent | None]:
        """What is left of the frame ``bufs`` after the socket took part of it at once, and how
        to write it (``SockIO.send_rest``). A checksummed frame's crc32c was taken as the frame
        was built, and the part written at once went right then; the rest goes over later loop
        turns, from memory that may change meanwhile: an exposed tensor that answers a peer's
        read while another write lands in it (reads and writes of the same bytes are not
        ordered). Its crc32c is then taken again over the bytes as they go, its trailer last:
        taken at the build, it made the reader see a mismatch the wire had not made, and the
        channel broke (IntegrityError). (Once only the trailer is left, every byte went at once.)"""
        summed = self.checksum and (ftype is FrameType.MSG or ftype is FrameType.DATA)
        if not summed or len(rest) < 2 or rest[-1] is not bufs[-1]:
            return rest, None
        taken = sum(len(b) for b in bufs) - sum(len(b) for b in rest)
        return rest[:-1], _Summed(_crc_of(bufs, taken))

    def _broken_write(self, exc: PeerDisconnected) -> BaseException | None:
        """Writing failed: break the channel; what to raise in place of ``exc``, if anything
        (closed by this side meanwhile? then that, not what the socket saw). None: ``exc``
        itself, which broke the channel (the channel keeps a copy of it: ``fresh``)."""
        failure = self.mailbox.failure
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN) and failure is not None:
            return fresh(failure)
        self._shutdown(ChannelState.BROKEN, exc)
        return None

    async def _write(
        self,
        ftype: FrameType,
        *,
        flags: int = 0,
        meta: bytes = b"",
        payload: list[memoryview] | Callable[[], list[memoryview]] | None = None,
        msg_id: int = 0,
        arg: int = 0,
        sent: list[bool] | None = None,
    ) -> None:
        """Write one whole frame. ``sent`` gets True appended once the frame is on the wire, also
        when a cancellation arrives while it is being finished (send_all completes a frame it
        started before re-raising), so a caller can tell 'never sent' from 'sent, then cancelled'.
        ``payload`` may be a function, called once the turn is ours."""
        await self._turn.take()
        try:
            self.check_open()
            if callable(payload):
                payload = payload()
            bufs = self._frame(ftype, flags, meta, payload, msg_id, arg)
            try:
                rest = self._io.send_now(bufs)
                if rest:
                    await self._io.send_rest(*self._rest(ftype, bufs, rest))
            except asyncio.CancelledError:
                if sent is not None:
                    sent.append(True)
                raise
            except PeerDisconnected as exc:
                failure = self._broken_write(exc)
                if failure is None:
                    raise
                raise failure from exc
            if sent is not None:
                sent.append(True)
        finally:
            self._turn.give()

    async def send(self, tag: int, msg: Outgoing) -> Receipt:
        self.check_open()
        header = msg.header
        nbytes = msg.nbytes
        self._remote.check_send(nbytes, len(header))
        t0 = time.perf_counter()
        window = self._window
        if (
            not self._turn.busy
            and not self._order.busy(tag)  # an earlier send on the tag waits for a slot: it goes first
            and window.has_slot(tag)
            and window.fits(nbytes)
            and nbytes <= self._limits.chunk_bytes
            and not msg.on_device
        ):
            # the common case: an eager message in one frame, a slot free and the stream idle:
            # the frame goes out now, nothing awaited unless the socket takes only part of it
            window.slots -= 1
            window.credit -= nbytes
            msg_id = self._next_id
            self._next_id += 1
            bufs = self._frame(FrameType.MSG, 0, header, msg.segments() if nbytes else None, msg_id, tag)
            try:
                rest = self._io.send_now(bufs)
            except PeerDisconnected as exc:
                failure = self._broken_write(exc)
                if failure is None:
                    raise
                raise failure from exc
            if rest:
                await self._finish_frame(*self._rest(FrameType.MSG, bufs, rest), msg_id)
            receipt = Receipt(
                self.transport,
                self.lanes,
                nbytes,
                time.perf_counter() - t0,
                "eager",
                not msg.packed and msg.memory == "host",
                msg.memory != "host",
                msg.packed,
                msg.memory,
            )
            _metrics.transferred("send", receipt, tag)
            return receipt
        # its turn now, before any await (a slot): FIFO per tag
        turn = self._order.enter(tag)
        try:
            return await self._send(tag, msg, t0, turn)
        finally:
            turn.passed()  # (a no-op once passed)

    async def _finish_frame(self, rest: list[Buffer], sent: Sent | None, msg_id: int) -> None:
        """The socket took part of a message's one frame: write the rest before any other frame
        (the turn is ours), even if cancelled; a cancelled sender then withdraws the message."""
        self._turn.busy = True  # it was free, and nothing ran since
        self._sending += 1
        try:
            try:
                await self._io.send_rest(rest, sent)
            except PeerDisconnected as exc:
                failure = self._broken_write(exc)
                if failure is None:
                    raise
                raise failure from exc
            finally:
                self._turn.give()
        except asyncio.CancelledError:
            if self.state is ChannelState.OPEN:
                with suppress(Exception):
                    await asyncio.shield(self._write(FrameType.ABORT, msg_id=msg_id))
            raise
        finally:
            self._sending -= 1

    async def _send(self, tag: int, msg: Outgoing, t0: float, turn: Turn) -> Receipt:
        self._sending += 1
        bulk = msg.nbytes > QUICK_BYTES and not msg.on_device
        self._data_out += bulk
        try:
            await turn.wait()
            await self._window.take_slot(tag, self._check_going)
            eager = self._window.reserve(msg.nbytes)
            msg_id = self._next_id
            self._next_id += 1
            segs: list[memoryview | DeviceTensor] = msg.parts() if msg.on_device else list(msg.segments())
            announced: list[bool] = []  # the MSG frame is on the wire: the receiver accounts for it
            header = msg.header
            try:
                if eager:
                    inline = 0 if msg.on_device else min(msg.nbytes, self._frame_bytes())
                    await self._write(
                        FrameType.MSG,
                        meta=header,
                        payload=_slices(segs, 0, inline) if inline else None,  # type: ignore[arg-type]
                        msg_id=msg_id,
                        arg=tag,
                        sent=announced,
                    )
                    turn.passed()
                    await self._send_data(msg_id, segs, inline, msg.nbytes)
                else:
                    cts = self._loop.create_future()
                    self._cts[msg_id] = cts
                    try:
                        await self._write(
                            FrameType.MSG, flags=RENDEZVOUS, meta=header, msg_id=msg_id, arg=tag, sent=announced
                        )
                        turn.passed()
                        await cts
                    finally:
                        self._cts.pop(msg_id, None)
                    await self._send_data(msg_id, segs, 0, msg.nbytes)
            except (asyncio.CancelledError, Exception) as exc:
                # cancelled, or failed part way (a device error copying the tensor out): the
                # receiver, which has the header and perhaps part of the payload, is told the
                # message is withdrawn (ABORT), as for a cancelled send; without it its recv
                # waited for the rest until the channel ended, and the message kept its slot
                if announced:
                    if self.state is ChannelState.OPEN:
                        with suppress(Exception):
                            await asyncio.shield(self._write(FrameType.ABORT, msg_id=msg_id))
                else:
                    self._window.unspend(msg.nbytes, eager)
                if not isinstance(exc, (asyncio.CancelledError, TensorWireError)):
                    raise TransferError(
                        f"the send failed part way ({exc!r}); nothing of it was delivered (the receiver was "
                        "told to drop what it had), and the channel goes on"
                    ) from exc
                raise
        finally:
            self._sending -= 1
            self._data_out -= bulk
        staged = msg.staged or msg.device_bytes  # (device bytes go through pinned chunks of ours)
        receipt = Receipt(
            transport=self.transport,
            lanes=self.lanes,
            nbytes=msg.nbytes,
            seconds=time.perf_counter() - t0,
            protocol="eager" if eager else "rendezvous",
            direct=not msg.packed and not staged,
            staged=staged,
            packed=msg.packed,
            memory=msg.memory,
        )
        _metrics.transferred("send", receipt, tag)
        return receipt

    async def _send_data(self, msg_id: int, segs: list[memoryview | DeviceTensor], start: int, end: int) -> None:
        if any(isinstance(s, DeviceTensor) for s in segs):
            await self._send_parts(msg_id, segs, start, end)
            return
        off = start
        while off < end:
            if off > start:
                await asyncio.sleep(0)  # a socket that never blocks must not starve the loop
            cut = [end]

            def piece(off: int = off, cut: list[int] = cut) -> list[memoryview]:
                # sized once the turn is ours: a small message that went just before counts
                cut[0] = min(off + self._frame_bytes(), end)
                return _slices(segs, off, cut[0])  # type: ignore[arg-type]

            await self._write(FrameType.DATA, payload=piece, msg_id=msg_id, arg=off)
            off = cut[0]

    def _frame_bytes(self) -> int:
        """How much of a host payload the next frame carries: ``chunk_bytes``, or
        ``QUICK_CHUNK`` while small messages go out beside large ones (``QUICK_SECONDS``)."""
        chunk = self._limits.chunk_bytes
        return min(chunk, QUICK_CHUNK) if self._loop.time() < self._quick_until else chunk

    async def _send_parts(self, msg_id: int, parts: list[memoryview | DeviceTensor], start: int, end: int) -> None:
        """DATA frames for a message with device tensors: host parts in ``chunk_bytes`` frames,
        device parts one staging chunk per frame, the device copies running ahead of the socket."""
        chunk = self._limits.chunk_bytes
        pos = 0
        for part in parts:
            n = part.nbytes
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi:
                if isinstance(part, DeviceTensor):
                    gen = stage_out(part.buf, lo - pos, hi - pos, part.ready, self.ended)
                    try:
                        async for off, view in gen:
                            await self._write(FrameType.DATA, payload=[view], msg_id=msg_id, arg=pos + off)
                            await asyncio.sleep(0)
                    finally:
                        await gen.aclose()
                else:
                    for off in range(lo, hi, chunk):
                        piece = part[off - pos : min(off + chunk, hi) - pos]
                        await self._write(FrameType.DATA, payload=[piece], msg_id=msg_id, arg=off)
                        await asyncio.sleep(0)
            pos += n

    # -- receiving --------------------------------------------------------------------------
    async def pull(self, arrival: Arrival) -> None:
        self.check_open()
        if self._waiting.pop(arrival.msg_id, None) is None:
            arrival.pulling = False  # no CTS went out: a later recv must ask for it again
            raise TransferError("rendezvous message is no longer pending")
        self._incoming[arrival.msg_id] = arrival
        # once the message is ours the CTS must go out even if this recv is cancelled: the
        # payload then lands in a buffer of our own and the message is requeued, not lost
        await asyncio.shield(self._write(FrameType.CTS, msg_id=arrival.msg_id))
        if not arrival.done.done():
            await arrival.completed()  # (woken by complete/fail: a loop turn sooner than a shield)
        arrival.done.result()

    def unread(self, arrival: Arrival) -> bool:
        # a rendezvous message matched but not pulled: no CTS went out, so not a byte of its
        # payload comes (into any dest) before a recv pulls it (``pull`` takes it from _waiting)
        return arrival.rendezvous and not arrival.pulling and self._waiting.get(arrival.msg_id) is arrival

    def release(self, arrival: Arrival) -> None:
        self._budget.release(
            arrival.nbytes, not arrival.rendezvous, arrival.tag, schedule=self.state is ChannelState.OPEN
        )

    def _release_express(self, tag: int, nbytes: int) -> None:
        """A recv took a message on ``tag`` delivered express (``Mailbox.deliver``): it came eager."""
        self._budget.release(nbytes, True, tag, schedule=self.state is ChannelState.OPEN)

    def _flush_credit(self) -> None:
        if self.state is ChannelState.OPEN:
            task = self._loop.create_task(self._write(FrameType.CREDIT))
            self._aux.add(task)
            task.add_done_callback(self._aux_done)

    def _aux_done(self, task: asyncio.Task[None]) -> None:
        self._aux.discard(task)
        if not task.cancelled():
            task.exception()  # failures already broke the channel

    async def _read_loop(self) -> None:
        io, limits = self._io, self._limits
        try:
            while True:
                hdr = await io.read_header()
                self._window.grant(hdr.credit, hdr.slots)
                t = hdr.type
                if t is FrameType.MSG:
                    if hdr.meta_len > limits.max_header_bytes:
                        raise ProtocolError(
                            f"message header of {hdr.meta_len} bytes exceeds the {limits.max_header_bytes}-byte limit"
                        )
                    meta = await io.read_exact(hdr.meta_len)
                    tree, specs = decode_header(meta, max_message_bytes=limits.max_message_bytes)
                    rndv = bool(hdr.flags & RENDEZVOUS)
                    arrival = Arrival(
                        self,
                        hdr.arg,
                        tree,
                        specs,
                        msg_id=hdr.msg_id,
                        rendezvous=rndv,
                        protocol="rendezvous" if rndv else "eager",
                    )
                    arrival.landed = 0  # host payloads land in order, marked as they do (read_into)
                    if hdr.payload_len > arrival.nbytes or (rndv and hdr.payload_len):
                        raise ProtocolError(
                            f"MSG frame carries {hdr.payload_len} payload bytes for a {arrival.nbytes}-byte message"
                        )
                    if hdr.msg_id in self._incoming or hdr.msg_id in self._waiting:
                        raise ProtocolError(f"duplicate message id {hdr.msg_id}")
                    self._budget.admit(arrival.nbytes, eager=not rndv, tag=hdr.arg)
                    self._check_summed(hdr.flags)
                    crc = _frames.crc32c(meta, _frames.crc32c(io.last_header)) if self.checksum else 0
                    if rndv:
                        # whole (trailer checked) and pullable before a recv can see it: the
                        # trailer may come later than the header, and a recv matched meanwhile
                        # would pull a message that is not waiting yet
                        await self._check_trailer(crc, arrival)
                        self._waiting[hdr.msg_id] = arrival
                        self.mailbox.arrive(arrival)
                        continue
                    self.mailbox.arrive(arrival)
                    self._incoming[hdr.msg_id] = arrival  # so a failure below fails its recv too
                    if arrival.dest is None:
                        arrival.buffer()  # size checked against credit above (dropped if memory is short)
                    if _on_device(arrival):
                        crc = await self._land(arrival, 0, hdr.payload_len, crc)
                        await self._check_trailer(crc, arrival)
                    else:
                        if hdr.payload_len:
                            crc = await self._read_host(arrival, 0, hdr.payload_len, crc)
                        await self._check_trailer(crc, arrival)
                    arrival.written = hdr.payload_len
                    if arrival.written == arrival.nbytes:
                        del self._incoming[hdr.msg_id]
                        if self._overflows:
                            self._end_overflow(hdr.msg_id)
                        arrival.complete()
                        await _let_recvs_repost(arrival)
                    continue
                if hdr.meta_len:
                    raise ProtocolError(f"{t.name} frame with {hdr.meta_len} metadata bytes")
                if t is FrameType.DATA:
                    target = self._incoming.get(hdr.msg_id)
                    if target is None:
                        raise ProtocolError(f"DATA for unknown message {hdr.msg_id}")
                    if (
                        hdr.arg != target.written
                        or hdr.payload_len == 0
                        or target.written + hdr.payload_len > target.nbytes
                    ):
                        raise ProtocolError(
                            f"DATA at offset {hdr.arg}+{hdr.payload_len} does not continue message {hdr.msg_id}"
                        )
                    self._check_summed(hdr.flags)
                    crc = _frames.crc32c(io.last_header) if self.checksum else 0
                    await self._read_data(target, hdr.payload_len, crc)
                    continue
                if hdr.payload_len:
                    raise ProtocolError(f"{t.name} frame with {hdr.payload_len} payload bytes")
                if t is FrameType.CTS:
                    fut = self._cts.get(hdr.msg_id)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                elif t is FrameType.ABORT:
                    gone = self._incoming.pop(hdr.msg_id, None) or self._waiting.pop(hdr.msg_id, None)
                    if self._overflows:
                        self._end_overflow(hdr.msg_id)
                    if gone is not None:
                        self.mailbox.abort(gone)
                        self.release(gone)
                elif t is FrameType.CREDIT:
                    pass
                elif t is FrameType.BYE:
                    self._shutdown(ChannelState.CLOSED, PeerDisconnected("peer closed the channel"))
                    return
                else:
                    raise ProtocolError(f"unexpected {t.name} frame on an open channel")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._read_failed(exc)

    def _read_failed(self, exc: Exception) -> None:
        """Reading the stream failed (reader task or readable callback): break the channel."""
        if isinstance(exc, ProtocolError):
            log.warning("closing tcp channel %s: %s", self.lanes[0], exc)
        elif isinstance(exc, IntegrityError):
            log.error("closing tcp channel %s: %s", self.lanes[0], exc)
        elif not isinstance(exc, PeerDisconnected):  # a bug must not leave recvs hanging
            log.error("tcp reader failed", exc_info=exc)
            exc = BrokenResourceError(f"tcp reader failed: {exc!r}")
        self._shutdown(ChannelState.BROKEN, exc)

    def _on_frames(self, buf: bytearray, start: int, end: int) -> tuple[int, bool]:
        """The fast path of the read loop, called by the socket's readable callback while the
        reader task waits between frames: take the whole frames at ``buf[start:end]`` that need
        no waiting (an eager message whose payload came with its header, up to ``_FAST_FRAME``
        bytes, CTS and CREDIT) the way the read loop would, so that a small message reaches its
        recv without a trip through the reader task. Returns the new start, and True when the
        reader task must take the frame there: anything else, and any frame that fails a check
        (the task finds the same fault and reports it), decided before anything is changed."""
        limits = self._limits
        mailbox = self.mailbox
        hsize = HEADER.size
        if self.state is not ChannelState.OPEN:
            return start, True
        try:
            while end - start >= hsize:
                try:
                    t, flags, meta_len, payload_len, msg_id, arg, credit, slots = unpack_fields(
                        buf, start, checked=self.checksum
                    )
                except (ProtocolError, IntegrityError):
                    return start, True  # the reader task finds it too, and breaks the channel
                if t is _MSG:
                    if bool(flags & CHECKSUM) != self.checksum or flags & RENDEZVOUS:
                        return start, True
                    size = hsize + meta_len + payload_len + (TRAILER.size if self.checksum else 0)
                    if size > _FAST_FRAME or meta_len > limits.max_header_bytes:
                        return start, True
                    if end - start < size:
                        return start, True  # the reader checks the header now, then waits for the rest
                    meta_end = start + hsize + meta_len
                    try:
                        tree, specs, nbytes = decode_header_sized(
                            bytes(memoryview(buf)[start + hsize : meta_end]), max_message_bytes=limits.max_message_bytes
                        )
                    except ProtocolError:
                        return start, True
                    if payload_len != nbytes or msg_id in self._incoming or msg_id in self._waiting:
                        return start, True  # a message in several frames, or a fault
                    if self.checksum:
                        frame_end = meta_end + payload_len
                        (want,) = TRAILER.unpack_from(buf, frame_end)
                        if _frames.crc32c(memoryview(buf)[start:frame_end]) != want:
                            return start, True
                    dest = None
                    if mailbox.has_posted(arg):
                        dest = mailbox.express_dest(arg, tree, specs)
                        if dest is None:
                            return start, True  # a recv that wants the general path (device, pytree)
                    # accepted: from here on, what the read loop does
                    if credit or slots:
                        self._window.grant(credit, slots)
                    self._budget.admit(nbytes, eager=True, tag=arg)
                    data = memoryview(buf)[meta_end : meta_end + nbytes]
                    if dest is not None:
                        # its slot and credit go back once its recv has taken it
                        release = functools.partial(self._release_express, arg)
                        mailbox.deliver(arg, tree, specs, data, dest, protocol="eager", release=release)
                    else:  # nobody waits: kept here (within the credit) for the next recv
                        arrival = Arrival(self, arg, tree, specs, msg_id=msg_id, nbytes=nbytes)
                        arrival.copied = bool(nbytes)  # out of the read-ahead buffer: not direct
                        arrival.buffer()
                        if nbytes:
                            arrival.fill(data)
                        arrival.complete()
                        mailbox.arrive(arrival)
                    start += size
                elif t is _CTS or t is _CREDIT:
                    if meta_len or payload_len:
                        return start, True
                    if credit or slots:
                        self._window.grant(credit, slots)
                    if t is _CTS:
                        fut = self._cts.get(msg_id)
                        if fut is not None and not fut.done():
                            fut.set_result(None)
                    start += hsize
                else:
                    return start, True
        except Exception as exc:
            self._read_failed(exc)
            return start, True
        return start, False

    def _check_summed(self, flags: int) -> None:
        if bool(flags & CHECKSUM) != self.checksum:
            raise ProtocolError("frame checksum flag does not match what the channel negotiated")

    async def _read_host(self, arrival: Arrival, pos: int, n: int, crc: int) -> int:
        """Read ``n`` payload bytes at ``pos`` into the arrival's host memory (``read_into``);
        the running crc32c over them as they landed (``_Landed``), where the channel checksums."""
        if not self.checksum:
            _read_ahead(arrival, await self._io.read_into(arrival.view, pos, n, arrival.mark))
            return crc
        landed = _Landed(arrival, pos, crc)
        _read_ahead(arrival, await self._io.read_into(arrival.view, pos, n, landed))
        return landed.crc

    async def _check_trailer(self, crc: int, arrival: Arrival) -> None:
        """Check a frame's crc32c trailer against ``crc``, its bytes summed as they landed
        (``_read_host``, ``_land``); IntegrityError if it differs."""
        if not self.checksum:
            return
        if arrival.lost is not None:
            # dropped while the frame was read (a cancelled recv's message with no memory to keep
            # it, ``Arrival._lose``): the rest went to scratch, each piece over the last, and the
            # sum over it means nothing; nothing of it is delivered
            await self._io.read_exact(TRAILER.size)
            return
        (want,) = TRAILER.unpack(await self._io.read_exact(TRAILER.size))
        if want != crc:
            where = "its out= buffer may hold corrupted bytes" if arrival.direct else "nothing was delivered"
            raise IntegrityError(f"crc32c mismatch in message {arrival.msg_id} on {self.lanes[0]}; {where}")

    async def _land(self, arrival: Arrival, start: int, n: int, crc: int) -> int:
        """Read ``n`` payload bytes at ``start`` into a destination that holds device tensors:
        host tensors straight from the socket, device ones through staging chunks whose copies
        to the device overlap the next reads (behind a busy consumer stream, through more chunks
        than the ring: ``_Overflow``). Returns the running crc32c. ``arrival.landed`` counts the bytes
        written or queued to the device, exact wherever the loop runs: a recv cancelled
        meanwhile may move the message to host memory (``Arrival.detach``, with no device
        memory for it), and a chunk read then goes there instead, as does the rest. A copy to
        the device that fails drops this message alone (``_device_failed``)."""
        io = self._io
        pos, end = start, start + n
        arrival.mark(pos)
        while pos < end:
            i, off, left = arrival.locate(pos)
            k = min(end - pos, left)
            dest = arrival.dest
            assert dest is not None
            d = dest[i]
            if isinstance(d, DeviceTensor):
                arrival.staged = True
                try:
                    stage = arrival.land().stage(d)
                    if stage.behind_consumer():
                        # the landing may wait for the consumer's stream from here, with
                        # nothing read meanwhile: the peer's close is watched for apart (from
                        # now till the socket closes: one epoll_ctl, not two a frame)
                        io.watch_hangup(self._peer_hung_up)
                    over = self._overflows.get(arrival.msg_id)
                    if over is not None and over.due(stage):
                        self._overflow(over, arrival, pos, d)
                    if over is not None and over.takes(d):
                        crc = await self._land_overflow(over, arrival, stage, i, off, pos, k, crc)
                    else:
                        crc = await self._land_staged(arrival, stage, i, off, pos, min(k, stage.pool.chunk_bytes), crc)
                except PeerDisconnected:
                    raise
                except Exception as exc:
                    self._device_failed(arrival, exc)
                pos = arrival.landed  # type: ignore[assignment]  # (marked as they land)
                continue
            crc = await self._read_host(arrival, pos, k, crc)
            pos += k
        return crc

    async def _land_staged(self, arrival: Arrival, stage: StageIn, i: int, off: int, pos: int, k: int, crc: int) -> int:
        """``_land`` for one staging chunk's worth: ``k`` bytes at payload offset ``pos`` (at
        ``off`` in device tensor ``i``) read into a chunk of the ring, whose copy up is queued."""
        io, summed, dest = self._io, self.checksum, arrival.dest
        sums = [crc]

        async def fill(view: memoryview, at: int) -> None:
            await io.read_into(lambda o, m: view[o : o + m], 0, len(view))
            if summed:
                sums[0] = _frames.crc32c(view, sums[0])
            if arrival.dest is not dest and _redirect(arrival, pos + at, view):
                raise _Redirected
            arrival.mark(pos + at + len(view))  # (queued before the loop runs again)

        def target() -> Any:
            assert arrival.dest is not None
            return arrival.dest[i].buf  # type: ignore[union-attr]

        try:
            await stage.write(target, off, k, fill)
        except _Redirected:
            return sums[0]  # that chunk went to the host; the rest follows it there
        over = self._overflows.get(arrival.msg_id)
        if stage.behind_consumer():  # its chunk was parked behind the consumer's stream
            if over is None:
                over = self._overflows[arrival.msg_id] = _Overflow()
            over.parked += 1
        elif over is not None:
            over.parked = 0
        return sums[0]

    async def _land_overflow(
        self, over: _Overflow, arrival: Arrival, stage: StageIn, i: int, off: int, pos: int, k: int, crc: int
    ) -> int:
        """``_land`` for up to ``k`` bytes at payload offset ``pos`` (at ``off`` in device tensor
        ``i``) through an overflow chunk: read into a chunk of the pool, its copy up queued at
        once, and the chunk parked behind the consumer's stream (``_Overflow``)."""
        pool = stage.pool
        chunk = await pool.acquire()  # (holding none: each is parked as soon as its copy is queued)
        n = min(k, chunk.size, over.room)
        view = chunk.view[:n]
        try:
            await self._io.read_into(lambda o, m: view[o : o + m], 0, n)
        except BaseException:
            pool.release(chunk)
            raise
        over.room -= n
        if self.checksum:
            crc = _frames.crc32c(view, crc)
        if _redirect(arrival, pos, view):  # a cancelled recv moved the message to the host meanwhile
            pool.release(chunk)
            return crc
        arrival.mark(pos + n)  # (read off the socket: should the copy fail, they are not read again)
        assert arrival.dest is not None
        d = arrival.dest[i]
        assert isinstance(d, DeviceTensor)  # (the caller's, or one of ours that took its place)
        queued = False
        try:
            stage = arrival.land().stage(d)
            stage.lane.to_device(d.buf, off, chunk, 0, n)
            queued = True
            last = stage.mark()
            assert last is not None
            behind = stage.behind_consumer()
        except BaseException:
            hand_back(pool, chunk, None, touched=queued)  # a queued copy may still read it (retired)
            raise
        over.last = last
        if behind:  # (as ``StageIn._give_back``, out of the ring's count: ``_Overflow``)
            pool.park(chunk, last)
        else:
            pool.release(chunk, after=last)
        return crc

    def _overflow(self, over: _Overflow, arrival: Arrival, pos: int, d: DeviceTensor) -> None:
        """Let the rest of ``arrival``'s bytes for ``d``'s device, from payload offset ``pos``,
        go through overflow chunks (``_Overflow``) if the channel's allowance has room for all
        of them; else the message goes on through its staging ring, waiting for its stream."""
        over.refused = True  # asked once per message
        assert arrival.dest is not None
        size = 0
        start = 0
        for t in arrival.dest:
            if isinstance(t, DeviceTensor) and t.engine is d.engine:
                size += max(0, start + t.nbytes - max(start, pos))
            start += t.nbytes
        if size and self._overflowing + size <= self._limits.recv_buffer_bytes:
            self._overflowing += size
            over.engine, over.size, over.room = d.engine, size, size

    def _end_overflow(self, msg_id: int) -> None:
        """``msg_id`` has been read whole, withdrawn or failed: the allowance its overflow holds
        comes back once the copies up from its chunks have run."""
        over = self._overflows.pop(msg_id, None)
        if over is None or not over.size:
            return
        if over.last is None or over.last.query():
            self._overflowing -= over.size
            return
        task = self._loop.create_task(self._overflow_ran(over))
        self._aux.add(task)
        task.add_done_callback(self._aux_done)

    async def _overflow_ran(self, over: _Overflow) -> None:
        assert over.engine is not None and over.last is not None
        try:
            await wait_event(over.engine, over.last)
        except Exception as exc:  # a device error: its copies will not run
            log.warning("overflow copies on %s failed: %r", self.lanes[0], exc)
        finally:
            self._overflowing -= over.size

    def _peer_hung_up(self) -> None:
        """The peer closed the connection (watched for since the reader first had to wait for a
        consumer's stream to land what it read, ``_land``): the close may come after bytes the
        reader cannot read yet, which it would learn of only once the stream frees (at the
        lease, were that later). What ends with the channel ends now (``ended``): a one-sided
        read landing the owner's answer (``_onesided._reply``), a send waiting for its
        producer's stream. The reader goes on when the stream frees, delivering the messages
        that came whole before the close, and shuts the channel at the close itself. A close
        the peer's kernel still holds behind bytes this side has not taken (more than the
        socket buffers hold) is not seen here: the lease tells then."""
        if self.state is ChannelState.OPEN:
            self._ending(PeerDisconnected("peer closed the channel"))

    def _ending(self, exc: BaseException) -> None:
        """Fail ``ended`` (``Channel._ending``), and the sends waiting on the peer with it: for a
        slot, or for the CTS of a rendezvous message (the peer said goodbye, or hung up behind
        bytes not read yet: that CTS will not come, or its payload would go nowhere). Sends that
        begin later raise it, before they wait or send (the fast path falls through: ``SendWindow.end``)."""
        super()._ending(exc)
        if self.state is ChannelState.OPEN:  # (our own close fails them with its own error)
            fail_waiting_sends(self._window, self._cts, exc)

    def _device_failed(self, arrival: Arrival, exc: Exception) -> None:
        """Landing ``arrival`` in device memory failed (a copy the device refused, or no
        page-locked memory for staging): that message is dropped, not the channel, as inproc
        and ucx drop one whose copy up fails. The copies already queued into its device tensors
        come before their streams' next work; the rest of its payload is read into scratch
        (``Arrival.drop``), and the recv that takes it raises TransferError with the cause."""
        log.warning("dropping message %d on %s: %r", arrival.msg_id, self.lanes[0], exc)
        landing = arrival.landing
        for d in arrival.dest or ():
            if landing is not None and isinstance(d, DeviceTensor):
                try:
                    landing.hand_back(d)
                except Exception as again:  # (the device is broken: nothing more to order)
                    log.debug("ordering a failed landing before its stream: %r", again)
        lost = TransferError(
            f"a {arrival.nbytes}-byte message on this tag was dropped: its bytes could not be copied into device "
            f"memory ({exc!r}); the channel and the messages after it go on"
        )
        lost.__cause__ = exc
        arrival.drop(lost)

    async def _read_data(self, arrival: Arrival, n: int, crc: int) -> None:
        start = arrival.written
        if _on_device(arrival):
            crc = await self._land(arrival, start, n, crc)
            await self._check_trailer(crc, arrival)
        else:
            crc = await self._read_host(arrival, start, n, crc)
            await self._check_trailer(crc, arrival)
        arrival.written = start + n
        if arrival.written == arrival.nbytes:
            del self._incoming[arrival.msg_id]
            if self._overflows:
                self._end_overflow(arrival.msg_id)
            arrival.complete()
            await _let_recvs_repost(arrival)

    # -- lifecycle --------------------------------------------------------------------------
    def _shutdown(self, state: ChannelState, exc: BaseException, *, close: bool = True) -> None:
        """Fail what is pending with ``exc``, stop reading, and close the socket (unless not
        ``close``: ``aclose`` lingers on it after its BYE, ``SockIO.linger``)."""
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            return
        self._closed(state, exc)
        self._budget.close()
        self._window.fail(exc)
        self._order.fail(exc)
        for fut in self._cts.values():  # (each a copy of its own: see ``fresh``)
            if not fut.done():
                fut.set_exception(fresh(exc))
                fut.exception()
        for a in [*self._incoming.values(), *self._waiting.values()]:
            a.fail(fresh(exc))
        self._incoming.clear()
        self._waiting.clear()
        self._overflows.clear()  # (their chunks come back to the pool once their copies have run)
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()
        for t in list(self._aux):
            t.cancel()
        if close:
            self._io.close()

    async def aclose(self) -> None:
        if self.state is ChannelState.OPEN:
            self.state = ChannelState.CLOSING
            until = self._loop.time() + BYE_GRACE
            said_bye = False
            try:
                async with asyncio.timeout_at(until):  # (the frames ahead of it on the stream first)
                    await self._turn.take()
                    try:
                        await self._io.send_last([pack(FrameType.BYE, checked=self.checksum)])
                        said_bye = True
                    finally:
                        self._turn.give()
            except Exception:  # the peer may already be gone; closing goes on
                pass
            finally:
                self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel closed"), close=not said_bye)
            if said_bye:  # what is queued for the peer, the BYE last, reaches it (within the grace)
                await self._io.linger(until - self._loop.time())
        if asyncio.current_task() is not self._reader:
            await asyncio.gather(self._reader, return_exceptions=True)

    def abort(self) -> None:
        self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel aborted"))
        self._io.close()  # (an aclose lingering after its BYE: at once)

    def fail(self, exc: BaseException) -> None:
        self._shutdown(ChannelState.BROKEN, exc)
