"""The serving side of tensor RPC: per-peer request and control loops, one task per call.

Every peer of a node gets two background loops (started when the peer is adopted, cancelled
when it closes): one reads requests, one reads cancellations and stream acknowledgements. The
request reader takes a node-wide slot (``CallLimits.max_concurrent``) for the request it read
before anything reads the next one, so a saturated node stops reading and its callers wait on
the transport's own credit: backpressure all the way back, never an unbounded queue. Then it
hands the reading on to a fresh task and serves its request itself, so each call runs in its
own task (a slow call never holds up another) and starts in the loop iteration its request
arrived in. Argument bytes count against ``CallLimits.max_inflight_bytes`` before they move.
A call's deadline counts from when its request arrived, however long it then waited unread.
A request its caller cancelled before it was admitted is answered at once, without a slot.
A method that waits for calls it made lends its slot meanwhile (``_registry.SlotLoan``), so
that nodes whose methods call each other back cannot fill each other's slots with waiters; a
method's call back to its caller (a call or a stream, one at a time) goes in the room that
caller keeps for the call (``_registry.CallerRoom``), so neither can they fill each other's
outstanding calls.

Every request ends with a terminal reply, whatever the method did: an error whose text cannot
be encoded is escaped, and a reply that does not fit the caller's limits becomes a brief error
that does (``Limits`` keeps ``max_header_bytes`` well above its size); one its caller will
never take (WITHDRAW: it waits, unmoved, for a go-ahead that will not come) is taken back and
becomes CANCELLED, so that the call's slot and result do not wait for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable
from typing import TYPE_CHECKING, Any, cast

from ..errors import (
    ConfigurationError,
    DeadlineExceeded,
    InvalidArguments,
    MessageRefused,
    MethodNotFound,
    RemoteError,
    TensorWireError,
    TransferError,
)
from ..tensors import prepare
from ..transports import Channel, ChannelState, Receipt
from ._codec import encode_off_loop
from ._deadline import served_under, timeout_at
from ._protocol import (
    CONTROL_TAG,
    REQUEST_TAG,
    STREAM_WINDOW,
    ArgsState,
    Code,
    Control,
    Kind,
    Reply,
    Request,
    args_tag,
    brief_error,
    describe,
    error_reply,
    parse_request,
    reply_tag,
    split_args,
    unsent_reply,
)
from ._registry import CallerRoom, Method, MethodRegistry, SlotLoan, Slots, serving

if TYPE_CHECKING:
    from .._peer import Peer

log = logging.getLogger(__name__)

__all__ = ["attach", "run_local", "server_of", "start_method"]

DRAIN_SECONDS = 60.0  # how long to wait for a message a finished call still owes us
ARGS_SECONDS = 60.0  # how long an admitted call waits for the arguments it asked for (GO) to begin arriving
_EARLY_SECONDS = 60.0  # how long a cancellation for a request not read yet is remembered
_EARLY_MAX = 4096
_META_BYTES = 40  # the int64[5] meta tensor of every request


def start_method(method: Method, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> Any:
    """Call ``method.fn``: a coroutine or an async generator. Calling an ``async def`` runs none
    of its body, so a TypeError here is always about the arguments, never from the method."""
    try:
        return method.fn(*args, **kwargs)
    except TypeError as exc:
        raise InvalidArguments(f"arguments do not fit {method.name}{method.signature}: {exc}") from exc


def not_found(registry: MethodRegistry, name: str) -> MethodNotFound:
    names = sorted(registry)
    offered = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return MethodNotFound(f"no method named {name[:256]!r}; this node offers: {offered or 'none'}")


def _check_arg_bytes(registry: MethodRegistry, method: Method, nbytes: int) -> None:
    """InvalidArguments if ``nbytes`` of arguments break the limits that hold now."""
    limit = registry.arg_limit(method)
    if nbytes > limit:
        raise InvalidArguments(
            f"the arguments of {method.name!r} carry {nbytes} tensor bytes; the limit here is {limit}"
        )


def _code(exc: BaseException) -> Code:
    """What an error raised before the method ran says of the call (the lookup, the arguments,
    the deadline); once the method runs, what it raises is its own (``_Call.in_method``)."""
    if isinstance(exc, MethodNotFound):
        return Code.NOT_FOUND
    if isinstance(exc, (InvalidArguments, TransferError)):
        # (TransferError: the arguments could not be received here, or never came.) The node
        # refused the call before its method ran, as for arguments past its limits: the caller
        # gets InvalidArguments (its remote_type still says TransferError), never taken for an
        # error the method raised (a pipeline driver then waited for the other stages)
        return Code.INVALID
    if isinstance(exc, DeadlineExceeded):
        return Code.DEADLINE
    return Code.RAISED


class _Call:
    __slots__ = (
        "args_done",
        "cancel_requested",
        "cancel_state",
        "credit",
        "go_sent",
        "in_method",
        "inline_bytes",
        "received_at",
        "receiving_args",
        "req",
        "responding",
        "task",
        "tombstone_seen",
        "wake",
        "withdrawn",
    )

    def __init__(self, req: Request, received_at: float, inline_bytes: int, task: asyncio.Task[Any]) -> None:
        self.req = req
        self.received_at = received_at
        self.inline_bytes = inline_bytes
        self.task = task  # reads the request, waits for a slot, runs the method and replies
        self.cancel_requested = False
        self.cancel_state: ArgsState | None = None  # what the caller said of its arguments
        self.responding = False  # the terminal reply is on its way: too late to cancel
        self.withdrawn = False  # the caller will not take that reply (WITHDRAW): its send is cancelled
        self.go_sent = False
        self.receiving_args = False
        self.args_done = False  # the arguments (or the caller's tombstone) were received
        self.tombstone_seen = False
        # the method runs: what is raised now is its own error, whatever its type (a MethodNotFound
        # from a call it makes says nothing of this call's method)
        self.in_method = False
        self.credit = req.window  # stream items the caller has room for (it grants more)
        self.wake: asyncio.Future[None] | None = None

    def cancel(self, state: ArgsState) -> None:
        self.cancel_state = state
        if self.responding or self.cancel_requested:
            return
        self.cancel_requested = True
        if self.receiving_args and state is not ArgsState.NONE:
            return  # the arguments or a tombstone are coming: the receive ends by itself
        self.task.cancel()

    def withdraw(self) -> None:
        """The caller will never give the go-ahead for the terminal reply that waits for it
        (rendezvous; it cannot take it, or it gave up before it came): take it back. Nothing of
        it has moved, so cancelling its send withdraws it whole, and CANCELLED ends the call."""
        if self.responding and not self.withdrawn:
            self.withdrawn = True
            self.task.cancel()

    def grant(self, n: int) -> None:
        self.credit = min(self.credit + n, STREAM_WINDOW)
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


async def _let_go(channel: Channel, tag: int) -> tuple[Any, Receipt] | bool:
    """Let go of the oldest message on ``tag``, one that could not be received here (no memory
    for it): dropped unread where the transport can (``Channel.discard``: its payload lands
    nowhere, its sender's send completes), else taken with its bytes let go (``keep=False``;
    returned if it came whole after all). True: it is gone (or none was left: dropped as it
    came); False: it stays at the head of its tag's line."""
    head = channel.mailbox.oldest(tag)
    if head is None:
        return True
    if channel.discard(head):  # (one not kept unread, or pulled already: False)
        return True
    try:
        return await channel.recv(tag, None, keep=False)
    except TensorWireError:
        return channel.state is ChannelState.OPEN and channel.mailbox.oldest(tag) is not head


