"""A bounded pool of host staging chunks (page-locked on a GPU), shared by a process.

Each engine has two pools, one for each direction, so that a large send never starves a
receive of chunks. A pool hands out at most ``depth`` chunks of ``chunk_bytes`` each,
allocating them the first time they are needed and keeping them for the life of the process
(page-locking memory costs milliseconds; reusing it costs nothing).

A chunk goes back with the event of the last copy that uses it; the next taker waits for that
event before writing into it, so a chunk is never overwritten while a copy still reads it.

Deadlock rule: a pipeline only blocks for a chunk while it holds none (``acquire``); while it
holds some it only takes what is free at once (``try_acquire``). So every pipeline that waits
holds nothing, and every chunk in use belongs to a pipeline that can make progress. A chunk
given back with a copy that waits for a stream that may stay busy for long (a producer's, whose
send ended first; a consumer's, still busy when a recv's copy up was queued) is ``park``-ed out
of the depth until that copy has run: given back as any other, it held every transfer of the
process that needed a chunk for as long as that stream was busy (once a closed channel's send
left them all so, every device send on every channel; a recv on a busy stream, every device
recv). A pipeline that parks bounds itself (``StageIn``: its own depth's worth at most).

A pool is the process's (an engine's: ``CudaEngine.get`` hands every thread the same), so nodes
on event loops of their own, in threads of their own, share it: its state is kept under a lock,
and a chunk given back on one loop wakes a waiter of another loop's in that loop
(``call_soon_threadsafe``), as the engine's poller completes each wait in its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import TensorWireError
from ._engine import Event, HostChunk, _cut_short, wait_event

if TYPE_CHECKING:
    from ._engine import CopyEngine

__all__ = ["CHUNK_BYTES", "DEPTH", "PinnedPool"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
DEPTH = 8


class PinnedPool:
    """At most ``depth`` host chunks of ``chunk_bytes`` for ``engine``'s staging copies (more once
    some were ``park``-ed)."""

    def __init__(self, engine: CopyEngine, chunk_bytes: int = CHUNK_BYTES, depth: int = DEPTH) -> None:
        self.engine = engine
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self._free: deque[tuple[HostChunk, Event | None]] = deque()
        self._allocated = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._parked: list[tuple[HostChunk, Event]] = []  # out of the depth until their copies ran (``park``)
        self.retired = 0  # chunks given up on (``retire``)
        # every loop's (thread's) use of the state above: the pool is the process's
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<PinnedPool {self.engine.name} {self.depth}x{self.chunk_bytes} free={self.free}>"

    @property
    def free(self) -> int:
        return len(self._free) + self.depth - self._allocated

    def configure(self, chunk_bytes: int, depth: int) -> None:
        """Change the chunk size and depth (frees every idle chunk; for benchmarks and tests)."""
        if chunk_bytes <= 0 or depth <= 0:
            raise ValueError("chunk_bytes and depth must be positive")
        with self._lock:
            while self._free:
                chunk, _ = self._free.popleft()
                self._allocated -= 1
                self.engine.free_chunk(chunk)
            self.chunk_bytes, self.depth = chunk_bytes, depth

    def _take(self) -> tuple[HostChunk, Event | None] | None:
        """A chunk whose last copy has finished if there is one, else a new one while under the
        depth, else the one given back first (its copy finishes soonest). Called holding the lock."""
        if self._parked:
            self._unpark()
        for i, (chunk, event) in enumerate(self._free):
            if event is None or event.query():
                del self._free[i]
                return chunk, None
        if self._free and self._allocated >= self.depth:
            return self._free.popleft()
        if self._allocated < self.depth:
            try:
                chunk = self.engine.host_chunk(self.chunk_bytes)
            except (TensorWireError, MemoryError):
                if not self._allocated:
                    raise
                # no memory to grow: make do with the chunks there are (they come back)
                return self._free.popleft() if self._free else None
            self._allocated += 1
            return chunk, None
        return None

    async def _ready(self, entry: tuple[HostChunk, Event | None], until: asyncio.Future[Any] | None) -> HostChunk:
        chunk, event = entry
        if event is not None:
            try:
                await wait_event(self.engine, event, until)
            except BaseException:
                with self._lock:
                    self._free.appendleft(entry)  # still owned by its copy; the next taker waits
                    self._wake()
                raise
        scrub = getattr(self.engine, "scrub", None)
        if scrub is not None:
            scrub(chunk)
        return chunk

    async def acquire(self, until: asyncio.Future[Any] | None = None) -> HostChunk:
        """A chunk, waiting for one to come back if all are in use. Call only holding none.
        ``until`` cuts short the wait for a chunk's last copy (``wait_event``): one queued after
        a stream that may stay busy; and the wait for a chunk to come back, which may be held
        by a transfer (of any channel) waiting for such a stream."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:  # (taking and queueing at once: a chunk given back meanwhile wakes us)
                entry = self._take()
                if entry is None:
                    fut = loop.create_future()
                    self._waiters.append(fut)
            if entry is not None:
                return await self._ready(entry, until)
            try:
                if until is None:
                    await fut
                else:
                    await asyncio.wait((fut, until), return_when=asyncio.FIRST_COMPLETED)
                    if not fut.done():
                        _cut_short(until)
            except BaseException:
                with self._lock:
                    if fut in self._waiters:
                        self._waiters.remove(fut)
                    elif not fut.done():  # a wake on its way from another loop: ``_woken`` passes it on
                        fut.cancel()
                    elif not fut.cancelled():
                        self._wake()  # woken for a chunk, then cancelled before taking it: pass it on
                raise

    async def try_acquire(self, until: asyncio.Future[Any] | None = None) -> HostChunk | None:
        """A chunk if one is free now (its last copy perhaps still to finish), else None
        (``until``: as for ``acquire``)."""
        with self._lock:
            entry = self._take()
        if entry is None:
            return None
        return await self._ready(entry, until)

    def release(self, chunk: HostChunk, after: Event | None = None) -> None:
        """Give ``chunk`` back; it is reused once ``after`` (its last copy) has completed."""
        with self._lock:
            self._free.append((chunk, after))
            self._wake()

    def park(self, chunk: HostChunk, after: Event) -> None:
        """Give ``chunk`` back, its last copy (``after``) queued behind a stream that may stay
        busy for long: it no longer counts against the depth, so that other transfers get
        chunks meanwhile, and it is kept (never freed while that copy may write it) until the
        copy has run. Then it comes back to the pool, even past the depth (until ``configure``):
        freeing page-locked memory may wait for the whole device, and the loop must not."""
        with self._lock:
            self._allocated -= 1
            self._parked.append((chunk, after))
            self._wake()

    def _unpark(self) -> None:
        parked, self._parked = self._parked, []
        for chunk, event in parked:
            if not event.query():
                self._parked.append((chunk, event))
            elif chunk.size == self.chunk_bytes:
                self._allocated += 1
                self._free.append((chunk, None))
            else:  # (a chunk of the size before ``configure``, which frees idle chunks too)
                self.engine.free_chunk(chunk)

    def retire(self, chunk: HostChunk) -> None:
        """Never hand ``chunk`` out again: a transport may still write into it or read from it
        (a one-sided operation a closing channel gave up waiting for). Its memory is freed once
        nothing holds its ``array`` any more (the transport keeps it while its operation may
        run); the pool may allocate a new chunk in its place."""
        with self._lock:
            self._allocated -= 1
            self.retired += 1
            self._wake()
        fin = weakref.finalize(chunk.array, _free, self.engine, chunk.ptr)
        fin.atexit = False  # at exit the process's memory goes anyway (and CUDA may be gone)

    def _wake(self) -> None:
        """Wake the first waiter (called holding the lock). One of another loop's is woken in
        its loop: a future's result set from here would not wake that loop, which slept on
        until something else did (for good, were nothing to)."""
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        while self._waiters:
            fut = self._waiters.popleft()
            if fut.done():
                continue
            loop = fut.get_loop()
            if loop is here:
                fut.set_result(None)
                return
            try:
                loop.call_soon_threadsafe(self._woken, fut)
            except RuntimeError:  # its loop is closed: nobody waits there any more
                continue
            return

    def _woken(self, fut: asyncio.Future[None]) -> None:
        """``_wake`` from another loop, in ``fut``'s: a waiter cancelled meanwhile passes it on."""
        with self._lock:
            if not fut.done():
                fut.set_result(None)
            else:
                self._wake()


def _free(engine: CopyEngine, ptr: int) -> None:
    """Free a retired chunk's memory (from a finalizer: nothing may be raised)."""
    try:
        engine.free_chunk(HostChunk(memoryview(b""), ptr, 0))
    except Exception as exc:
        log.warning("freeing a retired staging chunk at %#x failed: %s", ptr, exc)
