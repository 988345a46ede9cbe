"""Ending the child processes of multi-process tests, whatever state a test left them in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


async def end_child(child: asyncio.subprocess.Process) -> None:
    """Kill ``child`` (continued first, should a test have stopped it) and reap it, within 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
    async with asyncio.timeout(10):
        await child.wait()
