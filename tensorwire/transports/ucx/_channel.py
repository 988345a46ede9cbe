"""The UCX channel: tagged messages over ucp tag send/recv, one-sided put/get over rkeys.

Wire mapping (UCX tag matching is per worker, so every tag carries the receiver's channel key):

::

    64-bit UCX tag = key (32 bits, chosen by the receiving side) | kind (4) | sequence (28)
    kind CTRL: the channel's control stream, one receive always posted: 48-byte frames of
               tensorwire's staged-TCP format (_frames.py): MSG (message header; small
               payloads ride inline), CTS, ABORT, CREDIT, BYE; credit piggybacked on each
    kind DATA: a message's payload, sequence = message id, one UCX message per tensor

A message within the receiver's credit goes *eager*: the sender posts the MSG frame and the
payload sends back to back. When the MSG arrives the receiver announces it to the mailbox
first; if a recv with ``out=`` is posted, that recv's task posts the payload receives straight
into ``out=`` (``pull``), so UCX's own rendezvous moves large tensors zero-copy into the
caller's buffer; if no recv is posted, the payload lands in a buffer of tensorwire's own at once
(bounded by the credit). A message beyond the credit goes *rendezvous*: the payload waits in the
sender's memory until the receiver's recv posts its receives and sends CTS. Payloads of at most
8 KiB ride inside the MSG frame (one UCX message per tensorwire message).

Cancellation: UCX cannot take back a tag receive that has matched, so a recv cancelled while
UCX writes into its ``out=`` lets that write finish before the cancellation takes effect (the
message is then requeued whole and delivered to the next recv). A send cancelled after its
payload was handed to UCX likewise finishes first (UCX cannot recall a send), so the message
arrives whole; one cancelled before that (waiting for CTS, or for its producer stream's event
before device memory is posted) sends ABORT and never arrives.

CUDA memory (where this UCX has cuda transports): payload sends and receives are posted with
the device pointers themselves, so UCX moves them over cuda_copy / cuda_ipc (or GPUDirect
lanes); the lanes say which. A send posts only after the producer stream's event has
completed; a receive posts only after the consumer stream's work on the destination has, and
UCX completes it once the bytes are in place. Without cuda transports, device tensors are
staged through host memory first (``Outgoing.to_host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..._loops import wait_out
from ...errors import (
    BrokenResourceError,
    ClosedResourceError,
    PeerDisconnected,
    ProtocolError,
    TensorWireError,
    TransferError,
)
from ...memory import wait_event
from ...tensors import DeviceTensor, Outgoing, byte_view, decode_header_sized
from ...tensors._offload import copy_host_soon
from .._base import BYE_GRACE, Channel, ChannelState, Limits, Receipt, fresh, still_writing, unsettled
from .._credit import ReceiveBudget, SendWindow, fail_waiting_sends
from .._frames import CHECKSUM, HEADER, MAGIC, RENDEZVOUS, FrameType, PeerLimits, pack, unpack_fields
from .._mailbox import Arrival, _settle
from .._order import SendOrder, Turn
from . import _ucp
from ._lanes import kernel_copy, one_sided_direct
from ._process import ProcessId, visible
from ._ucp import UCS_INPROGRESS, RemoteKey, Ucp
from ._worker import RawRecv, Worker

log = logging.getLogger(__name__)

__all__ = ["CTRL", "DATA", "HELLO", "WELCOME", "UcxChannel", "ctrl_bytes", "make_tag"]

HELLO, WELCOME, CTRL, DATA = 1, 2, 3, 4
_SEQ = (1 << 28) - 1
# The most payload a MSG frame carries (Limits.inline_bytes, 64 KiB by default, up to this): one
# control frame instead of a frame and a payload receive the receiver posts, which cost 16-64 KiB
# messages about 100 us more a transfer here than the <= 8 KiB ones (the old bound) took.
# Control frames go with fast completion, eager up to 256 KiB-1 (UCX_PROTO_INFO): a frame stays
# eager. Above 64 KiB the frame's two extra copies cost a stream of messages more than they save
# (128 KiB: 0.84-0.90x of eager's GB/s in `tensorwire bench`; 64 KiB: 1.0-1.7x of it, four runs).
# See docs/benchmarks.md, "ucx_seq.py".
_INLINE_MAX = 64 * 1024
_HEADER = HEADER.size  # (module constants: the per-message paths look them up once per frame)
_MSG = FrameType.MSG
_UNPACK = HEADER.unpack_from
_TYPE_OF = {int(t): t for t in FrameType}
_FLAGS = RENDEZVOUS | CHECKSUM  # the flag bits a frame may carry (``unpack_fields``)
_CTRL_BURST = 64  # control frames taken in one go when they are already waiting
_INLINE_STREAK = 16  # operations finished inline in a row (one-sided ones, recvs) before the loop turns
_ANSWER_WINDOW = 200e-6  # a recv this soon after our last frame may wait inline for the answer
_WAIT_INLINE = 50e-6  # for at most this long
_WAIT_BACKOFF = 1024  # recvs without an inline wait after repeated failures, at most
_LAND_INLINE = 256 * 1024  # an answer's payload up to this size is also waited for inline (once)
# a payload segment at least this large (and a get or put) is asked which protocol UCX
# selected for it (``Ucp.request_route``): UCX writes its answer out as text, 5-8 us a request
# on a 2-core VM under load (8.5-10.6 us read back), under 2% of a 4 MiB send over cma there but
# 4-5% of a 64 KiB round trip, so smaller ones keep the endpoint's lanes (docs/ucx.md)
_ROUTE_FROM = 4 << 20
# how long a failed message waits for the UCX receives still landing its payload (cancelled, but
# one that has matched runs on until its transfer ends) before its recv is told anyway, with a
# warning that its buffer may still be written (a transfer from a peer that stopped mid-way)
_LANDING_GRACE = 2.0
# A get or put larger than _RMA_PIECE goes to UCX as pieces of that size, _RMA_AHEAD of them
# posted at a time, where the endpoint moves them without the owner (cma, RDMA). UCX serves an
# endpoint's one-sided operations in the order they were posted (over cma one 512 KiB segment
# per progress round, the next operation only when the one before has ended), so a small read
# posted behind a whole 256 MiB get waited for all of it (40 ms; 0.2-0.7 s behind 1 GiB); behind
# pieces it waits for the two posted ahead of it (docs/benchmarks.md, ucx_hol.py). Over emulated
# lanes (tcp) each piece waits on the owner's loop as well, and that trade is not measured yet.
_RMA_PIECE = 16 << 20
_RMA_AHEAD = 2
# A BYE's arg: the peer aborted or failed its channel (abort, fail), and this side's channel
# breaks (PeerDisconnected), as a tcp channel does when its peer's connection drops; a BYE
# without it is an orderly close, which closes this side too. (A node that does not know it
# reads any BYE as a close.)
_BYE_FAILED = 1


def _wire_bytes(part: np.ndarray | memoryview) -> np.ndarray | memoryview:
    """A buffer ``bytes.join`` can take: an array of numpy's own dtypes as it is, other arrays
    (bfloat16 and kin cannot export a buffer) as a byte view."""
    if type(part) is np.ndarray and part.dtype.isbuiltin != 1:
        return byte_view(part)
    return part


@functools.cache
def _array() -> Any:
    """ucxx's buffer wrapper class (imported once: an import statement per message costs)."""
    from ucxx._lib.arr import Array

    return Array


def make_tag(key: int, kind: int, seq: int = 0) -> int:
    return (key << 32) | (kind << 28) | (seq & _SEQ)


def inline_limit(limits: Limits) -> int:
    return min(limits.inline_bytes, _INLINE_MAX)


def ctrl_bytes(limits: Limits) -> int:
    """Size of the control receive buffer: the largest frame this side accepts."""
    return HEADER.size + limits.max_header_bytes + inline_limit(limits)


