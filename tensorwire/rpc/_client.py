"""The calling side of tensor RPC: ``peer.call`` and ``peer.stream``.

A call sends one request (arguments inline up to INLINE_BYTES; larger ones after the server's
GO, so they never move before the server has room for them) and waits on a reply tag of its
own. A caller that gives up (cancelled, its deadline ran out, a stream closed early) tells the
server to cancel, and a background task drains the call's remaining replies, so nothing is
left behind in the mailbox; a reply that waits there for its go-ahead (rendezvous) is not
pulled just to be dropped: the server is told to take it back (WITHDRAW), and one that came
eager but waits unread for want of memory here is dropped unread (``Channel.discard``), which
completes the server's send. The arguments are flattened once per call (``_arguments``),
whether they then ride in the request or go apart. What calls may have
outstanding on one peer stays within both sides' message slots (``_Budget``), so that no mix
of calls and unread streams can stop the replies, cancellations or credit of the others; the
deadline covers the wait for that room. A call made by a method this node serves lends that
method's slot while it waits (``_registry.lending``), and one back to the caller of that method
(a call or a stream, from a unary or a streaming method) takes the room that caller keeps for
it, at once or as soon as an earlier call back has left it, unless a place comes first
(``_room``, ``_registry.CallerRoom``).
The channel's receipt of every message a call sends or takes is passed along; only
``peer.call_with_receipt`` (``want_receipt``) has them made into a ``CallReceipt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._loops import call_off
from ..errors import (
    ClosedResourceError,
    ConfigurationError,
    DeadlineExceeded,
    MessageRefused,
    ProtocolError,
    RemoteError,
    ShapeMismatchError,
    TensorWireError,
    TransferError,
    fresh,
)
from ..tensors import Outgoing, as_view, is_tensor, prepare
from ..tensors._message import MAX_DEPTH, Preparing, check_out
from ..tensors._view import TensorView
from ..transports import Channel, ChannelState, Receipt
from ..transports._mailbox import Arrival
from ._codec import encode, encode_off_loop
from ._deadline import effective_deadline, timeout_at
from ._protocol import (
    CONTROL_TAG,
    INLINE_BYTES,
    REQUEST_TAG,
    STREAM_WINDOW,
    TERMINAL,
    ArgsState,
    Control,
    Kind,
    Reply,
    args_tag,
    fill_meta,
    meta,
    raise_error,
    reply_tag,
)
from ._receipt import CallReceipt
from ._registry import CallerRoom, FifoAdmission, PerChannel, call_back_room, lending
from ._server import DRAIN_SECONDS

if TYPE_CHECKING:
    from .._peer import Peer

__all__ = ["call", "stream"]

_ids = itertools.count(1)
_MAX_OUTSTANDING = 256  # calls per peer, whatever its limits


class _Budget(FifoAdmission):
    """What this node's calls to one peer may hold of the two channels' message slots.

    A message takes one of its receiver's slots (``Limits.max_unexpected``) until it is
    received, and a sender without slots waits; cancellations and stream credit are messages
    too. So neither side's slots may fill with calls:

    - requests: the peer may leave every request unread while it is busy (CallLimits), so at
      most a quarter of *its* slots carry outstanding calls (``max_calls``);
    - replies: an outstanding call may leave one reply unread here, a stream one item per unit
      of its window and its final reply; those ``units`` stay within half of *our* slots. A
      stream starts with a window of 1 and takes more (up to STREAM_WINDOW) only from units
      free at the time, and such extra units stay within a quarter of ours, so that streams
      opened and left unread never keep new calls out.

    The rest stays free for the peer's own calls to us, their cancellations and credit, and
    everything else on the channel. A call waits (FIFO) for room, under its deadline, and gives
    its room back once the server owes it nothing more.
    """

    def __init__(self, max_calls: int, max_units: int) -> None:
        super().__init__()
        self.max_calls = max_calls
        self.max_units = max_units
        self.max_extra = max_units // 4
        self.calls = 0
        self.units = 0
        self.extra = 0
        self.riding = 0  # calls back in their callers' rooms (``ride``), counted in calls and units too
        self.outliving = 0  # of those, calls whose room closed before they ended (``CallerRoom.close``)
        self._riding_again: list[asyncio.Future[None]] = []  # calls back waiting for outliving to be 0
        self.failure: BaseException | None = None  # the channel closed: no call will get room

    def fail(self, exc: BaseException | None) -> None:
        """The channel closed: calls waiting for room fail with its error, and so do later ones,
        each with a copy of its own (``_fail_waiters``, ``acquire``): raised itself, the one
        error would take each failing call's frames into its traceback, and their arguments
        with them, for as long as it is kept."""
        self.failure = exc if exc is not None else ClosedResourceError("the channel closed")
        self._fail_waiters(lambda _n: self.failure)

    def _fits(self, units: int) -> bool:
        return self.calls < self.max_calls and self.units + units <= self.max_units

    def _take(self, units: int) -> None:
        self.calls += 1
        self.units += units

    def _give(self, units: int) -> None:
        self.calls -= 1
        self.units -= units

    async def acquire(self, units: int) -> None:
        """Room for one more call that may leave ``units`` replies unread here."""
        if self.failure is not None:
            raise fresh(self.failure)
        await self._admit(units)

    def ride(self, room: CallerRoom, channel: Channel, units: int) -> bool:
        """Room for a call back that rides on the call it serves (``CallerRoom``), at once, if
        ``room`` is free: the counts may pass ``max_calls`` and ``max_units`` for a while, which
        only holds up the calls that wait. The room keeps one place for a reply here; a stream's
        second (``units`` 2: an item and its final reply) must fit the places for replies not
        taken by such rides. (Released with ``release(..., rode=True)`` and ``room.give``.)

        No call rides while one that rode outlives its room (``outliving``): it holds places
        nothing keeps for it any more (its request may wait unread at the peer, where the room's
        final reply now goes too) until it ends, and were calls to ride on meanwhile, the rooms
        of ever new calls could leave ever more such behind. So what rides past ``max_calls`` is
        at most one call per call of the peer being served here (its own ``max_calls`` of them),
        backed by their rooms, or left behind by them at most once before the next call waits."""
        if self.failure is not None:
            raise fresh(self.failure)
        if self.outliving or self.units - self.riding + units - 1 > self.max_units or not room.take(channel):
            return False
        self._take(units)
        self.riding += 1
        room.outlived = self._outlived
        return True

    def _outlived(self) -> None:
        self.outliving += 1

    def riding_again(self) -> asyncio.Future[None]:
        """Done once no call that rode outlives its room (``ride``): calls back may ride again."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._riding_again.append(fut)
        return fut

    def ended_outliving(self) -> None:
        """A call that outlived its room has ended."""
        self.outliving -= 1
        if not self.outliving:
            waiters, self._riding_again = self._riding_again, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def free_now(self, units: int) -> bool:
        """Would ``acquire(units)`` go in at once?"""
        return self.failure is None and not self._waiters and self._fits(units)

    def acquire_now(self, units: int) -> bool:
        """``acquire(units)`` where it goes in at once, without awaiting: True, and taken; else
        False, nothing taken (a failed channel's included: ``acquire`` then raises its error)."""
        return self.failure is None and self.admit_now(units)

    def take_extra(self, want: int) -> int:
        """Up to ``want`` more units for a stream's window, if they are free now; never waits."""
        if want <= 0 or self._waiters:
            return 0
        n = min(want, self.max_extra - self.extra, self.max_units - self.units)
        if n <= 0:
            return 0
        self.units += n
        self.extra += n
        return n

    def release(self, units: int, extra: int = 0, *, rode: bool = False) -> None:
        self.extra -= extra
        self.riding -= rode
        self._release(units + extra)


