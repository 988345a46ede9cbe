"""The calling side of tensor RPC: ``peer.call`` and ``peer.stream``.

A call sends one request (arguments inline up to INLINE_BYTES; larger ones after the server's
GO, so they never move before the server has room for them) and waits on a reply tag of its
own. A caller that gives up (cancelled, its deadline ran out, a stream closed early) tells the
server to cancel, and a background task drains the call's remaining replies, so nothing is
left behind in the mailbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConfigurationError,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
    ShapeMismatchError,
    TensorWireError,
)
from ..tensors import Outgoing, prepare
from ..transports import Channel, ChannelState
from ._codec import encode
from ._deadline import effective_deadline
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
    meta,
    raise_error,
    reply_tag,
)
from ._server import DRAIN_SECONDS

if TYPE_CHECKING:
    from .._peer import Peer

__all__ = ["call", "stream"]

_ids = itertools.count(1)
_MAX_OUTSTANDING = 256  # per peer: leaves the transport's message slots room for the rest
_outstanding: weakref.WeakKeyDictionary[Peer, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _slots(peer: Peer) -> asyncio.Semaphore:
    sem = _outstanding.get(peer)
    if sem is None:
        cap = max(1, min(_MAX_OUTSTANDING, peer.node.config.limits.max_unexpected // 4))
        sem = _outstanding[peer] = asyncio.Semaphore(cap)
    return sem


class _Progress:
    __slots__ = ("args", "finished")

    def __init__(self) -> None:
        self.args = ArgsState.NONE  # how far the arguments sent after GO got
        self.finished = False  # a terminal reply arrived: the server owes us nothing more


def _request(
    call_id: int, name: str, kind: Kind, left: float | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Outgoing, Outgoing | None]:
    """The request, with the arguments inline when they are small; else the arguments apart."""
    if not isinstance(name, str):
        raise ConfigurationError(f"a method name is a string, not {type(name).__name__}")
    payload = encode((args, kwargs))  # an argument tensorwire cannot move fails here, locally
    if payload.nbytes <= INLINE_BYTES:
        return encode((meta(call_id, left, kind, -1), name, args, kwargs)), None
    return encode((meta(call_id, left, kind, payload.nbytes), name)), payload


async def _next_reply(channel: Channel, tag: int) -> tuple[Any, ...]:
    msg, _ = await channel.recv(tag, None)
    if not (isinstance(msg, tuple) and msg and isinstance(msg[0], int)):
        raise ProtocolError(f"malformed RPC reply ({type(msg).__name__})")
    return msg


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


async def _send_request(
    channel: Channel,
    call_id: int,
    request: Outgoing,
    payload: Outgoing | None,
    progress: _Progress,
    name: str,
    where: str,
) -> None:
    await channel.send(REQUEST_TAG, request)
    if payload is not None:
        msg = await _next_reply(channel, reply_tag(call_id))
        if msg[0] != Reply.GO:
            _terminal(msg, progress, name, where)
            raise ProtocolError(f"{name}: the server answered before it received the arguments")
        progress.args = ArgsState.INTERRUPTED  # until the send returns
        await channel.send(args_tag(call_id), payload)
        progress.args = ArgsState.SENT


def _abandon(peer: Peer, call_id: int, progress: _Progress) -> None:
    """Give up on a call: ask the server to cancel it and drain what it still sends."""
    if progress.finished or peer.channel.state is not ChannelState.OPEN:
        return
    progress.finished = True
    peer._spawn(_cancel_and_drain(peer.channel, call_id, progress.args))


async def _cancel_and_drain(channel: Channel, call_id: int, args: ArgsState) -> None:
    with contextlib.suppress(TensorWireError, TimeoutError):
        await channel.send(CONTROL_TAG, prepare((int(Control.CANCEL), call_id, int(args))))
        if args is ArgsState.INTERRUPTED:
            # the cut-short arguments may or may not have arrived: a tombstone tells the server
            await channel.send(args_tag(call_id), prepare(None))
        async with asyncio.timeout(DRAIN_SECONDS):
            while True:
                msg, _ = await channel.recv(reply_tag(call_id), None)
                if isinstance(msg, tuple) and msg and msg[0] in TERMINAL:
                    return


def _expired(name: str, left: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"{name}: its {left:.3g} s deadline ran out before the reply came")


async def call(
    peer: Peer, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float | None, out: Any = None
) -> Any:
    """``peer.call``: run ``name`` on the peer and return its result (landed in ``out`` if given)."""
    left = effective_deadline(deadline)
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"{name}: the deadline had passed before the call was made")
    call_id = next(_ids)
    request, payload = _request(call_id, name, Kind.UNARY, left, args, kwargs)
    channel = peer.channel
    where = peer.remote_address
    progress = _Progress()
    slots = _slots(peer)
    await slots.acquire()
    try:
        tm = asyncio.timeout(left)
        async with tm:
            await _send_request(channel, call_id, request, payload, progress, name, where)
            if out is not None:
                return await _reply_into(channel, reply_tag(call_id), out, progress, name, where)
            msg = await _next_reply(channel, reply_tag(call_id))
            return _terminal(msg, progress, name, where)
    except TimeoutError as exc:
        _abandon(peer, call_id, progress)
        if left is not None and tm.expired():
            raise _expired(name, left) from exc
        raise
    except BaseException:
        _abandon(peer, call_id, progress)
        raise
    finally:
        slots.release()


async def _reply_into(channel: Channel, tag: int, out: Any, progress: _Progress, name: str, where: str) -> Any:
    """Receive the result straight into the caller's ``out`` tensors (posted before it arrives)."""
    try:
        await channel.recv(tag, (int(Reply.RESULT), out))
    except ShapeMismatchError as exc:
        # not a result of that shape: an error (raised here), or a result that does not fit
        msg = await _next_reply(channel, tag)
        _terminal(msg, progress, name, where)
        raise ShapeMismatchError(f"{name}'s result does not fit _out= (it was dropped): {exc}") from None
    progress.finished = True
    return out


async def stream(
    peer: Peer, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float | None
) -> AsyncIterator[Any]:
    """``peer.stream``: the items a streaming method yields, as they come. Leaving the loop
    early (break, an exception, aclose) cancels the method on the server."""
    left = effective_deadline(deadline)
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"{name}: the deadline had passed before the call was made")
    call_id = next(_ids)
    request, payload = _request(call_id, name, Kind.STREAM, left, args, kwargs)
    channel = peer.channel
    where = peer.remote_address
    tag = reply_tag(call_id)
    progress = _Progress()
    deadline_at = None if left is None else asyncio.get_running_loop().time() + left
    slots = _slots(peer)
    await slots.acquire()
    try:
        tm = asyncio.timeout_at(deadline_at)
        async with tm:  # the request only: a timeout must never span a yield
            await _send_request(channel, call_id, request, payload, progress, name, where)
        taken = 0
        while True:
            tm = asyncio.timeout_at(deadline_at)
            async with tm:
                msg = await _next_reply(channel, tag)
            if msg[0] != Reply.ITEM or len(msg) != 2:
                _terminal(msg, progress, name, where)
                return
            taken += 1
            if taken == STREAM_WINDOW // 2:
                taken = 0
                await channel.send(CONTROL_TAG, prepare((int(Control.CREDIT), call_id, STREAM_WINDOW // 2)))
            yield msg[1]
    except TimeoutError as exc:
        _abandon(peer, call_id, progress)
        if left is not None and tm.expired():
            raise _expired(name, left) from exc
        raise
    except BaseException:
        _abandon(peer, call_id, progress)
        raise
    finally:
        slots.release()