class _CudaBytes:
    """``nbytes`` bytes of device memory at ``ptr`` in the CUDA array interface, for ucxx.

    (A torch tensor's own interface refuses bfloat16, and reports a stream to synchronize;
    the stream ordering is done here, with events, before the pointer reaches UCX.)
    """

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, t: DeviceTensor) -> None:
        self.owner = t.buf.owner
        self.__cuda_array_interface__ = {
            "shape": (t.nbytes,),
            "typestr": "|u1",
            "data": (t.buf.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _payload(part: memoryview | DeviceTensor | np.ndarray) -> Any:
    if isinstance(part, DeviceTensor):
        return _CudaBytes(part)
    if isinstance(part, np.ndarray):
        return byte_view(part)
    return part


def _busy_streams(arrival: Arrival) -> list[tuple[Any, Any]]:
    """The consumer streams of ``arrival``'s device destinations that still have work queued
    (UCX writes outside every stream), as (engine, event recorded on it now); each event asked
    once. A stream with nothing queued (the common case) is done by then: [] then, and the
    payload receive may be posted at once."""
    return [
        (t.engine, event)
        for t in arrival.dest or ()
        if isinstance(t, DeviceTensor) and t.stream is not None
        for event in (t.engine.record_on(t.stream),)
        if not event.query()
    ]


async def _targets_ready(arrival: Arrival) -> None:
    """Wait (on the host, without blocking the loop) for the consumer streams' work on the
    device destinations of ``arrival``: UCX writes outside every stream. Cut short when
    ``arrival`` fails meanwhile (its channel closed or broke: the streams may stay busy for long,
    and nobody waits for them any more), raising that failure."""

    # without a turn of the loop where the streams are idle (``_busy_streams``): the task below
    # costs a few turns, on the first H200 run 173 us (median) of every CUDA receive's time
    # between its message and its UCX receive, for event waits of 4 us
    pending = _busy_streams(arrival)
    if not pending:
        return

    async def streams() -> None:
        for engine, event in pending:
            await wait_event(engine, event)

    ready = asyncio.ensure_future(streams())
    try:
        await asyncio.wait((ready, arrival.done), return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()  # a no-op once it is done
    if ready.done() and not ready.cancelled():
        ready.result()
        return
    arrival.done.result()  # raises the message's failure
    raise TransferError("message ended before its device destination was ready")


def _late(exc: BaseException, text: str) -> BaseException:
    """``exc`` (a channel's failure) told with ``text``, of the same type where it can be."""
    try:
        late = type(exc)(text)
    except Exception:
        late = TransferError(text)
    late.__cause__ = fresh(exc)  # (the failure is told to many: each its own copy, see ``fresh``)
    return still_writing(late)  # (a cancelled operation raises it: its buffer is not the caller's yet)


def _unsent(exc: BaseException) -> BaseException:
    """``exc`` (a channel's failure) told to a send whose payload UCX had not finished sending:
    UCX cannot take it back, and a peer that only stopped may still read it (``_late``)."""
    return _late(
        exc,
        f"{exc} (UCX had not finished sending the message: the peer, if it only stopped, may "
        "still read its tensors from this process's memory and receive them, so do not change them)",
    )


def _landed(arrival: Arrival) -> None:
    """``arrival``'s payload is whole in its ``dest``: nothing is left for a recv to pull. (A recv
    cancelled after the message was received into its out= gives the message back in a buffer
    of ours; the next recv must copy from there, not take its own out= for the destination.)"""
    arrival.rendezvous = False
    arrival.complete()


def _on_device(arrival: Arrival) -> bool:
    """Whether ``arrival`` lands bytes in device memory (an empty device tensor takes none)."""
    return arrival.dest is not None and any(isinstance(d, DeviceTensor) and d.nbytes for d in arrival.dest)


async def _settled(fut: asyncio.Future[None]) -> bool:
    """Wait until ``fut`` is done, also when cancelled meanwhile (UCX cannot take back a get or
    put); True if a cancellation came."""
    try:
        await wait_out(fut)
    except asyncio.CancelledError:
        return True
    return False


_Route = tuple[str, tuple[str, ...]]  # a protocol UCX selected and its lanes (Receipt.route)


def _asked(routes: list[_Route] | None, ucp: Ucp, req: int | None, ask: bool) -> list[_Route] | None:
    """``routes`` with what UCX selected for ``req`` added (``Ucp.request_route``: asked before
    anything can free the request); None once one part's is not known: not asked (``ask``
    false: a small one), no request (UCX finished it within the call), or no answer."""
    if routes is None:
        return None
    route = ucp.request_route(req) if req is not None and ask else None
    if route is None:
        return None
    if route not in routes:
        routes.append(route)
    return routes


def _joined(routes: list[_Route] | None) -> _Route | None:
    """One transfer's route (``Receipt.route``) from those UCX said for its parts: their
    protocols and their lanes, each once; None where a part's is not known (``routes`` is None)
    or nothing was asked."""
    if not routes:
        return None
    if len(routes) == 1:
        return routes[0]
    lanes = dict.fromkeys(lane for _, ls in routes for lane in ls)
    return "; ".join(dict.fromkeys(r for r, _ in routes)), tuple(lanes)


class _Transfer:
    """Payload receives posted for one message; completes its arrival when all have landed."""

    __slots__ = ("arrival", "failure", "pending", "reqs", "taken_back")

    def __init__(self, arrival: Arrival) -> None:
        self.arrival = arrival
        self.failure: BaseException | None = None  # its arrival failed: told once UCX is done
        self.pending = 0
        self.reqs: list[Any] = []
        self.taken_back = False  # its receives were cancelled unmatched (``take_back``): not its message's end


class _Arrival(Arrival):
    """A message of this channel's. Its failure (the channel shut or broke, the sender aborted,
    a receive failed) reaches its recv only once the UCX receives landing its payload in
    ``dest`` (perhaps the recv's out=) have ended: UCX cannot take back a receive that has
    matched, and a recv must not return while its buffer may still be written."""

    __slots__ = ("transfer",)

    def __init__(self, channel: UcxChannel, *args: Any, **kwargs: Any) -> None:
        super().__init__(channel, *args, **kwargs)
        self.transfer: _Transfer | None = None  # its payload receives, once posted

    def fail(self, exc: BaseException) -> None:
        t = self.transfer
        if t is None or self.done.done() or all(r.completed for r in t.reqs):
            super().fail(exc)
        else:
            self.channel._fail_when_landed(t, exc)  # type: ignore[attr-defined]


class UcxChannel(Channel):
    transport = "ucx"
    # one-sided operations take any pointer (UCX finds its memory type): device memory of the
    # kinds in ``device_kinds`` is posted as it is
    rma_device = True

    def __init__(
        self,
        worker: Worker,
        ucp: Ucp | None,
        ep: Any,
        *,
        rx_key: int,
        tx_key: int,
        limits: Limits,
        remote: PeerLimits,
        remote_ctrl: int,
        name: str,
        cuda: bool = False,
        peer_process: ProcessId | None = None,
    ) -> None:
        super().__init__()
        if cuda:
            self.device_kinds = frozenset({"cuda"})
        self._w = worker
        self._lib = worker.lib
        self._ucp = ucp
        self._ep = ep
        self._rx_key = rx_key
        self._tx_key = tx_key
        self._limits = limits
        self._remote = remote
        self._remote_ctrl = remote_ctrl
        self._remote_room = remote_ctrl - HEADER.size  # header and payload bytes a frame may carry
        self._inline = inline_limit(limits)
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._ctrl_tag = self._lib.UCXXTag(make_tag(tx_key, CTRL))
        self._ctrl_tag_value = make_tag(tx_key, CTRL)
        self._ep_handle = int(ep.handle)
        self._rx_ctrl_tag = self._lib.UCXXTag(make_tag(rx_key, CTRL))
        self._rx_ctrl_tag_value = make_tag(rx_key, CTRL)
        self._ctrl_buf = np.empty(ctrl_bytes(limits), np.uint8)
        self._ctrl_ptr = self._ctrl_buf.ctypes.data
        self._ctrl_room = self._ctrl_buf.nbytes - HEADER.size
        self._ctrl_mv = memoryview(self._ctrl_buf.data)
        self._ctrl_arr: Any = None
        self._ctrl_posted = False
        self._peer_failures = _ucp.peer_failures_survived  # failures seen before this channel
        self._peer_said_bye = False  # (the channel shuts once the transfers in flight have ended)
        self._last_send = 0.0  # when this side last sent a frame (an answer may be due)
        self._wait_penalty = 0  # recvs to skip inline waits for after the next failed one
        self._wait_skip = 0  # recvs that still skip it
        # what we may still send: the receiver's grants, the last eighth of the credit kept for
        # small messages (a ping beside 64 MiB eager sends went rendezvous: see SendWindow)
        self._window = SendWindow(remote, keep_for_small=True)
        self._next_id = 1
        self._cts: dict[int, asyncio.Future[None]] = {}
        self._seqs: set[int] = set()  # DATA tag sequences of the payloads of ours not sent yet
        self._order = SendOrder()  # FIFO per tag, however long a send waits to post
        self._sending = 0
        self._budget = ReceiveBudget(limits, self._flush_credit)  # what the peer holds of our grants
        self._waiting: dict[int, tuple[Arrival, bool]] = {}  # msg id -> (arrival, needs CTS)
        self._incoming: dict[int, _Transfer] = {}
        # msg id -> the scratch receives of a message discarded (``discard``) whose payload may
        # yet come (its sender's ABORT, crossing our CTS, cancels them)
        self._discarding: dict[int, list[Any]] = {}
        # their owner to the worker (``Worker.watch``): not the channel's, so that its shutdown
        # (``abandon``) leaves them posted, and the endpoint's close waits for them first
        self._discards = object()
        self._eager: set[Arrival] = set()  # arrivals that spent buffer credit
        self._futs: set[asyncio.Future[Any]] = set()
        self._rma_futs: set[asyncio.Future[None]] = set()  # one-sided requests waited for
        self._rma_shut: set[asyncio.Future[None]] = set()  # those the channel's shutdown caught
        self._rkeys: set[RemoteKey] = set()
        self._closed_ev = asyncio.Event()
        # resolved once UCX has let go of the endpoint (``settled``, ``Worker.close_endpoint``)
        self._ep_released: asyncio.Future[None] | None = None
        self.lanes = self._query_lanes()
        # whether a get/put reaches the peer's memory without its CPU (a cma or RDMA lane), or
        # UCX emulates it and the peer's worker serves it (the receipts say which)
        self.one_sided_direct = one_sided_direct(self.lanes)
        # the peer's process where it runs on this machine, over any lanes: the worker gives the
        # CPU up to it when it waits for the CPU the worker spins on (see _worker._YIELD_AFTER)
        self._neighbour = visible(peer_process)
        # the peer's process, whose certain end lets the worker free the payloads of this
        # channel's sends that UCX never completes (Worker.sweep). Only over a lane that copies
        # in the kernel (cma, knem): there a rendezvous payload is copied by the receiver, or by
        # the kernel for this node (process_vm_writev, which fails cleanly on memory that has
        # gone); over the others (xpmem, tcp, shared-memory FIFOs alone) a request for the data
        # that the peer sent before it died would make UCX copy from there by hand. Such a
        # request still queued here when the peer died is taken before the sweep lets go
        # (a progress run that found nothing to do, after the end was seen), and nothing comes
        # from the peer after that (and one this process can see: see _process.visible)
        self.payload_peer = self._neighbour if kernel_copy(self.lanes) else None
        if self._neighbour is not None:
            worker.neighbour(self._neighbour)
        # posted from the loop, once the transport has taken the channel (its close callbacks): a
        # frame already waiting completes the receive at once and is handled then (a BYE would
        # shut a channel nobody had registered with yet)
        self._loop.call_soon(self._post_ctrl_recv)

    def __repr__(self) -> str:
        return f"<UcxChannel {self.name} [{', '.join(self.lanes)}] {self.state.value} in_flight={self.in_flight}>"

    def _query_lanes(self) -> tuple[str, ...]:
        if self._ucp is None:
            return ("ucx",)
        try:
            pairs = self._ucp.ep_transports(self._ep.handle)
        except Exception as exc:
            log.debug("ucp_ep_query failed: %s", exc)
            return ("ucx",)
        return tuple(dict.fromkeys(f"{t}/{d}" for t, d in pairs)) or ("ucx",)

    @property
    def in_flight(self) -> int:
        return self.mailbox.in_flight + self._sending

    @property
    def endpoint_handle(self) -> int:
        """The raw ``ucp_ep_h`` of this channel (for the one-sided bindings)."""
        return self._ep_handle

    # -- UCX plumbing -------------------------------------------------------------------------
    def _error(self, exc: BaseException, what: str) -> BaseException:
        """A ucxx exception as a tensorwire one (never let a UCXXError reach a user)."""
        text = f"ucx {what} failed: {exc}"
        low = str(exc).lower()
        if "cancel" in low and self.mailbox.failure is not None:
            return fresh(self.mailbox.failure)  # cancelled because the channel closed or failed
        if any(w in low for w in ("reset", "connect", "timeout", "unreachable")):
            return PeerDisconnected(text)
        if "input/output" in low and _ucp.peer_gone_since(self._peer_failures):
            # a transfer to a dead process failed (see _ucp._on_ucx_log): the peer is gone
            return PeerDisconnected(f"{text} (the peer process is gone)")
        return TransferError(text)

    def _check(self, req: Any, what: str) -> BaseException | None:
        try:
            req.check_error()
        except Exception as exc:
            return self._error(exc, what)
        return None

    def _send_frame(self, frame: bytes | np.ndarray) -> bool:
        """Post one control frame; frames go out in the order they are posted (one endpoint:
        UCX keeps the order of its tag sends, whichever API posted them). False if UCX refused
        it at once (a peer whose shared memory has gone): the channel is broken then, and the
        frame never left."""
        self._last_send = time.perf_counter()
        if self._ucp is not None:
            # straight to ucp_tag_send_nbx: a small frame is usually sent when the call
            # returns, without the request object, array wrapper and watch of ucxx's tag_send
            data = frame if type(frame) is bytes else bytes(frame)
            try:
                req = self._ucp.tag_send(self._ep_handle, data, self._ctrl_tag_value)
            except TensorWireError as exc:
                self._shutdown(ChannelState.BROKEN, exc)
                return False
            if req is not None:
                fut = self._w.watch_raw(self._ucp, req, data, owner=self, what="ucx control send")
                fut.add_done_callback(self._ctrl_sent_raw)
            return True
        req = self._ep.tag_send(self._lib_array(frame), self._ctrl_tag)
        if req.completed:
            err = self._check(req, "control send")
            if err is not None:
                self._shutdown(ChannelState.BROKEN, err)
                return False
            return True
        self._w.watch(req, self._ctrl_sent, keep=frame, owner=self)
        return True

    def _ctrl_sent(self, req: Any) -> None:
        err = self._check(req, "control send")
        if err is not None and self.state is ChannelState.OPEN:
            self._shutdown(ChannelState.BROKEN, err)

    def _ctrl_sent_raw(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        err = fut.exception()
        if err is not None and self.state is ChannelState.OPEN:
            self._shutdown(ChannelState.BROKEN, err)

    def _lib_array(self, buf: Any) -> Any:
        return _array()(buf)

    def _frame(
        self,
        ftype: FrameType,
        *,
        flags: int = 0,
        meta_len: int = 0,
        payload_len: int = 0,
        msg_id: int = 0,
        arg: int = 0,
    ) -> bytes:
        credit, slots = self._budget.take_returns()
        return pack(ftype, flags, meta_len, payload_len, msg_id, arg, credit, slots)

    # -- sending ------------------------------------------------------------------------------
    async def send(self, tag: int, msg: Outgoing) -> Receipt:
        # (not while an earlier send on the tag has yet to post its MSG frame: it goes first)
        if (
            self.state is ChannelState.OPEN
            and not msg.on_device
            and msg.nbytes <= self._inline
            and not self._order.busy(tag)
        ):
            receipt = self._send_inline(tag, msg)
            if receipt is not None:
                return receipt
        return await self._send(tag, msg)

    def _send_inline(self, tag: int, msg: Outgoing) -> Receipt | None:
        """The small-message path: one control frame carries header and payload, and nothing
        waits (a slot and the credit are at hand). None when the general path must decide."""
        t0 = time.perf_counter()
        nbytes = msg.nbytes
        window = self._window
        header = msg.header
        n = len(header)
        if (
            not window.has_slot(tag)
            or not window.fits(nbytes)
            or n > self._remote.max_header_bytes
            or n + nbytes > self._remote_room
            or nbytes > self._remote.max_message_bytes
        ):
            return None
        window.slots -= 1
        window.credit -= nbytes
        msg_id = self._next_id
        self._next_id += 1
        if not self._send_inline_frame(tag, msg_id, header, msg.arrays, nbytes):  # type: ignore[arg-type]  # host
            self.check_open()  # (UCX refused the frame: the channel broke, and says why)
        return self._send_receipt(msg, "inline" if nbytes else "eager", t0, tag)  # as the receiver names it

    def _send_inline_frame(
        self, tag: int, msg_id: int, header: bytes, parts: list[np.ndarray] | list[memoryview], nbytes: int
    ) -> bool:
        """One MSG frame carrying the header and the payload: host arrays or byte views, whose
        bytes are copied once, into the frame. False if UCX refused it (``_send_frame``)."""
        credit, slots = self._budget.take_returns()
        frame = pack(_MSG, 0, len(header), nbytes, msg_id, tag, credit, slots)
        return self._send_frame(b"".join([frame, header, *map(_wire_bytes, parts)]))  # type: ignore[list-item, unused-ignore]  # numpy < 2.5

    async def _send(self, tag: int, msg: Outgoing) -> Receipt:
        # its turn now, before any await (staging device memory, a slot): FIFO per tag
        turn = self._order.enter(tag)
        try:
            return await self._send_in_turn(tag, msg, turn)
        finally:
            turn.passed()  # (a no-op once passed)

    async def _send_in_turn(self, tag: int, msg: Outgoing, turn: Turn) -> Receipt:
        self.check_open()
        header = msg.header
        self._remote.check_send(msg.nbytes, len(header), self._remote_ctrl - HEADER.size)  # and its ctrl buffer
        t0 = time.perf_counter()
        await self.stage_device(msg)  # no cuda transports in this UCX: through host memory
        self._sending += 1
        seq: int | None = None  # the DATA tag's sequence this message's payload holds
        try:
            await turn.wait()
            await self._window.take_slot(tag, self._check_going)
            nbytes = msg.nbytes
            eager = self._window.reserve(nbytes)
            segs: list[memoryview | DeviceTensor] = msg.parts() if msg.on_device else list(msg.segments())
            route: _Route | None = None
            inline = (
                not msg.on_device
                and eager
                and nbytes <= self._inline
                and HEADER.size + len(header) + nbytes <= self._remote_ctrl
            )
            msg_id = self._next_id
            if not inline:
                # its payload goes on the DATA tag of the id's low 28 bits (``make_tag``): not one
                # a payload of ours still holds (a rendezvous message waiting for its CTS, for
                # as long as its tag is not read), which 2**28 messages later a namesake's would
                # share: UCX matched that one's payload to the receive posted for the other
                while (msg_id & _SEQ) in self._seqs:
                    msg_id += 1
                seq = msg_id & _SEQ
                self._seqs.add(seq)
            self._next_id = msg_id + 1
            if inline:
                posted = self._send_inline_frame(tag, msg_id, header, segs, nbytes)  # type: ignore[arg-type]
                turn.passed()
                if not posted:
                    self.check_open()  # (UCX refused the frame: the channel broke, and says why)
                protocol = "inline" if nbytes else "eager"  # as the receiver names it
            elif eager:
                self._send_frame(self._frame(FrameType.MSG, meta_len=len(header), msg_id=msg_id, arg=tag) + header)
                turn.passed()
                route = await self._send_payload(msg_id, segs)
                protocol = "eager"
            else:
                cts = self._loop.create_future()
                self._cts[msg_id] = cts
                try:
                    self._send_frame(
                        self._frame(FrameType.MSG, flags=RENDEZVOUS, meta_len=len(header), msg_id=msg_id, arg=tag)
                        + header
                    )
                    turn.passed()
                    await cts
                except asyncio.CancelledError:
                    if self.state is ChannelState.OPEN:
                        self._send_frame(self._frame(FrameType.ABORT, msg_id=msg_id))
                    raise
                finally:
                    self._cts.pop(msg_id, None)
                route = await self._send_payload(msg_id, segs)
                protocol = "rendezvous"
        finally:
            self._sending -= 1
            if seq is not None:
                self._seqs.discard(seq)
        receipt = self._send_receipt(msg, protocol, t0, tag)
        if route is not None:
            receipt.route, receipt.lanes = route
        return receipt

    async def _send_payload(self, msg_id: int, segs: list[memoryview | DeviceTensor]) -> _Route | None:
        """Hand every segment to UCX, then wait for all of them; the protocol UCX says it selected
        and its lanes (``Receipt.route``; None where it does not say). UCX cannot recall a send, so a
        cancellation waits for the payload to finish moving and then takes effect. Device
        segments are posted once their producers' events have completed. Cancelled (or failed)
        while it waits for those, it has posted nothing: its receiver, which has the header, is
        told (ABORT) that no payload will come. The channel closing or breaking ends that wait
        (``ended``): the send fails as it would have had the channel closed before it began."""
        try:
            for s in segs:
                if isinstance(s, DeviceTensor) and s.ready is not None:
                    await wait_event(s.engine, s.ready, self.ended)
        except BaseException:
            if self.state is ChannelState.OPEN:
                self._send_frame(self._frame(FrameType.ABORT, msg_id=msg_id))
            raise
        self.check_open()
        if self._ucp is None:
            await self._send_payload_ucxx(msg_id, segs)
            return None
        # straight to ucp_tag_send_nbx, as control frames go: the worker keeps each request and
        # its segment until UCX completes it, or until the worker is destroyed. A ucxx request
        # is kept by its endpoint and keeps the endpoint in turn: a send to a peer that died
        # never completes, and that cycle kept the node's UCX worker (its listening sockets,
        # descriptors and shared memory) after the node closed
        ucp, w, ep = self._ucp, self._w, self._ep_handle
        tag = make_tag(self._tx_key, DATA, msg_id)
        array = _array()
        reqs: list[int] = []  # those UCX did not complete at once, to wait for in order
        routes: list[_Route] | None = []  # None: a segment's is not known
        cancelled = False
        try:
            for s in segs:
                a = array(_payload(s))  # (its address, as ucxx would post it; host or device)
                req = ucp.tag_send_at(ep, a.ptr, a.nbytes, tag)
                if a.nbytes:  # (a small segment, or one UCX sent within the call: no route)
                    routes = _asked(routes, ucp, req, a.nbytes >= _ROUTE_FROM)
                if req is not None:
                    w.keep_raw(ucp, req, s, self)
                    reqs.append(req)
            for i, req in enumerate(reqs):
                if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
                    # it shut while this waited for the one before (a close under way waits for
                    # this send: UCX has taken every segment). This one and those after it were
                    # with UCX then (the shutdown let go of them: not to be asked about any
                    # more): the peer, if it only stopped, may still read them, and the failure
                    # says so, as for a send the shutdown caught in its wait (it said "channel
                    # aborted", as if the tensors were the caller's to change again)
                    raise _unsent(self.mailbox.failure or ClosedResourceError(f"ucx channel is {self.state.value}"))
                fut = w.wait_raw(req, "ucx payload send")
                reqs[i] = 0  # (the worker's now, or freed)
                if fut is None:
                    continue
                # a Pledge: a cancel comes once UCX is done with the segment, and goes on to
                # the next one while the channel is open
                cancelled = await self._outlast(fut) or cancelled
        except BaseException:
            # the sends not waited for go on all the same: the worker keeps them and their
            # segments until UCX is done with them (or the worker closes)
            w.drop_raw([r for r in reqs if r])
            raise
        if cancelled:
            raise asyncio.CancelledError
        return _joined(routes)

    async def _send_payload_ucxx(self, msg_id: int, segs: list[memoryview | DeviceTensor]) -> None:
        """``_send_payload``'s sends through ucxx, where the libucp bindings did not load."""
        tag = self._lib.UCXXTag(make_tag(self._tx_key, DATA, msg_id))
        reqs = [(self._ep.tag_send(self._lib_array(_payload(s)), tag), s) for s in segs]
        cancelled = False
        req: Any = None
        try:
            for i, (req, seg) in enumerate(reqs):
                if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
                    # it shut while this waited for the segment before (as ``_send_payload``
                    # looks): a wait registered now would be on a request the shutdown had let
                    # go of (``Worker.abandon``), which nothing resolves (a stopped peer's: for
                    # good). A close under way waits for this send: UCX has taken every segment
                    if all(r.completed for r, _ in reqs[i:]):
                        self.check_open()
                    raise _unsent(self.mailbox.failure or ClosedResourceError(f"ucx channel is {self.state.value}"))
                cancelled |= await self._wait(req, seg, "payload send")
        except BaseException:
            # the sends not waited for yet go on all the same: they and their segments stay
            # with the worker until UCX is done with them (or the worker closes)
            for r, s in reqs:
                self._w.hold(r, s)
            raise
        finally:
            # a failure's traceback keeps this frame, and a program may keep the failure (a
            # task's exception, a retry loop's last error): not the requests, each of which
            # holds the node's UCX worker, its listening sockets and shared memory, after the
            # node has closed
            reqs.clear()
            req = None
        if cancelled:
            raise asyncio.CancelledError

    async def _outlast(self, fut: asyncio.Future[Any]) -> bool:
        """Wait for ``fut``, a request UCX cannot take back, to end, whatever cancellations come
        meanwhile (``wait_out``); True if one came while the channel was open (the caller raises
        it once it is done). Its failure is raised (the channel's shutdown fails it with its
        error). A cancel that comes while the channel closes or has shut is raised once the wait
        has ended: as the failure the shutdown gave it, where that says the peer may still read
        the payload (``unsettled``), else as the cancel."""
        self._futs.add(fut)
        cancelled = False
        try:
            try:
                await wait_out(fut)
            except asyncio.CancelledError:
                if self.state is not ChannelState.OPEN:
                    late = unsettled([None if fut.cancelled() else fut.exception()])
                    if late is not None:  # (the peer may still read the payload: say so)
                        raise late from late.__cause__  # (its own cause: the channel's failure)
                    raise
                cancelled = True
            fut.result()  # (the channel's shutdown fails it: raised)
        finally:
            self._futs.discard(fut)
            del fut  # (its result is the request, which keeps the worker: not in a kept traceback)
        return cancelled

    async def _wait(self, req: Any, keep: object, what: str) -> bool:
        """Wait for one request UCX cannot take back (a payload send) to end, whatever
        cancellations come meanwhile, as ``_send_payload`` waits for its segments; True if one
        came while the channel was open. Its failure is raised (the channel's shutdown fails the
        wait with its error). A cancel that comes while the channel closes or has shut is raised
        once the wait has ended: as the failure the shutdown gave it, where that says the peer
        may still read the payload (``unsettled``), else as the cancel. (It was raised at once,
        bare, with the payload still with UCX, and a close under way no longer waited for it.)"""
        fut: asyncio.Future[Any] | None = None
        cancelled = False
        try:
            if not req.completed:
                fut = self._w.future(req, keep=keep, owner=self)
                cancelled = await self._outlast(fut)
            err = self._check(req, what)
        finally:
            req = fut = None  # (the future's result is the request; see _send_payload)
        if err is not None:
            raise err
        return cancelled

    # -- receiving ----------------------------------------------------------------------------
    def wait_briefly(self, fut: Any) -> None:
        """Right after this side sent a frame, wait for the answer inline for up to
        ``_WAIT_INLINE`` (a ping-pong: the answer usually comes within tens of microseconds).
        Where that keeps failing (the answer comes later, or only from a task of this very
        loop), it backs off exponentially, so the wasted time stays a small fraction."""
        if self.state is not ChannelState.OPEN or time.perf_counter() - self._last_send > _ANSWER_WINDOW:
            return
        if self._wait_skip:
            self._wait_skip -= 1
            return
        w = self._w
        if w.inline_streak >= _INLINE_STREAK:
            # the loop has not turned since that many operations finished inline: this recv
            # waits through it, so that its other tasks and timers (lease renewals) run
            return
        try:
            self._post_ctrl_recv()
            if w.progress_until(fut, _WAIT_INLINE):
                self._wait_penalty = 0
                got = fut.result() if fut.exception() is None else None
                if (
                    isinstance(got, _Arrival)
                    and got.transfer is not None
                    and got.nbytes <= _LAND_INLINE
                    and not got.done.done()
                ):
                    # its payload is on its way into the recv's out= (the handler posted the
                    # receive): over shared memory this process copies it, in progress calls,
                    # within microseconds, and the recv returns without a trip through the loop
                    w.progress_until(got.done, _WAIT_INLINE)
            else:
                self._wait_penalty = min(2 * self._wait_penalty or 1, _WAIT_BACKOFF)
                self._wait_skip = self._wait_penalty
        except Exception:  # never: a recv must not fail here; the loop's progress takes over
            log.exception("ucx inline wait failed")

    def _post_ctrl_recv(self) -> None:
        """Post the control receive, unless it is posted. A frame that is already here (one
        that came while none was posted: UCX kept it) completes it at once: taken now, and the
        receive posted again, up to ``_CTRL_BURST`` frames in a row (a burst of sends), so that
        the payload receives of all of them are posted before UCX starts moving any payload
        (over cma this process does the copying, inside progress, one payload after the
        other); after that many, the rest once the tasks they woke have run."""
        if self.state is not ChannelState.OPEN or self._ctrl_posted:
            return
        ucp = self._ucp
        if ucp is None:
            self._post_ctrl_recv_ucxx()
            return
        # straight to ucp_tag_recv_nbx, as control frames are sent: no ucxx request, array
        # wrapper and watch per frame
        w = self._w
        if w.closed:  # (a raw call on a destroyed worker would crash the process)
            return
        for _ in range(_CTRL_BURST):
            try:
                req = ucp.tag_recv(w.handle, self._ctrl_ptr, self._ctrl_buf.nbytes, self._rx_ctrl_tag_value)
                status = 0 if req is None else ucp.request_status(req)  # (UCX completes at once without one)
            except TensorWireError as exc:
                self._shutdown(ChannelState.BROKEN, exc)
                return
            if status == UCS_INPROGRESS:
                self._ctrl_posted = True
                w.listen_raw(ucp, req, self._on_ctrl, keep=self._ctrl_buf, owner=self)  # type: ignore[arg-type]  # (a request)
                return
            if req is not None:
                length = ucp.recv_length(req) if status == 0 else 0
                ucp.request_release(req)
            else:
                length = ucp.received()
            if not self._take_ctrl(None if status == 0 else self._status_error(status, "control receive"), length):
                return
        w.soon(self._post_ctrl_recv)

    def _on_ctrl(self, status: int, length: int) -> None:
        """The posted control receive completed (``status``: UCS_OK or its error; ``length``
        bytes came)."""
        self._ctrl_posted = False
        if not self._take_ctrl(None if status == 0 else self._status_error(status, "control receive"), length):
            return
        w = self._w
        if not w.inline and w.worker.tag_probe(self._rx_ctrl_tag).matched:
            self._post_ctrl_recv()  # frames already here (a burst of sends): taken now
        else:
            # posted again once the task this frame woke has run (the round trip's path),
            # taking the frames that came meanwhile (UCX keeps them in order): by the next
            # progress run, or the next recv's inline wait. Not even looked for after a frame a
            # recv's inline wait took (a round trip's answer): that recv returns first
            w.soon(self._post_ctrl_recv)

    def _status_error(self, status: int, what: str) -> BaseException:
        """A raw request's error status as a tensorwire error, as ``_error`` tells a ucxx one."""
        assert self._ucp is not None
        return self._error(TransferError(self._ucp.status_string(status)), what)

    # (without the libucp bindings: the control receive through ucxx)
    def _post_ctrl_recv_ucxx(self) -> None:
        self._ctrl_posted = True
        if self._ctrl_arr is None:
            self._ctrl_arr = self._lib_array(self._ctrl_buf)
        req = self._w.worker.tag_recv(self._ctrl_arr, self._rx_ctrl_tag)
        self._w.watch(req, self._on_ctrl_ucxx, keep=self._ctrl_buf, owner=self, passive=True)

    def _on_ctrl_ucxx(self, req: Any) -> None:
        self._ctrl_posted = False
        if not self._take_ctrl(self._check(req, "control receive")):
            return
        # frames that are already here (a burst of sends) are taken now (see _post_ctrl_recv).
        # Not when a recv's inline wait took this frame (a round trip's answer): that recv returns
        # without waiting for the probe, and frames behind it are taken as the control receive,
        # posted again, matches them
        worker = self._w.worker
        for _ in range(0 if self._w.inline else _CTRL_BURST):
            if self.state is not ChannelState.OPEN or not worker.tag_probe(self._rx_ctrl_tag).matched:
                break
            req = worker.tag_recv(self._ctrl_arr, self._rx_ctrl_tag)
            if not req.completed:  # not expected: matched above; its completion calls back
                self._ctrl_posted = True
                self._w.watch(req, self._on_ctrl_ucxx, keep=self._ctrl_buf, owner=self, passive=True)
                return
            if not self._take_ctrl(self._check(req, "control receive")):
                return
        # after the task this frame woke has run (the round-trip path): a frame arriving
        # meanwhile waits in UCX's unexpected queue and matches this receive in order
        self._w.soon(self._post_ctrl_recv)

    def _take_ctrl(self, err: BaseException | None, length: int | None = None) -> bool:
        """Handle the control frame just received, ``length`` bytes (None: not known, through
        ucxx), or its receive's failure ``err``; False if the channel is (now) shut."""
        if self.state is not ChannelState.OPEN:
            return False
        if err is not None:
            log.warning("closing ucx channel %s: %s", self.name, err)
            self._shutdown(ChannelState.BROKEN, err)
            return False
        try:
            self._handle_frame(length)
        except ProtocolError as exc:
            # told without its traceback (``fresh``): that holds the frames that ran this
            # handler, a completion callback's and the dispatch's, and with them the UCX request
            # that completed and its worker, for as long as anyone keeps the error or its log line
            failure = fresh(exc)
            log.warning("closing ucx channel %s: %s", self.name, failure)
            self._shutdown(ChannelState.BROKEN, failure)
            return False
        except Exception as exc:  # a bug must not leave recvs hanging
            log.exception("ucx control handler failed")
            self._shutdown(ChannelState.BROKEN, BrokenResourceError(f"ucx control handler failed: {exc!r}"))
            return False
        # (a BYE shuts the channel here: no control receive may be posted for it any more, which
        # would stay with the worker, and keep this channel, until the node closed)
        return self.state is ChannelState.OPEN

    def _handle_frame(self, length: int | None = None) -> None:
        mv = self._ctrl_mv
        if length is not None and length < _HEADER:
            # (what the buffer holds past the bytes that came is the previous frame's)
            raise ProtocolError(f"control frame of {length} bytes, shorter than a frame header")
        # (``unpack_fields`` written out for a good frame, a call less per frame)
        magic, ftype, flags, check, meta_len, payload_len, msg_id, arg, credit, slots = _UNPACK(mv)
        t = _TYPE_OF.get(ftype)
        if t is None or magic != MAGIC or check or flags & ~_FLAGS:
            # not a good frame: unpack_fields raises the ProtocolError that says what is wrong
            t, flags, meta_len, payload_len, msg_id, arg, credit, slots = unpack_fields(mv)
        if length is not None and length != _HEADER + meta_len + payload_len:
            # one UCX message per frame: a frame must be exactly what its fields say (else the
            # bytes past those that came are the previous frame's: its message again)
            raise ProtocolError(f"{t.name} frame of {length} bytes declares {_HEADER}+{meta_len}+{payload_len}")
        if credit or slots:
            self._window.grant(credit, slots)
        if t is _MSG:
            limits = self._limits
            # how much payload rides inline is the sender's choice (its Limits.inline_bytes,
            # never told to us); it keeps the frame within our control buffer (remote_ctrl),
            # and that buffer is all a frame must fit here
            if meta_len > limits.max_header_bytes or meta_len + payload_len > self._ctrl_room:
                raise ProtocolError(f"MSG frame of {meta_len}+{payload_len} bytes exceeds the limits")
            end = _HEADER + meta_len
            tree, specs, nbytes = decode_header_sized(
                bytes(mv[_HEADER:end]), max_message_bytes=limits.max_message_bytes
            )
            rndv = bool(flags & RENDEZVOUS)
            inline = payload_len == nbytes and not rndv
            if payload_len and not inline:
                raise ProtocolError(f"MSG frame carries {payload_len} inline bytes of a {nbytes}-byte message")
            if msg_id in self._waiting or msg_id in self._incoming:
                raise ProtocolError(f"duplicate message id {msg_id}")
            self._budget.admit(nbytes, not rndv, arg)
            protocol = "rendezvous" if rndv else "inline" if inline and nbytes else "eager"
            # a posted recv waits for it: straight into place; its slot and credit go back once that recv has taken it
            if inline and self.mailbox.deliver(
                arg,
                tree,
                specs,
                mv[end : end + nbytes],
                protocol=protocol,
                release=functools.partial(self._release_express, arg),
            ):
                return
            arrival = _Arrival(
                self, arg, tree, specs, msg_id=msg_id, rendezvous=not inline, protocol=protocol, nbytes=nbytes
            )
            if not rndv:
                self._eager.add(arrival)
            self.mailbox.arrive(arrival)
            if inline:
                if arrival.dest is None or _on_device(arrival):
                    # the bytes came in the control frame, in host memory: into buffers of
                    # ours, and a device out= gets them by the recv's own copy (staged), as
                    # when the message comes before its recv (dropped if memory is short)
                    arrival.buffer()
                if nbytes:
                    arrival.fill(mv[end : end + nbytes])
                arrival.complete()
            elif rndv:
                # the recv's task asks for it (pull): a recv cancelled before then gives it back
                # with nothing landed, whatever its size, and no copy of it
                self._waiting[msg_id] = (arrival, True)
            elif arrival.dest is not None and not (_on_device(arrival) and _busy_streams(arrival)):
                # a recv matched (its out=, or device tensors placed for it) and its device
                # destinations' streams are idle: receive straight into place now, a loop turn
                # before the recv's task would (pull); a cancel of that recv waits for the write
                arrival.pinned = True
                self._post_payload(arrival)
            elif arrival.dest is None:
                self._adopt(arrival)  # nobody waits: buffer it here, within the credit
            else:
                # device memory must be ready first: the recv's task posts the receives (pull)
                self._waiting[msg_id] = (arrival, False)
                self._loop.call_soon(self._check_pulled, arrival)
            return
        if meta_len or payload_len:
            raise ProtocolError(f"{t.name} frame with {meta_len}+{payload_len} bytes")
        if t is FrameType.CTS:
            fut = self._cts.get(msg_id)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif t is FrameType.ABORT:
            entry = self._waiting.pop(msg_id, None)
            transfer = self._incoming.pop(msg_id, None)
            gone = entry[0] if entry else transfer.arrival if transfer else None
            if transfer is not None:
                self._cancel(transfer.reqs)  # never matched: the sender sent no payload
            dropping = self._discarding.pop(msg_id, None)
            if dropping:
                self._cancel(dropping)  # (discarded: its sender gave it up before our CTS came)
            if gone is not None:
                self.mailbox.abort(gone)
                self.release(gone)
        elif t is FrameType.CREDIT:
            pass
        elif t is FrameType.BYE:
            self._peer_closed(failed=arg == _BYE_FAILED)
        else:
            raise ProtocolError(f"unexpected {t.name} frame on an open channel")

    def _peer_closed(self, *, failed: bool = False) -> None:
        """The peer said BYE (``failed``: it aborted or failed its channel, and this one breaks;
        else this one closes). UCX may carry a payload on another lane than the control frames,
        and the BYE can overtake the end of a transfer that had finished at the peer's end
        (over tcp, 8-64 MiB: a message failed here with "peer closed the channel" after its
        sender's send had returned; a send failed so after its receiver had got the message
        and closed). Payload receives and sends in flight therefore end first (receives land
        their messages, which stay deliverable), then the channel shuts; within
        ``BYE_GRACE``."""
        if failed:
            state, exc = ChannelState.BROKEN, PeerDisconnected("peer aborted the channel")
        else:
            state, exc = ChannelState.CLOSED, PeerDisconnected("peer closed the channel")
        self._peer_said_bye = True
        reqs = [r for t in self._incoming.values() for r in t.reqs]
        if not reqs and not self._futs:
            self._shutdown(state, exc)
            return
        # meanwhile no new message goes (the peer will take none: a small send begun now went
        # inline and returned its receipt, its message lost), and those waiting on the peer (a
        # slot, a CTS) fail now, as when the peer says goodbye over the control plane
        self._ending(fresh(exc))
        self._w.track(self._loop.create_task(self._shut_when_landed(reqs, state, exc)))

    async def _sends_done(self) -> None:
        """Until no payload send is in flight. A send waits for its segments one by one, each
        wait in ``_futs`` until the send has gone on from it (to the wait for its next segment,
        added at once): one that has ended but is still there is a send yet to wake, whose next
        segments UCX may have taken (looking only at those not done, a close that came then
        went on, and failed a send whose message arrived whole)."""
        while self._futs:
            await asyncio.wait(list(self._futs))

    async def _shut_when_landed(self, reqs: list[Any], state: ChannelState, exc: BaseException) -> None:
        try:
            async with asyncio.timeout(BYE_GRACE):
                await self._w.all_done(reqs)  # (completions are dispatched before this wait's callback)
                await self._sends_done()
        except TimeoutError:
            pass
        finally:
            self._shutdown(state, exc)

    def _check_pulled(self, arrival: Arrival) -> None:
        """An eager message matched a recv with out=, whose task should have pulled it by now.
        If that recv was cancelled first, the mailbox requeued the message into a buffer of
        its own: receive the payload there, so the sender is not held up."""
        entry = self._waiting.get(arrival.msg_id)
        if entry is None or entry[0] is not arrival or self.state is not ChannelState.OPEN:
            return
        if arrival.protocol == "rendezvous":
            return  # (beyond our credit: it waits with its sender for a recv; taken back, ``take_back``)
        if arrival.direct and not arrival.pulling:
            self._loop.call_soon(self._check_pulled, arrival)
            return
        if not arrival.pulling:
            del self._waiting[arrival.msg_id]
            self._adopt(arrival)

    def _adopt(self, arrival: Arrival) -> None:
        """Receive an eager payload into a buffer of our own now (or into the device tensors a
        recv allocated for it); a later recv copies it. Where UCX moves CUDA memory itself, the
        message's CUDA tensors land in device memory of ours (this process's current device),
        device to device, and the recv hands them over or copies them on the device: through
        host memory, a CUDA message sent before its recv (a pipeline's next activation, as a
        rule) went down and up again, at a few GB/s (the first H200 run: 1 MiB in ~0.5 ms)."""
        # (no memory for it here now: it waits unposted, UCX holds it)
        if not arrival.adopt("cuda" in self.device_kinds):
            self._waiting[arrival.msg_id] = (arrival, False)
            return
        if _on_device(arrival):
            task = self._loop.create_task(self._post_when_ready(arrival))
            self._w.track(task)
            return
        self._post_payload(arrival)

    def discard(self, arrival: Arrival) -> bool:
        """Drop an eager message kept unposted for want of memory (``_adopt``): its sender's UCX
        sends wait for our receives, and would hold its send (an RPC server's call, its slot)
        until the channel closes. Each tensor's receive is posted into one byte of scratch: UCX
        truncates it (a rendezvous one moves none of its bytes) and completes the send. A
        rendezvous message not yet pulled goes the same way, its CTS sent after the receives:
        nothing needs memory here (an RPC server with none for a call's arguments)."""
        entry = self._waiting.get(arrival.msg_id)
        if entry is None or entry[0] is not arrival or arrival.pulling:
            return False  # (not kept unposted here, or pulled already)
        if self.state is not ChannelState.OPEN:
            return False
        del self._waiting[arrival.msg_id]
        tag = self._lib.UCXXTag(make_tag(self._rx_key, DATA, arrival.msg_id))
        reqs: list[Any] = []
        for spec in arrival.specs:
            if spec.nbytes:
                scratch = np.empty(1, np.uint8)
                req = self._w.worker.tag_recv(self._lib_array(scratch), tag)
                self._w.watch(
                    req, functools.partial(self._discarded, arrival.msg_id), keep=scratch, owner=self._discards
                )
                reqs.append(req)
        if reqs:
            # (also where the CTS went before: a message taken back (``take_back``) after its
            # pull, whose sender may yet send ABORT instead of the payload; those receives were
            # left posted until the channel closed)
            self._discarding[arrival.msg_id] = reqs
        if entry[1]:
            self._send_frame(self._frame(FrameType.CTS, msg_id=arrival.msg_id))
        gone = TransferError(f"a {arrival.nbytes}-byte message on this tag was dropped unread: its receiver gave it up")
        self.mailbox.remove(arrival, gone)
        if not arrival.settled:
            arrival.settled = True
            self.release(arrival)
        return True

    def _discarded(self, msg_id: int, req: Any) -> None:
        """A receive of a discarded message ended: truncated, as it was meant to be (or whole,
        for a tensor of one byte); anything else is the channel's failure, told elsewhere."""
        reqs = self._discarding.get(msg_id)
        if reqs is not None:
            reqs[:] = [r for r in reqs if r is not req]
            if not reqs:
                del self._discarding[msg_id]
        try:
            req.check_error()
        except Exception as exc:
            if "truncat" not in str(exc).lower():
                log.debug("ucx channel %s: receive of a discarded message: %s", self.name, exc)

    async def _post_when_ready(self, arrival: Arrival) -> None:
        try:
            await _targets_ready(arrival)
        except Exception as exc:
            arrival.fail(TransferError(f"device destination not ready: {exc!r}"))
            return
        if self.state is ChannelState.OPEN:
            self._post_payload(arrival)

    def _post_payload(self, arrival: Arrival, landed: int = 0) -> _Transfer:
        """Post the receives of ``arrival``'s payload into its ``dest``, but for its first
        ``landed`` tensors that take bytes (they are there: ``take_back``)."""
        assert arrival.dest is not None
        transfer = _Transfer(arrival)
        if isinstance(arrival, _Arrival):
            arrival.transfer = transfer
        self._incoming[arrival.msg_id] = transfer
        keeps: list[object] = []
        post = self._payload_recv(arrival.msg_id)
        try:
            for a in arrival.dest:
                if not a.nbytes:
                    continue
                if landed:
                    landed -= 1
                    continue
                transfer.reqs.append(post(a))
                keeps.append(a)
                transfer.pending += 1
        finally:  # (watched as one group: see Worker.watch_each; those posted, should one fail)
            self._w.watch_each(transfer.reqs, functools.partial(self._payload_done, transfer), keeps=keeps, owner=self)
        if not transfer.pending:
            self._incoming.pop(arrival.msg_id, None)
            _landed(arrival)
        return transfer

    def _payload_recv(self, msg_id: int) -> Callable[[Any], Any]:
        """A function that posts the receive of one tensor of message ``msg_id``'s payload into
        its destination (host or device memory) and returns the request. Straight to ucp_tag_recv_nbx, as control
        frames are received: UCX then says how many bytes came (``RawRecv.length``), and a
        payload shorter than its tensor, which UCX completes without error, breaks the channel
        (``_payload_error``). Through ucxx's tag_recv where the libucp bindings did not load."""
        ucp = self._ucp
        if ucp is None:
            recv, lib_tag = self._w.worker.tag_recv, self._lib.UCXXTag(make_tag(self._rx_key, DATA, msg_id))
            return lambda a: recv(self._lib_array(_payload(a)), lib_tag)
        w, array, tag = self._w, _array(), make_tag(self._rx_key, DATA, msg_id)

        def post(a: Any) -> RawRecv:
            buf = array(_payload(a))  # (its address, as ucxx would post it; host or device)
            return w.payload_recv(ucp, buf.ptr, buf.nbytes, tag)

        return post

    def _payload_done(self, transfer: _Transfer, req: Any) -> None:
        if transfer.taken_back:
            return  # (cancelled before anything matched: the message waits for its next recv)
        arrival = transfer.arrival
        transfer.pending -= 1
        err = self._payload_error(req)
        if isinstance(err, ProtocolError):
            if self.state is ChannelState.OPEN:
                # the peer broke the protocol, as with a bad control frame: the channel breaks, and
                # this message (and every other) fails, once its other receives have ended
                log.warning("closing ucx channel %s: %s", self.name, err)
                self._shutdown(ChannelState.BROKEN, err)
            arrival.fail(err)
        elif err is not None and not arrival.done.done():
            if self.state is ChannelState.OPEN and "cancel" not in str(err).lower():
                if self._peer_said_bye:
                    # a payload its sender gave up as it closed (a send cut short, its process
                    # gone since): that message fails, and the channel shuts as the peer said
                    log.debug("ucx channel %s: after the peer's goodbye: %s", self.name, err)
                else:
                    # such a peer's BYE came before its memory went, yet UCX may read it in a
                    # later progress round than this failed copy: the next run takes the frames
                    # that came, and the channel breaks only if none was a BYE
                    self._w.kick()
                    self._loop.call_soon(self._payload_failed, err)
            arrival.fail(err)
        if transfer.pending == 0:
            # done with: a message that nobody received stays with its channel (the mailbox),
            # which a program may hold long after the node closed, and each request holds the
            # node's UCX worker
            transfer.reqs = []
            if self._incoming.get(arrival.msg_id) is transfer:
                del self._incoming[arrival.msg_id]
            if not arrival.done.done() and transfer.failure is None:  # (a failure is told by now)
                arrival.written = arrival.nbytes
                _landed(arrival)

    def _payload_error(self, req: Any) -> BaseException | None:
        """What went wrong with a payload receive that has completed, if anything: its error, or
        (a raw receive) a payload of another length than its tensor's. UCX fails a longer one
        (truncated) but completes a shorter one without error, the rest of the buffer as it was."""
        if type(req) is not RawRecv:
            return self._check(req, "payload receive")  # (through ucxx: the length is not known)
        if req.status:
            return self._status_error(req.status, "payload receive")
        if req.length != req.nbytes:
            return ProtocolError(f"a payload of {req.length} bytes came for a tensor of {req.nbytes} bytes")
        return None

    def _payload_failed(self, err: BaseException) -> None:
        if self.state is ChannelState.OPEN and not self._peer_said_bye:
            log.warning("ucx channel %s: %s", self.name, err)
            self._shutdown(ChannelState.BROKEN, err)

    def _fail_when_landed(self, transfer: _Transfer, exc: BaseException) -> None:
        """Fail ``transfer``'s message with ``exc`` once none of its UCX receives can write into
        its buffers any more (each finished or cancelled; a shutdown cancels them), or after
        ``_LANDING_GRACE`` with an error that says the buffer may still be written."""
        if transfer.failure is not None:
            return  # told once its receives end
        transfer.failure = exc
        arrival = transfer.arrival

        def landed() -> None:
            timer.cancel()
            transfer.reqs = []  # (see _payload_done)
            Arrival.fail(arrival, exc)

        def late() -> None:
            self._w.forget_wait(token)
            text = (
                f"{exc} (UCX had not finished receiving the message {_LANDING_GRACE:.0f} s later: "
                "the recv's buffer may still be written)"
            )
            log.warning("ucx channel %s: %s", self.name, text)
            Arrival.fail(arrival, _late(exc, text))

        timer = self._loop.call_later(_LANDING_GRACE, late)
        token = self._w.when_done([r for r in transfer.reqs if not r.completed], landed)

    async def pull(self, arrival: Arrival) -> None:
        self.check_open()
        if _on_device(arrival) and arrival.msg_id in self._waiting:
            try:
                await _targets_ready(arrival)  # before anything changes: a cancel here loses nothing
            except BaseException:
                # nothing was posted: the next recv pulls the message afresh, and an eager one
                # is received into a buffer of ours meanwhile, so that its sender is not held up
                arrival.pulling = False
                entry = self._waiting.get(arrival.msg_id)
                if entry is not None and entry[0] is arrival and not entry[1]:
                    self._loop.call_soon(self._check_pulled, arrival)
                raise
            self.check_open()
        entry = self._waiting.pop(arrival.msg_id, None)
        if entry is None:
            transfer = self._incoming.get(arrival.msg_id)
            if transfer is None or transfer.arrival is not arrival:
                if arrival.done.done():
                    arrival.done.result()
                    return
                raise TransferError("message is no longer pending")
        else:
            self._post_payload(arrival)
            if entry[1]:
                self._send_frame(self._frame(FrameType.CTS, msg_id=arrival.msg_id))
        # UCX may be writing into arrival.dest (perhaps the caller's out=): a cancellation
        # waits for that to finish (or for the sender to abort, or the channel to fail)
        cancelled = False
        while not arrival.done.done():
            try:
                await arrival.completed()  # (woken by complete/fail: a turn sooner than a shield)
            except asyncio.CancelledError:
                if not cancelled and self.take_back(arrival):
                    raise  # nothing of it moved: it goes back unread (``Mailbox._requeue``)
                cancelled = True
        if cancelled:
            late = unsettled([None if arrival.done.cancelled() else arrival.done.exception()])
            if late is not None:  # (UCX may still write into the recv's out=: not the caller's yet)
                raise late
            raise asyncio.CancelledError
        arrival.done.result()

    def take_back(self, arrival: Arrival) -> bool:
        """The recv ``arrival`` lands for was cancelled (in its pull, or in the turn the control
        handler posted its receives into its out=): take its payload receives back if none has
        matched yet (its sender has not sent the payload: a stopped process, or one slow to
        take our CTS), so that the cancel ends now, not when the lease declares that sender dead
        (a 1.5 s deadline ended such a recv after the whole 30 s lease). The first receive is
        cancelled, and only if it had not matched (UCX completes it as cancelled at once; it
        matches a tag's messages in the order they were sent, so none behind it has either) are
        the rest. True then: nothing landed in ``dest``, nor will, and the message waits unread
        for the next recv, as before it was pulled (a rendezvous one's CTS went already: the
        payload its sender sends waits in UCX for that recv's receives). Where its first
        tensors have landed, the rest is taken back the same way (``_take_back_rest``)."""
        transfer = self._incoming.get(arrival.msg_id)
        if (
            self.state is not ChannelState.OPEN
            or transfer is None
            or transfer.arrival is not arrival
            or transfer.failure is not None
            or not transfer.reqs
            or arrival.done.done()
        ):
            return False
        reqs = transfer.reqs
        at = next((i for i, r in enumerate(reqs) if not r.completed), None)
        if at is None:
            return False  # (every tensor landed: the message is whole, or about to be told so)
        assert isinstance(arrival, _Arrival)
        if at:
            return self._take_back_rest(arrival, transfer, at)
        first = reqs[0]
        self._w.cancel(first)
        if not self._cancelled(first):
            return False  # matched: its bytes are coming, and the cancel waits for them
        for r in transfer.reqs[1:]:
            self._w.cancel(r)
        if not all(self._cancelled(r) for r in transfer.reqs[1:]):  # (never: see above)
            return False  # those cancelled fail the message (``_payload_done``) once the rest have landed
        transfer.taken_back = True
        transfer.reqs = []  # (the worker reports them to nobody: see _payload_done)
        del self._incoming[arrival.msg_id]
        arrival.transfer = None  # unread again (``unread``): its recv gives it back without a buffer
        arrival.pinned = arrival.pulling = False
        arrival.go_ahead = arrival.rendezvous  # (its sender cannot withdraw it any more)
        self._waiting[arrival.msg_id] = (arrival, False)  # (a CTS went already, if it needed one)
        if arrival.protocol != "rendezvous":
            # eager: its payload is received into a buffer of ours unless a recv pulls it first
            self._loop.call_soon(self._check_pulled, arrival)
        return True

    def _take_back_rest(self, arrival: _Arrival, transfer: _Transfer, at: int) -> bool:
        """``take_back`` for a message whose first ``at`` tensors have landed in the recv's out=
        (host memory) and whose next receive has not matched (its sender stopped between two
        tensors, or UCX still queues its later sends there): those receives are cancelled, what
        landed is copied to a buffer of ours and the rest is received there, so that the cancel
        ends now and out= is not written after it. (The cancel waited for the rest to land: a
        stopped sender's, its whole lease.) False, nothing changed, where the next receive has
        matched, a landed one failed, the memory cannot be had, or ``dest`` is device memory."""
        reqs = transfer.reqs
        dest = [d for d in arrival.dest or () if type(d) is np.ndarray]
        if arrival.dest is None or len(dest) != len(arrival.dest):
            return False  # (device memory: the cancel waits for the receives, as before)
        if any(self._payload_error(r) is not None for r in reqs[:at]):
            return False  # (told by its completion: the message fails)
        try:
            own = [s.allocate() for s in arrival.specs]
        except TransferError:
            return False
        self._w.cancel(reqs[at])
        if not self._cancelled(reqs[at]):
            return False  # matched: its bytes are coming, and the cancel waits for them
        for r in reqs[at + 1 :]:
            self._w.cancel(r)  # (none has matched: UCX matches a tag's messages in the order sent)
        if not all(self._cancelled(r) for r in reqs[at + 1 :]):  # (never: see above)
            return False  # those cancelled fail the message (``_payload_done``) once the rest have landed
        pairs = [(m, d) for m, d in zip(own, dest, strict=True) if d.nbytes][:at]  # (landed: UCX writes there no more)
        # a large copy in a copy thread (on the loop it held every channel for the whole copy): the
        # cancelled recv waits it out before it returns (``Mailbox._requeue``: it reads out=),
        # and the recv that takes the message before it reads ``dest`` (``Arrival.moved``)
        arrival.moving = copy_host_soon(pairs)
        copied = sum(d.nbytes for _, d in pairs)
        transfer.taken_back = True
        transfer.reqs = []  # (the worker reports them to nobody: see _payload_done)
        arrival.dest = own  # type: ignore[assignment]  # (list invariance)
        arrival.direct = False
        arrival._flat = None
        arrival.count_copied(copied)
        arrival.pinned = arrival.pulling = False
        arrival.rendezvous = False  # its payload is landing here: the next recv copies it, pulls nothing
        self._post_payload(arrival, at)
        return True

    def _cancelled(self, req: Any) -> bool:
        """Whether ``req``, a payload receive just cancelled, completed as cancelled (it had not
        matched)."""
        if not req.completed:
            return False
        if type(req) is RawRecv:
            return req.cancelled
        err = self._payload_error(req)  # (through ucxx: its error's text is all there is)
        return err is not None and "cancel" in str(err).lower()

    def unread(self, arrival: Arrival) -> bool:
        # no payload receive posted yet (a rendezvous message matched but not pulled, a device
        # one waiting for its streams): UCX writes into dest only through those
        return isinstance(arrival, _Arrival) and arrival.transfer is None

    def release(self, arrival: Arrival) -> None:
        eager = arrival in self._eager  # inline and eager arrivals spent buffer credit
        self._eager.discard(arrival)
        self._budget.release(arrival.nbytes, eager, arrival.tag, schedule=self.state is ChannelState.OPEN)

    def _release_express(self, tag: int, nbytes: int) -> None:
        """A recv took a message on ``tag`` delivered express (``Mailbox.deliver``): it came inline, eager."""
        self._budget.release(nbytes, True, tag, schedule=self.state is ChannelState.OPEN)

    def _flush_credit(self) -> None:
        if self.state is ChannelState.OPEN:
            self._send_frame(self._frame(FrameType.CREDIT))

    # -- one-sided ----------------------------------------------------------------------------
    def remote_key(self, packed: bytes) -> RemoteKey:
        """Unpack a peer's packed rkey (``MemoryRegion.rkey``) for use on this channel."""
        self.check_open()
        ucp = self._require_ucp()
        key = RemoteKey(ucp.rkey_unpack(self.endpoint_handle, packed), ucp, self._rkeys)
        self._rkeys.add(key)
        return key

    def _require_ucp(self) -> Ucp:
        if self._ucp is None:
            raise TransferError("ucx one-sided operations need the libucp bindings, which failed to load")
        return self._ucp

    async def _one_sided(self, op: str, buf: memoryview, remote_addr: int, rkey: RemoteKey) -> None:
        view = memoryview(buf).cast("B")
        if op == "get" and view.readonly:
            raise TransferError("get needs a writable destination")
        arr = np.frombuffer(view, np.uint8)
        await self.rma(op, arr.__array_interface__["data"][0], view.nbytes, remote_addr, rkey, arr)

    async def rma(self, op: str, ptr: int, n: int, remote_addr: int, rkey: RemoteKey, keep: object) -> None:
        """Get (``op="get"``) ``n`` bytes at ``remote_addr`` into ``ptr``, or put them from
        ``ptr`` and flush; ``keep`` holds the local memory until UCX is done with it."""
        await self.rma_many(op, [(ptr, n, remote_addr, rkey, keep)])

    async def rma_many(self, op: str, items: list[tuple[int, int, int, RemoteKey, object]]) -> _Route | None:
        """``rma`` for a batch of ``(ptr, n, remote_addr, rkey, keep)``: every operation posted at
        once, each given its few inline progress rounds, those still going waited for together
        (and, for puts, one flush); returns once all completed, with the protocol UCX says it
        selected and its lanes (``Receipt.route``) where it said so for every operation that
        moved bytes (each ``_ROUTE_FROM`` or more), else None. Over a direct lane an operation
        larger than ``_RMA_PIECE`` goes in pieces, a few posted at a time (``_rma_pieces``),
        after the rest.
        UCX cannot take back what it was given, so a failure or a cancellation still waits for
        everything posted before it is raised."""
        self.check_open()
        ucp = self._require_ucp()
        w, ep = self._w, self.endpoint_handle
        post = ucp.put if op == "put" else ucp.get
        posted: list[tuple[int, object]] = []
        routes: list[_Route] | None = []  # None: an operation's is not known
        large: list[tuple[int, int, int, RemoteKey, object]] = []
        error: BaseException | None = None
        for item in items:
            ptr, n, remote_addr, rkey, keep = item
            if n == 0:
                continue
            if n > _RMA_PIECE and self.one_sided_direct:
                large.append(item)
                continue
            if rkey.handle is None:
                error = ClosedResourceError("remote key is closed")
                break
            try:
                req = post(ep, ptr, n, remote_addr, rkey.handle)
            except TensorWireError as exc:
                error = exc
                break
            routes = _asked(routes, ucp, req, n >= _ROUTE_FROM)  # (a small one: the batch claims none)
            if req is not None:
                posted.append((req, keep))
        waiting = []
        for req, keep in posted:
            try:
                if not w.finish_inline(ucp, req):
                    waiting.append((req, keep))
            except TensorWireError as exc:
                error = error or exc
        if waiting:
            await self._raw_wait(*waiting)
        if error is not None:
            raise error
        if large:
            pieces = await self._rma_pieces(ucp, post, large)
            routes = None if routes is None or pieces is None else routes + [r for r in pieces if r not in routes]
        if op == "put":
            req = ucp.flush(ep)
            if req is not None and not w.finish_inline(ucp, req):
                await self._raw_wait((req, None))
        if w.inline_streak >= _INLINE_STREAK:
            await asyncio.sleep(0)
        return _joined(routes)

    async def _rma_pieces(
        self, ucp: Ucp, post: Callable[..., int | None], items: list[tuple[int, int, int, RemoteKey, object]]
    ) -> list[_Route] | None:
        """Get or put each of ``items`` as pieces of ``_RMA_PIECE`` bytes, at most ``_RMA_AHEAD``
        of them posted and not completed: an operation posted meanwhile on this endpoint (a
        small read of another task) waits for those, not for all that is left. Returns what UCX
        said it selected for the pieces (parts of operations larger than ``_ROUTE_FROM``, each
        asked, the last, shorter one too), or None where it did not say for one.

        A cancellation posts the rest all the same and is raised once everything completed, as
        for an operation posted whole (a cancelled write lands whole, a cancelled read returns
        only once nothing more can be written). A failure, or the channel shutting, posts no
        more pieces; the first failure is raised once those posted have completed."""
        pieces = [
            (ptr + at, min(_RMA_PIECE, n - at), remote_addr + at, rkey, keep)
            for ptr, n, remote_addr, rkey, keep in items
            for at in range(0, n, _RMA_PIECE)
        ]
        ep = self.endpoint_handle
        futs: list[asyncio.Future[None]] = []
        ahead: list[asyncio.Future[None]] = []
        routes: list[_Route] | None = []
        error: BaseException | None = None
        cancelled = False
        try:
            for ptr, n, remote_addr, rkey, keep in pieces:
                if len(ahead) >= _RMA_AHEAD:
                    oldest = ahead.pop(0)
                    cancelled = await _settled(oldest) or cancelled
                    if oldest.cancelled() or oldest.exception() is not None:
                        break  # (raised below, once the pieces posted have completed)
                try:
                    self.check_open()
                    if rkey.handle is None:
                        raise ClosedResourceError("remote key is closed")
                    req = post(ep, ptr, n, remote_addr, rkey.handle)
                except TensorWireError as exc:
                    error = exc
                    break
                routes = _asked(routes, ucp, req, True)  # (every piece, the last shorter one too)
                if req is not None:
                    fut = self._w.watch_raw(ucp, req, keep, pledge=True)  # (waited out: ``_settled``)
                    self._rma_futs.add(fut)
                    futs.append(fut)
                    ahead.append(fut)
            for fut in ahead:
                cancelled = await _settled(fut) or cancelled
            shut = bool(self._rma_shut.intersection(futs))
        finally:
            self._rma_futs.difference_update(futs)
            self._rma_shut.difference_update(futs)
        if cancelled:
            # (the failure is not what the caller asked about, unless it says the memory may
            # still be written: see ``unsettled``)
            late = unsettled([None if fut.cancelled() else fut.exception() for fut in futs])
            if late is not None:
                raise late
            raise asyncio.CancelledError
        for fut in futs:
            fut.result()
        if error is not None:
            raise error
        if shut:  # they ended, but the channel shut meanwhile
            self.check_open()
        return routes

    async def _raw_wait(self, *requests: tuple[int, object]) -> None:
        """Wait for raw requests (with the memory each keeps) until every one completed; the
        first failure is raised then. A cancellation waits too (UCX cannot take back a put or
        get), and is raised after, unless the channel is closing."""
        ucp = self._require_ucp()
        futs = [self._w.watch_raw(ucp, req, keep, pledge=True) for req, keep in requests]
        self._rma_futs.update(futs)
        try:
            await self._finish_posted(futs)
            if self._rma_shut.intersection(futs):  # they ended, but the channel shut meanwhile
                self.check_open()
        finally:
            self._rma_futs.difference_update(futs)
            self._rma_shut.difference_update(futs)

    async def put(self, src: Any, remote_addr: int, rkey: RemoteKey) -> None:
        """Write ``src`` (bytes-like) to the peer's registered memory at ``remote_addr``.

        Returns once the bytes are in the peer's memory (put, then an endpoint flush).
        """
        await self._one_sided("put", memoryview(src), remote_addr, rkey)

    async def get(self, remote_addr: int, rkey: RemoteKey, dest: Any) -> None:
        """Read ``len(dest)`` bytes of the peer's registered memory at ``remote_addr`` into ``dest``."""
        await self._one_sided("get", memoryview(dest), remote_addr, rkey)

    # -- lifecycle ----------------------------------------------------------------------------
    def _cancel(self, reqs: list[Any]) -> None:
        for r in reqs:
            self._w.cancel(r)

    def _ending(self, exc: BaseException) -> None:
        """Fail ``ended`` (``Channel._ending``), and the sends waiting on the peer with it (the
        peer said goodbye): for a slot, or for the CTS of a rendezvous message. Sends that begin
        later raise it, before they wait or send (the fast path falls through: ``SendWindow.end``)."""
        super()._ending(exc)
        if self.state is ChannelState.OPEN:  # (our own close fails them with its own error)
            fail_waiting_sends(self._window, self._cts, exc)
            if self._rma_futs and not self.one_sided_direct:
                # over lanes that emulate gets and puts the peer's worker serves them, and it is
                # going with its node; its BYE may wait behind a get's answer and be dropped
                # with its endpoint. Those it has not served within the grace fail as at a
                # shutdown, saying the memory may still be written (they waited for the lease)
                self._loop.call_later(_LANDING_GRACE, self._fail_one_sided, list(self._rma_futs), exc)

    def _shutdown(self, state: ChannelState, exc: BaseException) -> None:
        if self.state in (ChannelState.CLOSED, ChannelState.BROKEN):
            return
        self._closed(state, exc)
        if self._neighbour is not None:
            self._w.forget_neighbour(self._neighbour)
        self._budget.close()
        self._window.fail(exc)
        self._order.fail(exc)
        for fut in self._cts.values():  # (each a copy of its own: see ``fresh``)
            if not fut.done():
                fut.set_exception(fresh(exc))
                fut.exception()
        # payload sends UCX has not completed: it cannot take them back, and a peer that only
        # stopped may still read the payload from the sender's memory when it runs again
        # (docs/ucx.md, "Sends to a peer that died"): their sends say so, even when cancelled
        for fut in self._futs:
            if not fut.done():
                fut.set_exception(_unsent(exc))
                fut.exception()
        if self._rma_futs:
            # a get or put in flight cannot be taken back, and a get may still write into the
            # caller's memory: each ends when UCX completes it (the worker resolves it then),
            # or fails after a grace, saying so (an owner that stopped serving an emulated get)
            self._rma_shut.update(self._rma_futs)
            self._loop.call_later(_LANDING_GRACE, self._fail_one_sided, list(self._rma_futs), exc)
        for a, _ in self._waiting.values():
            a.fail(fresh(exc))
        for t in self._incoming.values():
            t.arrival.fail(fresh(exc))
            if all(r.completed for r in t.reqs):
                t.reqs = []  # (see _payload_done; ones still landing are dropped once landed)
        self._waiting.clear()
        self._incoming.clear()
        # the scratch receives of messages dropped unread (``_drop_unread``) are left posted: a
        # rendezvous payload whose RTS comes after the endpoint has gone is not received (UCX
        # completes its receive as cancelled, "RTS on non-existing endpoint", and never answers
        # the sender), so the endpoint's close waits for them first (``close_endpoint``'s first)
        discards = [r for reqs in self._discarding.values() for r in reqs]
        self._discarding.clear()
        # one-sided requests may still be in flight (their waits were just failed): their keys
        # are destroyed once UCX has finished them
        self._w.retire(list(self._rkeys))
        self._rkeys.clear()
        self._w.abandon(self)  # cancel what UCX still holds of ours; keep its buffers alive
        self._closed_ev.set()
        # the endpoint goes with the channel: a ucxx endpoint holds its worker, and a closed
        # channel that its peer still referenced kept the node's closed UCX worker alive
        ep, self._ep = self._ep, None
        self._ep_released = self._loop.create_future()
        self._w.track(self._loop.create_task(self._w.close_endpoint(ep, released=self._ep_released, first=discards)))

    def settled(self) -> Awaitable[None]:
        return self._settled()

    async def _settled(self) -> None:
        """Once the channel has shut and UCX has let go of its endpoint (its close completed, or
        the worker shut): from then on UCX serves none of the peer's gets and puts of this node's
        memory. Over lanes that emulate them (tcp, and shared memory without cma) this node's
        worker reads and writes the memory for the peer, and a get under way when the peer
        closed or said goodbye was still being answered from it after that: an owner that let an
        unexposed tensor go then (its revocation done, as the peer had gone) crashed (SIGSEGV)
        or sent the peer memory it had reused. The endpoint's close waits for those gets and
        puts; ``close_endpoint`` stops waiting after its grace (1 s, and a loaded machine served
        a 512 MiB get for longer), UCX does not: this waits for UCX. Bounded by the peer (a
        process that ends fails its lanes, and the close with them) and by this node's close
        (which shuts the worker)."""
        await self._closed_ev.wait()
        released = self._ep_released
        if released is not None:
            await asyncio.wait([released])

    def _fail_one_sided(self, futs: list[asyncio.Future[None]], exc: BaseException) -> None:
        """One-sided requests that UCX had not completed ``_LANDING_GRACE`` after the channel
        shut: their waits fail, saying that the memory may still be written."""
        late = [f for f in futs if not f.done()]
        if not late:
            return
        text = (
            f"{exc} (UCX had not finished a one-sided operation {_LANDING_GRACE:.0f} s later: "
            "its buffer may still be written)"
        )
        log.warning("ucx channel %s: %s", self.name, text)
        for fut in late:
            _settle(fut, _late(exc, text))
        # (the worker keeps their requests until UCX completes them, for good from an owner that
        # died over emulated lanes: not these waits, whose failure's traceback holds this
        # channel and its peer once raised)
        self._w.let_go(late)

    async def aclose(self) -> None:
        if self.state is ChannelState.OPEN:
            self._drop_unread()
            self.state = ChannelState.CLOSING
            deadline = self._loop.time() + BYE_GRACE
            bye = sent = None
            try:
                # payloads UCX has taken are on their way (it cannot take them back): their
                # sends finish first, so that each says what became of its message (failed by
                # the shutdown, they said "channel closed" while the message arrived whole)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        await self._sends_done()
                        await self._discards_done()
                        # and this side's gets and puts: over lanes that emulate them the peer's
                        # worker serves each from or into its memory, and one still under way
                        # when the channel shut was served on there past the peer's revocation
                        # (its endpoint's flush, stuck on a reader gone, gave up after a second)
                        while rma := [f for f in self._rma_futs if not f.done()]:
                            await asyncio.wait(rma)
                # the frame stays referenced until UCX is done with it: over a busy tcp lane
                # UCX queues the send and copies the bytes only when the lane frees up (a
                # temporary freed before that reached the peer as garbage: "bad frame magic")
                bye = pack(FrameType.BYE)
                sent = self._post_bye(bye)
                if sent is not None:
                    async with asyncio.timeout_at(max(deadline, self._loop.time() + 0.1)):
                        await sent
            except Exception:  # the peer may already be gone; closing goes on
                pass
            except BaseException:
                # cancelled before its goodbye went (asyncio.run's sweep while owed sends were
                # awaited): post it without waiting, as abort() does; without it the peer learnt
                # only when its lease of this node ran out
                if bye is None:
                    self._goodbye(failed=False)  # (a close all the same: the peer's closes too)
                raise
            finally:
                sent = None  # (a cancelled close's traceback: see _send_payload)
                self._shutdown(ChannelState.CLOSED, ClosedResourceError("channel closed"))

    def _drop_unread(self) -> None:
        """At a close (an abort, a failure): drop the unread messages whose payload the peer
        sends without waiting for a CTS (a rendezvous one taken back from a cancelled recv after
        its CTS went, ``take_back``; an eager one kept unposted for want of memory, ``_adopt``):
        ``discard`` receives each into scratch, so that UCX completes the peer's send. No receive
        here would ever take it, and the peer's send stayed in its UCX, unmatched: it ended only
        when the peer shut its channel on our BYE, a second later (``BYE_GRACE``), saying that we
        "may still read" its tensors, and the peer's worker kept them (``Worker.sweep``'s
        warning) until its node closed. Its sender gets the send's receipt, as for a message
        that came before its recv and is dropped unread with the channel (a tcp peer's send
        likewise ends once its payload is in the socket). Rendezvous messages still waiting for
        a CTS are left to the BYE: it fails their sends at once, their payload never sent. Those
        a recv holds (its out=) fail with the close.

        An abort (or a failure) waits for nothing, and shuts the channel at once: the scratch
        receives outlast it, and the endpoint's close waits for them (``_shutdown``), within a
        grace. Until 2026-12-02 only ``aclose`` did this: a peer's send to a receiver that
        aborted (``peer.abort()``, ``node.abort()``, a lost lease) and lived on ended a second
        after the BYE, with PeerDisconnected saying we "may still read" it, and the peer's
        worker kept the payload until its node closed."""
        if self._w.closed:
            return  # (nothing may be posted on it: its receives went with it)
        for arrival, needs_cts in list(self._waiting.values()):
            if not needs_cts and not arrival.direct:
                self.discard(arrival)

    async def _discards_done(self) -> None:
        """Until the scratch receives of the messages ``discard`` dropped have ended (a
        rendezvous one's sender has its truncation, and its send ends; ``_drop_unread``)."""
        await self._w.all_done([r for reqs in self._discarding.values() for r in reqs])

    def abort(self) -> None:
        self._end_now(ChannelState.CLOSED, ClosedResourceError("channel aborted"))

    def fail(self, exc: BaseException) -> None:
        self._end_now(ChannelState.BROKEN, exc)

    def _end_now(self, state: ChannelState, exc: BaseException) -> None:
        """Shut the channel as ``state`` with ``exc``, waiting for nothing (an abort, a failure).
        The BYE waits for nothing either: the peer learns at once, as a tcp peer does from the
        shut socket (it kept a peer aborted after its connect, one nobody held, until its lease
        ran out); what it sent that nothing here will read is dropped first (``_drop_unread``)."""
        if self.state is ChannelState.OPEN:
            self._drop_unread()
            self._goodbye()
        self._shutdown(state, exc)

    def _post_bye(self, bye: bytes) -> asyncio.Future[Any] | None:
        """Post ``bye``: None if UCX is done with it, else a future for when it is. Raw
        (``ucp_tag_send_nbx``) as other control frames, not through ucxx: a ucxx send is held
        by its endpoint until it completes, and a BYE to a peer that died before UCX had learnt
        its endpoint id (a first rendezvous send to it was in flight) waits for that id for good,
        so the request and the endpoint held each other, and the node's worker with them, after
        the node closed (see ``Worker._close_stuck``)."""
        if self._ucp is not None:
            raw = self._ucp.tag_send(self._ep_handle, bye, self._ctrl_tag_value)
            return None if raw is None else self._w.watch_raw(self._ucp, raw, bye, owner=self, what="ucx goodbye")
        req = self._ep.tag_send(self._lib_array(bye), self._ctrl_tag)
        return None if req.completed else self._w.future(req, keep=bye, owner=self)

    def _goodbye(self, *, failed: bool = True) -> None:
        """Post a BYE and wait for nothing: a failed or aborted channel (a lost lease or session,
        a connect given up) tells its peer, whose channel then breaks (``failed``; a close cut
        short says a plain BYE, and the peer's channel closes) and whose pending work fails at
        once (PeerDisconnected) instead of when its own lease of this node runs out, as a shut
        socket tells a tcp peer. Best effort: a peer that is gone never gets it. The endpoint's
        close flushes it out; the frame is kept (the worker's graveyard, once the shutdown
        abandons the request) until UCX is done with it."""
        try:
            self._post_bye(pack(FrameType.BYE, arg=_BYE_FAILED if failed else 0))
        except Exception as exc:  # the peer may be gone already; failing goes on
            log.debug("ucx channel %s: goodbye not sent: %s", self.name, exc)
