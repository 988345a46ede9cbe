"""Waiting in tests for a state that has no event of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(pred: Callable[[], bool], seconds: float = 5.0, pause: float = 0.01) -> None:
    """Let the loop run until ``pred()`` holds; AssertionError after ``seconds``. ``pause=0``
    polls every loop turn (a transport's progress running on the loop)."""
    give_up = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < give_up, f"not true after {seconds} s: {pred}"
        await asyncio.sleep(pause)


async def collected(*refs: Callable[[], object], seconds: float = 5.0) -> None:
    """Until the objects of the weak references ``refs`` are gone (the garbage collected at each
    look): what a test of a leak waits for once the code under test should have let go."""
    import gc

    def gone() -> bool:
        gc.collect()
        return all(ref() is None for ref in refs)

    await eventually(gone, seconds)
