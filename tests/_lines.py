"""Counting the lines of tensorwire's own code that a piece of a test runs: a measure of work
that the machine's load does not change (tests assert how it grows, never a time)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import tensorwire

_PACKAGE = os.path.dirname(tensorwire.__file__) + os.sep


class Lines:
    """How many lines of the package ran inside ``counting_lines`` (``count``)."""

    count = 0


@contextlib.contextmanager
def counting_lines() -> Iterator[Lines]:
    """Count, in ``.count`` of what it yields, every line of tensorwire that runs in this thread
    while the block runs (code of other packages and of the test is not counted); the tracer
    that was set before comes back after."""
    lines = Lines()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        lines.count += event == "line"
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(_PACKAGE) else None

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        yield lines
    finally:
        sys.settrace(before)


async def lines_of_a_message(a: tensorwire.Peer, b: tensorwire.Peer, n: int, seconds: float = 30) -> int:
    """The lines of tensorwire that sending a list of ``n`` tensors from ``a`` and receiving it at
    ``b`` run (checked on arrival). 512 bytes each: past tcp's one-frame fast path and ucx's
    inline bytes, so that only the number of tensors changes the work."""
    import asyncio

    import numpy as np

    msg = [np.full(128, i, np.int32) for i in range(n)]
    recv = asyncio.ensure_future(b.recv(tag="many"))
    await asyncio.sleep(0.01)
    with counting_lines() as ran:
        await asyncio.wait_for(a.send(msg, tag="many"), seconds)
        got = await asyncio.wait_for(recv, seconds)
    assert all(np.array_equal(x, y) for x, y in zip(got, msg, strict=True)), "the tensors arrived wrong"
    return ran.count