class PeerServer:
    """Serves one peer's calls against one node's registry."""

    def __init__(self, peer: Peer, registry: MethodRegistry) -> None:
        self.peer = peer
        self.registry = registry
        self.calls: dict[int, _Call] = {}
        # a peer that goes away while the request reader waits for a slot never reads again, so
        # the reader cannot be what stops its calls
        peer.channel.add_close_callback(lambda _exc: self._stop())
        self._early: OrderedDict[int, float] = OrderedDict()  # cancels for requests not read yet
        self._tombstoned: OrderedDict[int, float] = OrderedDict()  # took a tombstone before its cancel
        self._malformed = 0

    def _warn(self, what: str) -> None:
        self._malformed += 1
        if self._malformed == 1 or self._malformed % 1000 == 0:
            log.warning("%s from %s dropped (%d so far)", what, self.peer.remote_address, self._malformed)

    # -- loops --------------------------------------------------------------------------------
    async def serve_requests(self) -> None:
        """Read one request, hand the reading on to a fresh task, then serve the request in this
        one: the call starts in the same loop iteration its request arrived in."""
        channel = self.peer.channel
        loop = asyncio.get_running_loop()
        while True:
            # a request that waited unread (the node was saturated) has spent part of its deadline
            # here already: the deadline counts from its arrival, not from its reading
            waited = channel.mailbox.waited(REQUEST_TAG)
            arrived = loop.time() - waited if waited else None
            got = await self._take(REQUEST_TAG, "RPC request")
            if got is None:
                self._stop()  # the channel is gone: callers see that themselves
                return
            env, receipt = got
            req = parse_request(env)
            if req is None:
                self._warn("malformed RPC request")
            elif req.call_id in self.calls:
                self._warn(f"RPC request reusing the id of a running call ({req.call_id})")
            else:
                break
        inline = receipt.nbytes - _META_BYTES if req.nbytes < 0 else 0
        task = asyncio.current_task()
        assert task is not None  # peer._spawn runs this loop as a task
        call = _Call(req, loop.time() if arrived is None else arrived, inline, task)
        if self._early.pop(req.call_id, None) is not None:
            call.cancel_requested = True
        self.calls[req.call_id] = call  # a cancel for it now interrupts the wait for a slot
        slots = self.registry.slots
        try:
            if not call.cancel_requested and not slots.acquire_now():
                await slots.acquire()  # backpressure: no slot, no reading
        except asyncio.CancelledError:
            if not call.cancel_requested or task.cancelling() > 1:
                self.calls.pop(req.call_id, None)
                raise  # the peer or node is closing
            task.uncancel()  # its caller gave up: answer at once, no slot needed
        except BaseException:
            self.calls.pop(req.call_id, None)
            raise
        self.peer._spawn(self.serve_requests())
        await self._run(call, None if call.cancel_requested else slots)

    async def _take(self, tag: int, what: str) -> tuple[Any, Receipt] | None:
        """The next message on a service tag; None once the channel is gone. A message that
        cannot be received while the channel stays open (no memory for it here) is not the
        channel's end: it is let go (``_let_go``) and the next one taken. (Before, the loop
        stopped for good on it: the peer's later requests waited unread, and its calls were
        cancelled.) Only a message that cannot even be let go ends the loop."""
        channel = self.peer.channel
        while True:
            try:
                return await channel.recv(tag, None)
            except TensorWireError:
                if channel.state is not ChannelState.OPEN:
                    return None
            gone = await _let_go(channel, tag)
            if isinstance(gone, tuple):
                return gone
            if not gone:
                return None
            self._warn(f"{what} that could not be received here (no memory for it)")

    def _stop(self) -> None:
        for call in self.calls.values():
            call.task.cancel()

    async def serve_control(self) -> None:
        while True:
            got = await self._take(CONTROL_TAG, "RPC control message")
            if got is None:
                return
            msg = got[0]
            if not (isinstance(msg, tuple) and len(msg) == 3 and all(isinstance(x, int) for x in msg)):
                self._warn("malformed RPC control message")
                continue
            op, call_id, arg = msg
            call = self.calls.get(call_id)
            if op == Control.CANCEL:
                if arg not in (ArgsState.NONE, ArgsState.SENT, ArgsState.INTERRUPTED):
                    self._warn("malformed RPC cancel")
                elif call is not None:
                    call.cancel(ArgsState(arg))
                elif arg == ArgsState.INTERRUPTED:
                    # the call is over; unless it took the caller's tombstone itself, that is coming
                    if self._tombstoned.pop(call_id, None) is None:
                        self.peer._spawn(self._drain(args_tag(call_id), until_tombstone=True))
                else:
                    _remember(self._early, call_id)
            elif op == Control.CREDIT:
                if call is not None:
                    call.grant(arg)
            elif op == Control.WITHDRAW:
                if call is not None:
                    call.withdraw()  # (a call not replying yet: the CANCEL before it stops its sends)
            else:
                self._warn("unknown RPC control message")

    # -- one call -----------------------------------------------------------------------------
    async def _run(self, call: _Call, slots: Slots | None) -> None:
        req = call.req
        loan = None if slots is None else SlotLoan(slots)
        try:
            try:
                if call.cancel_requested:
                    raise asyncio.CancelledError
                reply = await self._execute(call, loan)
            except asyncio.CancelledError as exc:
                if call.cancel_requested:
                    if call.task.cancelling():
                        call.task.uncancel()
                    reply = (Reply.CANCELLED,)
                elif call.task.cancelling() and self._closing():
                    raise  # the peer or node is closing
                else:
                    # a CancelledError nobody here asked for: raised by the method, or the server's
                    # application cancelled its task; the caller still waits: an error like any
                    while call.task.cancelling():
                        call.task.uncancel()
                    reply = error_reply(exc)
            except Exception as exc:
                reply = error_reply(exc, Code.RAISED if call.in_method else _code(exc))
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                # the method's own (a BaseExceptionGroup out of its TaskGroup, say): its caller
                # still gets its answer, and the call its slot back
                reply = error_reply(exc)
            call.responding = True
            try:
                await self._send_reply(reply_tag(req.call_id), reply, req.method)
            except asyncio.CancelledError:
                if not call.withdrawn or call.task.cancelling() > 1 or self._closing():
                    raise  # the peer or node is closing
                call.task.uncancel()
                await self._send(reply_tag(req.call_id), (Reply.CANCELLED,))
        except TensorWireError:
            pass  # the channel went away; the caller sees that itself
        finally:
            if loan is not None and loan.end():  # (a slot lent to a call that outlives this one stays lent)
                loan.slots.release()
            self.calls.pop(req.call_id, None)
            self._clean_args(call)

    def _closing(self) -> bool:
        """Is this peer going away (closed here, or its channel gone)? Then a cancelled call
        answers nothing: nobody would read it."""
        return self.peer._closed or self.peer.channel.state is not ChannelState.OPEN

    def _clean_args(self, call: _Call) -> None:
        """Make sure nothing the caller sent on the call's argument tag stays behind."""
        if not call.go_sent:
            return
        state = call.cancel_state
        if not call.args_done:
            if state is not ArgsState.NONE:  # gave up waiting (safety timeout): take whatever comes
                self.peer._spawn(self._drain(args_tag(call.req.call_id), until_tombstone=False))
        elif state is ArgsState.INTERRUPTED and not call.tombstone_seen:
            self.peer._spawn(self._drain(args_tag(call.req.call_id), until_tombstone=True))

    async def _execute(self, call: _Call, loan: SlotLoan | None) -> tuple[Any, ...]:
        req, reg = call.req, self.registry
        method = reg.get(req.method)
        if method is None:
            raise not_found(reg, req.method)
        if (req.kind is Kind.STREAM) != method.streaming:
            how = "peer.stream" if method.streaming else "peer.call"
            what = "a" if method.streaming else "not a"
            raise InvalidArguments(f"{method.name!r} is {what} streaming method; use {how}")
        if req.error is not None:
            raise req.error
        nbytes = req.nbytes if req.nbytes >= 0 else call.inline_bytes
        _check_arg_bytes(reg, method, nbytes)
        deadline_at = None if req.deadline is None else call.received_at + req.deadline
        budget = reg.budget
        held = 0
        tm = timeout_at(deadline_at)
        try:
            if nbytes:
                async with tm:
                    try:
                        await budget.acquire(nbytes)
                    except ConfigurationError:  # the limits dropped below it while it waited
                        _check_arg_bytes(reg, method, nbytes)
                        raise
                held = nbytes
                # new limits apply to calls waiting too: as a new call would be, it is refused
                _check_arg_bytes(reg, method, nbytes)
            if req.nbytes >= 0:
                # outside the deadline: once GO is out, what the caller sends must be received
                args, kwargs = await self._receive_args(call)
                if call.cancel_requested:
                    raise asyncio.CancelledError
            else:
                args, kwargs = req.args, req.kwargs
            tm = timeout_at(deadline_at)
            async with tm:
                if deadline_at is not None and asyncio.get_running_loop().time() >= deadline_at:
                    raise TimeoutError
                # the caller keeps room for the final reply, unused until the method ends, that
                # one call back to it at a time may use (a stream's too: that reply has a place
                # of its own at the caller, apart from the window of items)
                room = CallerRoom(self.peer.channel)
                with served_under(deadline_at), serving(loan, room):
                    started = start_method(method, args, kwargs)
                    call.in_method = True
                    if method.streaming:
                        unsent = await self._stream(call, cast(AsyncGenerator[Any, None], started))
                        return unsent or (Reply.RESULT, None)
                    return (Reply.RESULT, await cast(Awaitable[Any], started))
        except TimeoutError as exc:
            if tm.expired() or (deadline_at is not None and asyncio.get_running_loop().time() >= deadline_at):
                call.in_method = False  # the server's deadline ran out: not an error of the method's
                raise DeadlineExceeded(f"its {req.deadline:.3g} s deadline ran out on the server") from exc
            raise
        finally:
            if held:
                budget.release(held)

    async def _receive_args(self, call: _Call) -> tuple[tuple[Any, ...], dict[str, Any]]:
        req = call.req
        tag = args_tag(req.call_id)
        channel = self.peer.channel
        call.go_sent = True
        await self._send(reply_tag(req.call_id), (Reply.GO,))
        call.receiving_args = True
        loop = asyncio.get_running_loop()
        tm = asyncio.timeout(None)

        def overdue() -> None:
            # the safety net is for a caller that never sends what it was told GO for: arguments
            # that have begun to arrive (they matched our recv) take as long as they need to move
            if channel.mailbox.has_posted(tag):
                tm.reschedule(loop.time())

        try:
            async with tm:
                watchdog = loop.call_later(ARGS_SECONDS, overdue)
                try:
                    while True:
                        try:
                            payload, receipt = await channel.recv(tag, None)
                            break
                        except asyncio.CancelledError:
                            if call.task.cancelling():
                                raise
                            # not a cancellation of ours: a transport reporting the caller's aborted
                            # send that way (inproc does); what the caller sends next is still coming
                        except TransferError as exc:
                            if channel.state is not ChannelState.OPEN:
                                raise
                            # (a withdrawn message the recv skips itself: SenderAborted.) What is
                            # left is a message that cannot be taken here, for want of memory:
                            # dropped as it came (nothing else comes), or still queued, where a
                            # recv taken again fails the same way at once, for ever, and never
                            # lets the loop run: the call fails, and those bytes go nowhere
                            await self._refuse_args(call, tag)
                            raise TransferError(
                                f"the {req.nbytes}-byte arguments of {req.method[:256]!r} could not be received "
                                f"here: {exc}"
                            ) from exc
                finally:
                    watchdog.cancel()
        except TimeoutError:
            if not tm.expired():
                raise
            raise TransferError(
                f"the arguments of {req.method[:256]!r} did not start to arrive within {ARGS_SECONDS:g} s "
                "of the server asking for them"
            ) from None
        finally:
            call.receiving_args = False
        call.args_done = True
        if payload is None:  # the caller's tombstone: it gave up part way through the arguments
            call.tombstone_seen = True
            call.cancel_requested = True
            if call.cancel_state is None:  # its cancel is still on the way: it must not drain
                _remember(self._tombstoned, req.call_id)
            raise asyncio.CancelledError
        if receipt.nbytes != req.nbytes:
            raise InvalidArguments(f"the request announced {req.nbytes} argument bytes but {receipt.nbytes} came")
        if not (isinstance(payload, tuple) and len(payload) == 2):
            raise InvalidArguments("malformed call arguments: expected (args, kwargs)")
        return split_args(*payload)

    async def _refuse_args(self, call: _Call, tag: int) -> None:
        """The arguments that came on ``tag`` cannot be taken (no memory for them): they are let
        go (``_let_go``), and the call's arguments taken as done with."""
        call.args_done = True
        await _let_go(self.peer.channel, tag)

    async def _stream(self, call: _Call, agen: AsyncGenerator[Any, None]) -> tuple[Any, ...] | None:
        """Send the items ``agen`` yields; the call's error reply if one of them could not be
        sent (it does not encode, or it is past the caller's limits), which ends the stream."""
        tag = reply_tag(call.req.call_id)
        loop = asyncio.get_running_loop()
        async with contextlib.aclosing(agen):
            index = 0
            async for item in agen:
                # a generator that swallowed its cancellation (caught it, or an await inside that
                # lost it) yields on: no item goes to a caller that gave up, which grants no credit
                if call.cancel_requested:
                    raise asyncio.CancelledError
                while call.credit <= 0:  # the caller has not taken the last window yet
                    call.wake = loop.create_future()
                    await call.wake
                call.credit -= 1
                failure = await self._try_send(tag, (Reply.ITEM, item))
                if failure is not None:
                    return unsent_reply(f"{call.req.method}'s item {index} (counting from 0)", failure)
                index += 1
        return None

    async def _send(self, tag: int, msg: tuple[Any, ...]) -> None:
        await self.peer.channel.send(tag, await encode_off_loop(msg))

    async def _send_reply(self, tag: int, reply: tuple[Any, ...], method: str) -> None:
        """Send a call's terminal reply, or, when it cannot go (it does not encode, or it is past
        the caller's limits), an error saying why; at last a brief one, which always fits."""
        failure = await self._try_send(tag, reply)
        if failure is None:
            return
        if reply[0] == Reply.ERROR:  # the method's own error, cut down to what surely fits
            _, code, name, message, _ = reply
            note = f"the full error could not be sent: {describe(failure)}"
            await self.peer.channel.send(tag, prepare(brief_error(name, message, Code(code), note)))
            return
        unsent = unsent_reply(f"{method}'s result", failure)
        if await self._try_send(tag, unsent) is not None:
            _, code, name, message, _ = unsent
            await self.peer.channel.send(tag, prepare(brief_error(name, message, Code(code))))

    async def _try_send(self, tag: int, reply: tuple[Any, ...]) -> Exception | None:
        """Send ``reply``; the error if none of it went out because it does not encode or does
        not fit the caller's limits. Other failures (the channel went away) raise."""
        try:
            # results and items repeat their structure (cached encoding); errors carry fresh text
            if reply[0] in (Reply.RESULT, Reply.ITEM):
                preparing = encode_off_loop(reply)
                msg = preparing.ready
                if msg is None:
                    msg = await preparing
            else:
                msg = prepare(reply)
        except Exception as exc:  # UnsupportedTensorError, or whatever a strange object raised
            return exc
        try:
            await self.peer.channel.send(tag, msg)
        except MessageRefused as exc:
            return exc  # none of it was sent: past the caller's limits
        return None

    async def _drain(self, tag: int, *, until_tombstone: bool) -> None:
        """Receive and drop what a finished call's caller still sends on ``tag``: its arguments,
        or everything up to its tombstone, so nothing lingers."""
        with contextlib.suppress(TensorWireError, TimeoutError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while True:
                    msg, _ = await self.peer.channel.recv(tag, None)
                    if msg is None or not until_tombstone:
                        return


def _remember(ids: OrderedDict[int, float], call_id: int) -> None:
    """Note ``call_id`` for a while (a minute, a few thousand entries at most)."""
    now = time.monotonic()
    ids[call_id] = now
    while ids and (len(ids) > _EARLY_MAX or next(iter(ids.values())) < now - _EARLY_SECONDS):
        ids.popitem(last=False)


# weak both ways: a server refers to its peer, so a strong value here would keep both alive
_servers: weakref.WeakKeyDictionary[Peer, weakref.ref[PeerServer]] = weakref.WeakKeyDictionary()


def server_of(peer: Peer) -> PeerServer | None:
    """The service answering ``peer``'s calls, while it runs (for tests and introspection)."""
    ref = _servers.get(peer)
    return None if ref is None else ref()


def attach(peer: Peer, registry: MethodRegistry) -> PeerServer:
    """Serve ``registry``'s methods to ``peer`` until it closes (Node calls this for every peer)."""
    server = PeerServer(peer, registry)
    _servers[peer] = weakref.ref(server)
    peer._spawn(server.serve_requests())
    peer._spawn(server.serve_control())
    return server


async def run_local(
    registry: MethodRegistry, name: str, args: list[Any], kwargs: dict[str, Any], deadline: float | None
) -> Any:
    """Run a method for the control plane's Invoke: same slots, deadline and errors as a call
    over the data plane, without tensors."""
    method = registry.get(name)
    if method is None:
        raise not_found(registry, name)
    if method.streaming:
        raise InvalidArguments(f"{name!r} is a streaming method: call it through a tensorwire peer (peer.stream)")
    loop = asyncio.get_running_loop()
    deadline_at = None if deadline is None else loop.time() + deadline
    tm = asyncio.timeout_at(deadline_at)
    slots = registry.slots
    try:
        async with tm:
            await slots.acquire()
            loan = SlotLoan(slots)
            try:
                started = start_method(method, args, kwargs)
                try:
                    with served_under(deadline_at), serving(loan):
                        return await started
                except (MethodNotFound, InvalidArguments) as exc:
                    # raised while the method ran (by a call it makes): its own error, which says
                    # nothing of this call's method or arguments
                    raise _raised(name, exc) from exc
                except asyncio.CancelledError as exc:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # the gRPC call was cancelled, or its deadline ran out
                    # a CancelledError nobody asked for (raised by the method): an error like any
                    raise _raised(name, exc) from exc
            finally:
                if loan.end():
                    slots.release()
    except TimeoutError as exc:
        if tm.expired():
            raise DeadlineExceeded(f"{name}: its {deadline:.3g} s deadline ran out on the server") from exc
        raise


def _raised(name: str, exc: BaseException) -> RemoteError:
    """``exc``, raised by the method ``name`` itself, as an error that Invoke reports by its own
    type name, message and traceback."""
    _, _, remote_type, message, tb = error_reply(exc)
    return RemoteError(
        f"{name} raised {remote_type}",
        remote_type=remote_type,
        remote_message=message,
        remote_traceback=tb,
        method=name,
    )