def _new_budget(peer: Peer) -> _Budget:
    ours = peer.node.config.limits.max_unexpected
    theirs = peer.channel.remote_limits.max_unexpected  # announced in the data-plane handshake
    return _Budget(max(1, min(_MAX_OUTSTANDING, theirs // 4)), max(2, ours // 2))


_budgets: PerChannel[_Budget] = PerChannel(_new_budget)


def _budget(peer: Peer) -> _Budget:
    return _budgets(peer)


class _Progress:
    __slots__ = ("args", "finished", "sent", "whole")

    def __init__(self) -> None:
        self.args = ArgsState.NONE  # how far the arguments sent after GO got
        self.finished = False  # a terminal reply arrived: the server owes us nothing more
        self.sent = False  # the request may have reached the server
        self.whole = False  # the request's send returned: it did reach the server


_META_LEN = 5  # the request's int64 envelope (``meta``)


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Preparing:
    """The call's message as it travels with the arguments inline, ``(meta, name, args, kwargs)``,
    its meta tensor not yet filled in (``_request`` does): the arguments are flattened (and any
    packed) once per call, whichever way they go. An argument tensorwire cannot move fails here,
    locally, before the call waits for anything. Flattened at the call; awaited, it packs what
    needs a copy thread (its ``ready`` is the message where nothing does: no await, no frame)."""
    if not isinstance(name, str):
        raise ConfigurationError(f"a method name is a string, not {type(name).__name__}")
    return encode_off_loop((np.empty(_META_LEN, np.int64), name, args, kwargs))


def _request(
    call_id: int, name: str, kind: Kind, deadline_at: float | None, whole: Outgoing, window: int = 0
) -> tuple[Outgoing, Outgoing | None]:
    """The request, with the arguments inline when they are small (``whole``, its meta filled in
    now); else the request alone and the arguments apart. Made once the call has its room: the
    deadline it carries is what is left of ``deadline_at`` (loop time) now, after any wait for
    that room."""
    left = None if deadline_at is None else deadline_at - asyncio.get_running_loop().time()
    head = whole.arrays[0]
    assert isinstance(head, np.ndarray)  # the meta tensor _arguments put first
    nbytes = whole.nbytes - head.nbytes
    if nbytes <= INLINE_BYTES:
        fill_meta(head, call_id, left, kind, -1, window)
        return whole, None
    # the arguments alone, (args, kwargs): the same message as flattening them again would make
    return encode((meta(call_id, left, kind, nbytes, window), name)), whole.items_from(2)


async def _next_reply(channel: Channel, tag: int) -> tuple[tuple[Any, ...], Receipt]:
    """The next reply on ``tag``, and the receipt of how it came."""
    got = await channel.recv(tag, None)
    msg = got[0]
    if not (isinstance(msg, tuple) and msg and isinstance(msg[0], int)):
        raise ProtocolError(f"malformed RPC reply ({type(msg).__name__})")
    return got


def _terminal(msg: tuple[Any, ...], progress: _Progress, method: str, where: str) -> Any:
    """Handle a reply that should end the call: its value, or the error it carries."""
    kind = msg[0]
    if kind not in TERMINAL:
        raise ProtocolError(f"unexpected RPC reply kind {kind} for {method}")
    progress.finished = True
    if kind == Reply.RESULT and len(msg) == 2:
        return msg[1]
    if kind == Reply.ERROR:
        raise_error(msg, method, where)
    if kind == Reply.CANCELLED:
        raise RemoteError(f"{method} on {where} was cancelled by the server", method=method)
    raise ProtocolError(f"malformed RPC reply for {method}")


def _nothing() -> None:
    pass


async def _send_request(
    channel: Channel,
    call_id: int,
    request: Outgoing,
    payload: Outgoing | None,
    progress: _Progress,
    name: str,
    where: str,
    before_reply: Callable[[], None] = _nothing,
) -> tuple[Receipt, Receipt | None]:
    """Send the request, and the arguments apart once the server says GO; their receipts.
    ``before_reply`` is called once nothing but the reply comes on the call's tag any more
    (before the request goes, or after GO), to post its recv before the reply can come."""
    progress.sent = True
    if payload is None:
        before_reply()
    try:
        sent = await channel.send(REQUEST_TAG, request)
    except MessageRefused:
        progress.sent = False  # none of it went out (past the peer's limits)
        raise
    progress.whole = True
    if payload is None:
        return sent, None
    msg, _ = await _next_reply(channel, reply_tag(call_id))
    if msg[0] != Reply.GO:
        _terminal(msg, progress, name, where)
        raise ProtocolError(f"{name}: the server answered before it received the arguments")
    before_reply()
    progress.args = ArgsState.INTERRUPTED  # until the send returns
    sent_args = await channel.send(args_tag(call_id), payload)
    progress.args = ArgsState.SENT
    return sent, sent_args


def _finish(peer: Peer, call_id: int, progress: _Progress, release: Callable[[], None]) -> None:
    """The call is over here: give its room back at once if the server owes it nothing more;
    else ask the server to cancel it, and give the room back once what it still sends is drained."""
    if progress.finished or not progress.sent or peer.channel.state is not ChannelState.OPEN:
        release()
        return
    progress.finished = True
    if not progress.whole:
        # cancelled while the request was being sent (waiting for a slot, most likely): it may
        # never have arrived, and then no answer comes to end the drain for a minute. Give the
        # room back now; the drain receives whatever does come, so nothing piles up unread.
        release()
        release = _nothing
    peer._spawn(_cancel_and_drain(peer.channel, call_id, progress.args, release, owed=progress.whole))


async def _room(budget: _Budget, channel: Channel, units: int) -> CallerRoom | None:
    """Room for a call on ``channel`` that may leave ``units`` replies unread here: a place in
    ``budget`` (None), or, for a call back to the caller of the method this node serves, the
    room that caller keeps for its call (returned, taken), whichever comes first. A method's
    first call back rides at once; one made while another rides waits in line for a place and,
    meanwhile, for that room to be given back (``CallerRoom``), so that calls back never wait
    only behind calls that wait for their own methods' calls back. While a call that rode
    outlives its room none rides (``_Budget.ride``), and a call back waits for that to end
    instead of for its room."""
    room = call_back_room(channel)
    if room is None or (room.busy and budget.free_now(units)):
        await budget.acquire(units)  # (a place free now: at once)
        return None
    if budget.ride(room, channel, units):
        return room
    place = asyncio.ensure_future(budget.acquire(units))
    try:
        while room.open:
            freed = room.freed() if not budget.outliving else budget.riding_again()
            try:
                await asyncio.wait((freed, place), return_when=asyncio.FIRST_COMPLETED)
            finally:
                freed.cancel()
            if place.done():
                break
            if budget.ride(room, channel, units):
                if not place.cancel() and _granted(place):  # (granted as it is cancelled, it gives it back)
                    budget.release(units)
                return room
        await place  # the place (or the channel's failure)
    except BaseException:
        if not place.cancel() and _granted(place):
            budget.release(units)
        raise
    return None


def _granted(place: asyncio.Future[None]) -> bool:
    return place.done() and not place.cancelled() and place.exception() is None


# an out= that no RPC reply (always a tuple) fits: a recv with it takes nothing, it raises
# ShapeMismatchError once a message waits on its tag (leaving it there)
_NO_REPLY = np.empty(0, np.uint8)


async def _cancel_and_drain(
    channel: Channel, call_id: int, args: ArgsState, release: Callable[[], None], *, owed: bool
) -> None:
    """Tell the server to cancel, then take and drop what the call still gets, up to its terminal
    reply. A reply that waits for our go-ahead (rendezvous) is never given it: the server is told
    to take it back (WITHDRAW) and ends the call with CANCELLED instead, so none of its bytes
    move, and a reply we have no memory for does not hold its send, its slot and its tensors at
    the server for good; one that came eager and waits unread for want of memory is dropped
    here unread (``Channel.discard``), which completes the server's send.
    The call's room comes back once that terminal reply is in, DRAIN_SECONDS at the latest. When
    the request reached the server (``owed``) the drain goes on past that until the terminal
    reply comes or the channel fails: the server answers every request it reads, however late
    (saturated for longer than that, the request waited unread), and that answer must not stay
    unread here for good, holding a message slot (and, eager, its memory)."""
    tag = reply_tag(call_id)
    withdrawn = False
    released = False

    def give_back() -> None:
        nonlocal released
        if not released:
            released = True
            release()

    late = asyncio.get_running_loop().call_later(DRAIN_SECONDS, give_back)
    try:
        async with asyncio.timeout(None if owed else DRAIN_SECONDS):
            await channel.send(CONTROL_TAG, prepare((int(Control.CANCEL), call_id, int(args))))
            if args is ArgsState.INTERRUPTED:
                # the cut-short arguments may or may not have arrived: a tombstone tells the server
                await channel.send(args_tag(call_id), prepare(None))
            while True:
                waiting = _unpulled(channel, tag)
                if waiting is None:
                    try:
                        await channel.recv(tag, _NO_REPLY)  # until a message waits here, unpulled
                        continue  # (not a reply: it fit, and is gone)
                    except ShapeMismatchError:
                        pass
                    waiting = _unpulled(channel, tag)
                if waiting is None:
                    head = channel.mailbox.oldest(tag)
                    try:
                        msg, _ = await channel.recv(tag, None)  # whole, or on its way: it needs no go-ahead
                    except TransferError:
                        # dropped as it came, for want of memory here (tcp): gone, and no more
                        # the end of the drain than a reply taken whole, unless it was the
                        # terminal one (what comes after it must still be taken, or it stays
                        # unread for good, holding its slots)
                        if (
                            channel.state is not ChannelState.OPEN
                            or head is None
                            or channel.mailbox.oldest(tag) is head
                        ):
                            raise
                        if _reply_kind(head) in TERMINAL:
                            return
                        continue
                    if isinstance(msg, tuple) and msg and msg[0] in TERMINAL:
                        return
                    continue
                if waiting.protocol != "rendezvous":  # dropped unread (_unpulled)
                    if _reply_kind(waiting) in TERMINAL:
                        return
                    continue
                if not withdrawn:
                    withdrawn = True
                    await channel.send(CONTROL_TAG, prepare((int(Control.WITHDRAW), call_id, 0)))
                await asyncio.wait((waiting.done,))  # taken back (or the channel failed)
    except (TensorWireError, TimeoutError):
        pass
    finally:
        late.cancel()
        give_back()


def _unpulled(channel: Channel, tag: int) -> Arrival | None:
    """The oldest message waiting on ``tag``, if nobody has asked for it yet and it waits for
    that: a rendezvous one (its sender holds it until our go-ahead; WITHDRAW takes it back), or
    an eager one its payload already handed over, that the transport keeps unread for want of
    memory here (it holds its sender's send): that one is dropped unread now, if the transport
    can (``Channel.discard``), and returned gone; else None."""
    arrival = channel.mailbox.oldest(tag)
    if arrival is None or not arrival.rendezvous or arrival.pulling or arrival.done.done():
        return None
    if arrival.go_ahead:
        # its go-ahead went already (a recv of it was cancelled after it: ucx ``take_back``):
        # a WITHDRAW comes too late and ``done`` waits for a pull, so it is received and dropped
        # (before, it stayed unread for good, holding a message slot)
        return None
    if arrival.protocol != "rendezvous" and not channel.discard(arrival):
        return None  # (its recv fails for want of memory, as any recv of it would)
    return arrival


def _reply_kind(arrival: Arrival) -> int | None:
    """The kind of the reply ``arrival`` carries, read off its header (a reply is a tuple whose
    first item is its kind); None if it is not a reply."""
    node = arrival.tree
    if node.WhichOneof("kind") != "tuple" or not node.tuple.items:
        return None
    first = node.tuple.items[0]
    return first.int_value if first.WhichOneof("kind") == "int_value" else None


def _expired(name: str, left: float, what: str = "the reply came") -> DeadlineExceeded:
    return DeadlineExceeded(f"{name}: its {left:.3g} s deadline ran out before {what}")


async def call(
    peer: Peer,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    deadline: float | None,
    out: Any = None,
    *,
    want_receipt: bool = False,
) -> tuple[Any, CallReceipt | None]:
    """``peer.call``: run ``name`` on the peer; its result (landed in ``out`` if given), and how
    the call's messages moved (None unless ``want_receipt``: the channel's receipts are passed
    along either way, and only this one is built on request)."""
    t0 = time.perf_counter() if want_receipt else 0.0
    if out is not None:
        # tensors the result could never land in: refused before the method runs
        check_out(out, None if type(out) is np.ndarray else _check_out(out))
    left = effective_deadline(deadline)
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"{name}: the deadline had passed before the call was made")
    call_id = next(_ids)
    channel = peer.channel
    where = peer.remote_address
    progress = _Progress()
    budget = _budget(peer)
    tm = asyncio.timeout(left) if left is not None else timeout_at(None)
    try:
        with lending():  # (outside the timeout: nothing in taking the slot back waits)
            async with tm:
                # packing the arguments (a large strided tensor: in a copy thread) is part of the call
                preparing = _arguments(name, args, kwargs)
                arguments = preparing.ready
                if arguments is None:
                    arguments = await preparing
                # one reply at a time may wait here unread: a place free now, and no caller's
                # room to ride (not a call back), is taken at once (``_room``'s first case, unawaited)
                if call_back_room(channel) is None and budget.acquire_now(1):
                    room = None
                else:
                    room = await _room(budget, channel, 1)
                release = _releasing(budget, room, 1)
                try:
                    request, payload = _request(call_id, name, Kind.UNARY, tm.when(), arguments)
                    if out is not None:
                        value, sent, sent_args, came = await _call_into(
                            channel, call_id, request, payload, out, progress, name, where
                        )
                    else:
                        sent, sent_args = await _send_request(channel, call_id, request, payload, progress, name, where)
                        try:
                            msg, came = await _next_reply(channel, reply_tag(call_id))
                        except TransferError:
                            _gone(channel, reply_tag(call_id), progress)
                            raise
                        value = _terminal(msg, progress, name, where)
                    if not want_receipt:
                        return value, None
                    return value, CallReceipt(sent, sent_args, came, time.perf_counter() - t0)
                finally:
                    _finish(peer, call_id, progress, release)
    except TimeoutError as exc:
        if left is not None and tm.expired():
            raise _expired(name, left) from exc
        raise


def _releasing(
    budget: _Budget, room: CallerRoom | None, units: int, extra: Callable[[], int] = int
) -> Callable[[], None]:
    """What gives a call's room back: its place in ``budget`` (``units``, and a stream's
    ``extra()`` units past them), and the caller's ``room`` it rode on, if any, once nothing
    more comes for it (``_finish``)."""
    if room is None:
        return lambda: budget.release(units, extra())

    def release() -> None:
        if not room.open:  # (it outlived its room, CallerRoom.close)
            budget.ended_outliving()
        budget.release(units, extra(), rode=True)
        room.give()

    return release


def _check_out(out: Any) -> list[TensorView]:
    """Refuse an ``_out=`` that is not tensors alone (in dicts, lists and tuples), at least one;
    its tensors, as views. The result's tensors land in ``_out`` and the call returns ``_out``
    itself: the receive matches tensors only, so an ``_out`` without any would take an error
    reply (which carries none) for a result and swallow it, and a scalar in it would come back
    as it was, not as the method returned it."""
    views: list[TensorView] = []
    _out_tensors(out, 0, views)
    if not views:
        raise ConfigurationError("_out= holds no tensor: give the tensors the result lands in, or no _out")
    return views


def _out_tensors(obj: Any, depth: int, views: list[TensorView]) -> None:
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif is_tensor(obj):
        views.append(as_view(obj))
        return
    else:
        raise ConfigurationError(
            f"_out= holds {type(obj).__name__} (not a tensor): it takes the result's tensors only (in dicts, lists and "
            "tuples) and the call returns it as it is; call without _out= for a result with scalars"
        )
    if depth > MAX_DEPTH:
        raise ConfigurationError(f"_out= is nested deeper than {MAX_DEPTH} levels")
    for x in items:
        _out_tensors(x, depth + 1, views)


async def _call_into(
    channel: Channel,
    call_id: int,
    request: Outgoing,
    payload: Outgoing | None,
    out: Any,
    progress: _Progress,
    name: str,
    where: str,
) -> tuple[Any, Receipt, Receipt | None, Receipt]:
    """A unary call whose result lands in ``out``: its recv is posted before the request (or
    the arguments apart) goes, so that the result lands there directly however soon it comes
    (posted once the send had returned, a large result over ucx came first, into a buffer of
    ours, and was copied: staged). The result, and the receipts of request, arguments, result."""
    reply: asyncio.Task[tuple[Any, Receipt]] | None = None

    def post() -> None:
        nonlocal reply
        reply = asyncio.ensure_future(_reply_into(channel, reply_tag(call_id), out, progress, name, where))

    try:
        sent, sent_args = await _send_request(channel, call_id, request, payload, progress, name, where, post)
        assert reply is not None
        value, came = await reply
    except BaseException:
        if reply is not None:
            # its recv is given up: nothing lands in out= after this returns, also through a
            # second cancellation (it joins the first); the call's own failure is what is raised
            with contextlib.suppress(asyncio.CancelledError):
                await call_off(reply)
        raise
    return value, sent, sent_args, came


async def _reply_into(
    channel: Channel, tag: int, out: Any, progress: _Progress, name: str, where: str
) -> tuple[Any, Receipt]:
    """Receive the result straight into the caller's ``out`` tensors (posted before it arrives);
    ``out``, and the receipt of how the result came. ``out`` holds a tensor (``_check_out``), so
    an error or a cancellation, which carries none, never matches it and is raised below."""
    try:
        _, came = await channel.recv(tag, (int(Reply.RESULT), out))
    except ShapeMismatchError as exc:
        # not a result of that shape: an error (raised here), or a result that does not fit
        try:
            msg, _ = await _next_reply(channel, tag)
        except TransferError as lost:
            # no memory here to take it whole: a result (an error carries no tensors) that does
            # not fit, which the drain drops unread if it still waits (``_finish``)
            if channel.state is not ChannelState.OPEN:
                raise
            _gone(channel, tag, progress)
            raise ShapeMismatchError(
                f"{name}'s result does not fit _out= (it was dropped: there was no memory here to take it "
                f"without _out= either): {_misfit(exc)}"
            ) from lost
        _terminal(msg, progress, name, where)
        raise ShapeMismatchError(f"{name}'s result does not fit _out= (it was dropped): {_misfit(exc)}") from None
    progress.finished = True
    return out, came


_IN_REPLY = "out=[1]"  # (where the recv's out= ``(RESULT, out)`` holds the caller's _out)


def _misfit(exc: ShapeMismatchError) -> str:
    """The recv's account of a result that does not fit, with its places named as the caller's
    ``_out`` has them, not as the ``(RESULT, _out)`` the reply was received into."""
    text = str(exc)
    return "_out=" + text[len(_IN_REPLY) :] if text.startswith(_IN_REPLY) else text


def _gone(channel: Channel, tag: int, progress: _Progress) -> None:
    """A unary call's reply could not be received (TransferError: no memory for it here). If
    nothing waits on its tag any more, it came and was dropped on arrival (a transport that must
    take the bytes off the wire): it was the terminal reply (the only message a unary call
    gets after its request), so the server owes the call nothing more and nothing is drained."""
    if channel.state is ChannelState.OPEN and channel.mailbox.oldest(tag) is None:
        progress.finished = True


async def stream(
    peer: Peer,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    deadline: float | None,
    *,
    receipts: bool = False,
) -> AsyncGenerator[Any, None]:
    """``peer.stream``: the items a streaming method yields, as they come (with ``receipts``,
    each as ``(item, Receipt)``: how the message that carried it came). Leaving the loop early
    (break, an exception, aclose) cancels the method on the server. ``_deadline`` covers the
    whole stream: no item is handed out once it has passed, even one that came in time."""
    if "_out" in kwargs:  # call's own keyword, which no method may take: never an argument
        raise ConfigurationError(f"{name}: peer.stream takes no _out= (it is peer.call's); items come as they are")
    left = effective_deadline(deadline)
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"{name}: the deadline had passed before the call was made")
    call_id = next(_ids)
    channel = peer.channel
    where = peer.remote_address
    tag = reply_tag(call_id)
    progress = _Progress()
    deadline_at = None if left is None else asyncio.get_running_loop().time() + left
    budget = _budget(peer)
    extra = 0  # units beyond the first item and the final reply: the window past 1
    tm = timeout_at(deadline_at)
    try:  # a timeout must never span a yield: each wait has one of its own (and so does a loan)
        with lending():
            async with tm:
                arguments = await _arguments(name, args, kwargs)  # (its packing counts, as in call)
                room = await _room(budget, channel, 2)  # one item, and the final reply
        # Nothing from here to the try can raise, so the room is never lost on the way: the
        # timeout's exit raises only when its block did, and a deadline or cancellation that
        # comes while _room waits is raised inside it, where the room is given back (even one
        # granted just then). Nothing that waits or raises may go between them.
        try:
            extra = budget.take_extra(STREAM_WINDOW - 1)
            window = 1 + extra
            request, payload = _request(call_id, name, Kind.STREAM, deadline_at, arguments, window)
            tm = timeout_at(deadline_at)
            with lending():
                async with tm:
                    await _send_request(channel, call_id, request, payload, progress, name, where)
            taken = 0
            loop = asyncio.get_running_loop()
            while True:
                if deadline_at is not None and loop.time() >= deadline_at:
                    # items already here would come at once, past the deadline, a window of them
                    assert left is not None
                    raise _expired(name, left, "the stream ended")
                tm = timeout_at(deadline_at)
                with lending():
                    async with tm:
                        msg, came = await _next_reply(channel, tag)
                if msg[0] != Reply.ITEM or len(msg) != 2:
                    _terminal(msg, progress, name, where)
                    return
                taken += 1
                if taken >= max(1, window // 2):
                    more = budget.take_extra(STREAM_WINDOW - window)  # a window that grows as it is read
                    window += more
                    extra += more
                    tm = timeout_at(deadline_at)
                    with lending():
                        async with tm:
                            await channel.send(CONTROL_TAG, prepare((int(Control.CREDIT), call_id, taken + more)))
                    taken = 0
                yield (msg[1], came) if receipts else msg[1]
        finally:
            _finish(peer, call_id, progress, _releasing(budget, room, 2, lambda: extra))
    except TimeoutError as exc:
        if left is not None and tm.expired():
            raise _expired(name, left, "the stream ended") from exc
        raise
