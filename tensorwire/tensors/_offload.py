"""Large host copies off the event loop.

Packing a strided tensor into C order, or copying a received message into a caller's ``out=``,
moves every byte through the CPU: a 256 MiB transposed float64 array takes about a second. On
the event loop that second stalls every other channel, renewal and call of the process, so
copies of ``OFF_LOOP_BYTES`` or more run in a worker thread (numpy lets go of the GIL while it
copies) and the loop goes on. Smaller ones stay on the loop, where they cost less than the hop.

A copy handed to a thread is always waited for, even when the waiting task is cancelled: once
the awaiting call returns or raises, no thread reads or writes the caller's tensors any more.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .._loops import wait_out

__all__ = ["OFF_LOOP_BYTES", "copy_host", "copy_host_soon", "off_loop", "packs_in_a_thread", "worth_a_thread"]

OFF_LOOP_BYTES = 1 << 20  # a host copy this large or larger runs in a worker thread
_WORKERS = 4  # copies are bound by memory bandwidth: a few threads use it all

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's copy threads, made on first use (and made afresh in a forked child, where
    the parent's threads do not exist)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="tensorwire-copy")
            _pool_pid = os.getpid()
        return _pool


async def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a copy thread and return what it returns (or raise what it raises).

    A cancellation of the caller waits for ``fn`` to end before it propagates, so ``fn`` never
    runs on past the call that asked for it."""
    fut = _in_a_thread(fn)
    await wait_out(fut)
    return fut.result()


def _in_a_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Start ``fn`` in a copy thread; its outcome as a future of this loop (never waited here)."""
    return asyncio.wrap_future(_executor().submit(fn))


def worth_a_thread(nbytes: int) -> bool:
    """Whether a host copy of ``nbytes`` goes to a copy thread (read at each call, so a benchmark
    can set ``OFF_LOOP_BYTES`` to compare with copies on the loop)."""
    return nbytes >= OFF_LOOP_BYTES


def packs_in_a_thread(arr: np.ndarray) -> bool:
    """Whether packing the host array ``arr`` into C order is a copy for a copy thread."""
    return not arr.flags.c_contiguous and worth_a_thread(arr.nbytes)


def _copies(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def copy_host_soon(pairs: list[tuple[np.ndarray, np.ndarray]]) -> asyncio.Future[None] | None:
    """Start ``copy_host``'s copies without waiting for them: the small ones here, now, and the
    large ones together in a copy thread, whose future this returns (None if there were none).
    The caller owns that wait: whoever lent the arrays waits it out (``wait_out``) before it
    returns, and nothing reads the destinations before it ends."""
    big = [(d, s) for d, s in pairs if worth_a_thread(d.nbytes)]
    for dst, src in pairs:
        if not worth_a_thread(dst.nbytes):
            np.copyto(dst, src)
    if not big:
        return None
    return _in_a_thread(lambda: _copies(big))


async def copy_host(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` for each pair: small ones here, and the large ones together in a
    copy thread. Returns or raises only once every copy has ended."""
    fut = copy_host_soon(pairs)
    if fut is not None:
        await wait_out(fut)
        fut.result()
