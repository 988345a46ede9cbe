"""Forceful ``abort()`` from any thread: what an object's own event loop must do, it does there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


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
