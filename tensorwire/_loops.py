"""Forceful ``abort()`` from any thread: what an object's own event loop must do, it does there;
every other call refused off that loop; and waiting out work that must end before its caller
may return."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from .errors import ClosedResourceError, ConfigurationError


def elsewhere(home: asyncio.AbstractEventLoop | None, again: Callable[[], None]) -> bool:
    """Called outside ``home`` (the loop an object lives on: another thread, or none running):
    hand ``again`` to ``home`` to run on its next turn, and say True; the caller then only marks
    itself closed. False where the call already runs on ``home`` (or no home is known), and the
    caller goes on. A closed ``home`` takes nothing: nothing runs there any more."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if home is None or running is home:
        return False
    if not home.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            home.call_soon_threadsafe(again)
    return True


class Pledge(asyncio.Future[Any]):
    """A future for work that cannot be called off once begun (a UCX send, get or put): its
    ``cancel()`` is refused, so a task may await it directly, and a cancellation of that task
    takes effect once the pledge is done (asyncio delivers it then). Awaited directly, it wakes
    its task in the loop turn after it is settled; a ``shield`` or ``asyncio.wait`` around a
    plain future wakes it a turn later (the future's callbacks run in one turn, and what they
    wake in the next), which cost 10-20 us a message over shared memory. Nothing else differs:
    a result, or a failure (``set_exception``), ends it."""

    def cancel(self, msg: Any = None) -> bool:
        return False


async def wait_out(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, whatever cancellations of the caller come meanwhile (``fut``
    itself is never cancelled by this), then raise the first of them, with its message; else
    return, leaving ``fut``'s outcome to the caller. For work that may still write into the
    caller's buffers (a copy thread, a receive under way): it must end before the caller goes.
    A ``Pledge`` is awaited directly (a loop turn sooner)."""
    interrupted: asyncio.CancelledError | None = None
    pledge = isinstance(fut, Pledge)
    while not fut.done():
        try:
            if pledge:
                with contextlib.suppress(Exception):  # (its outcome is the caller's)
                    await fut
            else:
                await asyncio.wait((fut,))
        except asyncio.CancelledError as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


async def call_off(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended (it may write into the caller's buffers until
    then), a cancellation of ours meanwhile raised once it has (``wait_out``); its outcome is
    dropped."""
    task.cancel()
    try:
        await wait_out(task)
    finally:
        if not task.cancelled():
            task.exception()


# (C; None where no loop runs) hot paths test ``running_loop() is not home`` inline, before they
# call check_home: a call of a Python function would double the cost of the comparison
running_loop = asyncio._get_running_loop


def check_home(
    home: asyncio.AbstractEventLoop | None, what: str, *, closing: bool = False, done: str = "called"
) -> None:
    """Refuse a call made outside ``home``, the loop a node and its peers were started on: their
    futures, sockets and callbacks belong to that loop, and a call from another thread's loop
    races them unseen (one peer used from two loops hung one loop's recvs for 40 s, then broke
    the channel; a lone call "worked" by luck). ``abort()`` is the one method made for any thread (``elsewhere``).
    Once ``home`` has closed nothing can run there: the object is refused as closed, but an
    ``aclose()`` (``closing``) goes on, to find what the loop's end left of the closing. ``done``
    says what was done with ``what``: a method is called, a setting set."""
    running = running_loop()
    if running is home or home is None:
        return
    if home.is_closed():
        if closing:
            return
        raise ClosedResourceError(f"{what}: the event loop this node was started on has closed, and with it the node")
    where = "on an event loop that is not the node's" if running is not None else "where no event loop runs"
    raise ConfigurationError(
        f"{what} was {done} {where}: a node and its peers belong to the event loop the node was started "
        "on. Call it there; from another thread, hand the coroutine to that loop with "
        "asyncio.run_coroutine_threadsafe(coro, node_loop) (abort() alone may be called from any thread)"
    )


def closed_by_hand(home: asyncio.AbstractEventLoop | None, closing: asyncio.Future[None] | None) -> bool:
    """Whether a node's (or a peer's) loop ``home`` has closed before its ``closing`` ran to its
    end there: a loop closed by hand, without ``shutdown_asyncgens`` (README, Lifecycle). Its
    objects (tasks, gRPC's server, sockets' callbacks) belong to that loop, so nothing of the
    closing can run any more, on it or on another: the node went with its loop, and holds its
    ports until the process exits. An ``aclose()`` then returns, as for a node closed already
    (it raised asyncio's RuntimeError('Event loop is closed') at every call)."""
    return home is not None and home.is_closed() and (closing is None or not closing.done())
