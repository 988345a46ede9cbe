"""Waiting in tests for a state that has no event of its own, and looking for what is left."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import types
from collections.abc import Callable


async def eventually(pred: Callable[[], bool], seconds: float = 5.0, pause: float = 0.01) -> None:
    """Let the loop run until ``pred()`` holds; AssertionError after ``seconds``. ``pause=0``
    polls every loop turn (a transport's progress running on the loop)."""
    give_up = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < give_up, f"not true after {seconds} s: {pred}"
        await asyncio.sleep(pause)


async def awhile(pred: Callable[[], bool], seconds: float = 5.0, pause: float = 0.01) -> None:
    """Let the loop run until ``pred()`` holds or ``seconds`` pass, without failing: the caller
    then asserts, with a message that says what was left."""
    with contextlib.suppress(AssertionError):
        await eventually(pred, seconds, pause)


async def collected(*refs: Callable[[], object], seconds: float = 5.0) -> None:
    """Until the objects of the weak references ``refs`` are gone (the garbage collected at each
    look): what a test of a leak waits for once the code under test should have let go."""

    def gone() -> bool:
        gc.collect()
        return all(ref() is None for ref in refs)

    await eventually(gone, seconds)


def live_frames(*names: str) -> list[types.FrameType]:
    """The frames alive now (the garbage collected first) of tensorwire's functions named
    ``names``: a call that ended keeps its frame, with its locals, while a traceback holds it."""
    gc.collect()
    # (type(o), not isinstance: isinstance asks an object's __class__, which some modules' objects
    # answer with a warning, e.g. torch.distributed's deprecated reduce_op once torch is imported)
    return [
        o
        for o in gc.get_objects()
        if type(o) is types.FrameType and o.f_code.co_name in names and "tensorwire" in o.f_code.co_filename
    ]
