"""What the two soaks (soak.py, soak_ops.py) share: random payload sizes, and SIGKILLing a
worker process while telling whether it had already exited on its own."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal


def random_size(rng: random.Random, most: int) -> int:
    """0 B one time in twenty, else log-uniform in 1 B..``most``."""
    if rng.random() < 0.05:
        return 0
    return int(math.exp(rng.uniform(0, math.log(max(most, 2)))))


async def kill_and_reap(proc: asyncio.subprocess.Process) -> bool:
    """SIGKILL the worker (if it still runs) and reap it. False if it had exited on its own (an
    error reached it: its traceback is on stderr), which fails a soak."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it may exit just now
            proc.kill()
    return await proc.wait() == -signal.SIGKILL
