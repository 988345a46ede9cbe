"""Forceful ``abort()`` from any thread: what an object's own event loop must do, it does there;
and waiting out work that must end before its caller may return."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


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


async def wait_out(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, whatever cancellations of the caller come meanwhile (``fut``
    itself is never cancelled by this), then raise the first of them, with its message; else
    return, leaving ``fut``'s outcome to the caller. For work that may still write into the
    caller's buffers (a copy thread, a receive under way): it must end before the caller goes."""
    interrupted: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
