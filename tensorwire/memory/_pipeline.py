"""Staging pipelines: device memory out through host chunks, and host chunks into device memory.

Out (``stage_out``): the copy of chunk k+1 from the device runs while chunk k is being sent.
Up to the pool's depth of chunk copies are queued on one lane ahead of the consumer; each chunk
is handed over once its copy's event completes and comes back to the pool once sent.

In (:class:`StageIn`): a chunk is filled (from a socket, or from host memory), its copy to the
device is queued, and the chunk goes back to the pool with that copy's event, so the next
chunk is filled while the copy runs. The message's last event is what the consumer's stream
waits for: the host never waits for the device on the receive path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable

from ._engine import CopyEngine, DeviceBuffer, Event, HostChunk, Lane, wait_event

__all__ = ["StageIn", "download", "stage_out"]

Fill = Callable[[memoryview, int], Awaitable[None] | None]


async def stage_out(
    src: DeviceBuffer, start: int, end: int, after: Event | None = None
) -> AsyncGenerator[tuple[int, memoryview], None]:
    """Yield ``(offset, bytes)`` host chunks of ``src[start:end]`` in order.

    ``after`` (the producer's event) is waited for on the copy lane, not on the host. A chunk
    yielded is valid until the next one is asked for. Close the generator (``aclosing``) when
    leaving early: chunks whose copies are still queued go back to the pool with their events.
    """
    engine = src.engine
    pool = engine.pool("out")
    lane = engine.lane()
    if after is not None:
        lane.wait(after)
    pending: deque[tuple[HostChunk, int, int, Event]] = deque()
    pos = start
    try:
        while pos < end or pending:
            while pos < end and len(pending) < pool.depth:
                chunk = await (pool.try_acquire() if pending else pool.acquire())
                if chunk is None:
                    break
                n = min(chunk.size, end - pos)
                lane.to_host(chunk, 0, src, pos, n)
                pending.append((chunk, pos, n, lane.record()))
                pos += n
            chunk, off, n, event = pending[0]
            await wait_event(engine, event)
            pending.popleft()
            try:
                yield off, chunk.view[:n]
            finally:
                pool.release(chunk)
    finally:
        for chunk, _, _, event in pending:
            pool.release(chunk, after=event)
        engine.give_back(lane)


async def download(src: DeviceBuffer, dst: memoryview, after: Event | None = None) -> None:
    """Copy all of ``src`` into host memory ``dst`` (pageable is fine) through staging chunks."""
    gen = stage_out(src, 0, src.nbytes, after)
    try:
        async for off, view in gen:
            dst[off : off + len(view)] = view
    finally:
        await gen.aclose()


class StageIn:
    """Host chunks into device memory for one message, on one lane; ``finish`` for the last event.

    ``consumer`` is an event the lane waits for before its first write (the receiving stream's
    work on the destination so far).
    """

    __slots__ = ("_consumer", "_lane", "_last", "engine", "pool")

    def __init__(self, engine: CopyEngine, consumer: Event | None = None) -> None:
        self.engine = engine
        self.pool = engine.pool("in")
        self._consumer = consumer
        self._lane: Lane | None = None
        self._last: Event | None = None

    @property
    def lane(self) -> Lane:
        if self._lane is None:
            self._lane = self.engine.lane()
            if self._consumer is not None:
                self._lane.wait(self._consumer)
            if self._last is not None:  # after finish(): stay ordered after what came before
                self._lane.wait(self._last)
        return self._lane

    def mark(self) -> Event | None:
        """An event after everything queued so far (None if nothing was)."""
        if self._lane is not None:
            self._last = self._lane.record()
        return self._last

    async def write(self, dst: Callable[[], DeviceBuffer], dst_off: int, n: int, fill: Fill) -> None:
        """Fill chunks with ``fill(view, offset)`` (offset from ``dst_off``) and queue each chunk's
        copy to ``dst()``, asked anew for every chunk (a cancelled recv swaps its destination);
        a chunk is reused only after its copy has finished."""
        pos = 0
        while pos < n:
            chunk = await self.pool.acquire()
            k = min(chunk.size, n - pos)
            try:
                done = fill(chunk.view[:k], pos)
                if done is not None:
                    await done
            except BaseException:
                self.pool.release(chunk)
                raise
            lane = self.lane
            lane.to_device(dst(), dst_off + pos, chunk, 0, k)
            self._last = lane.record()
            self.pool.release(chunk, after=self._last)
            pos += k

    def device_copy(self, dst: DeviceBuffer, dst_off: int, src: DeviceBuffer, src_off: int, n: int) -> None:
        """Queue a device-to-device copy after everything written so far."""
        lane = self.lane
        lane.device_copy(dst, dst_off, src, src_off, n)
        self._last = lane.record()

    def launch(self, fn: Callable[[Lane], None]) -> None:
        """Run ``fn(lane)`` to enqueue work of its own (a kernel) after everything written so far."""
        lane = self.lane
        fn(lane)
        self._last = lane.record()

    def finish(self) -> Event | None:
        """The event after which every queued copy has landed (None if nothing was queued)."""
        if self._lane is not None:
            self._last = self._lane.record()
            self.engine.give_back(self._lane)
            self._lane = None
        return self._last
