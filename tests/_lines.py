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
