"""Calling a node's (or a pipeline's) methods from a loop that is not theirs, in tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


def on_another_loop(make: Callable[[], Awaitable[Any]], seconds: float = 10.0) -> BaseException | None:
    """Run ``make()`` on a loop of its own (call this in a worker thread: ``asyncio.to_thread``):
    what it raised, if anything. ``seconds`` only keeps a hang of broken code from hanging the test."""

    async def run() -> None:
        async with asyncio.timeout(seconds):
            await make()

    try:
        asyncio.run(run())
    except BaseException as exc:
        return exc
    return None
