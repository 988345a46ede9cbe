"""Staging pipelines: device memory out through host chunks, and host chunks into device memory.

Out (``stage_out``): the copy of chunk k+1 from the device runs while chunk k is being sent.
Up to the pool's depth of chunk copies are queued on one lane ahead of the consumer; each chunk
is handed over once its copy's event completes and comes back to the pool once sent.

In (:class:`StageIn`): a chunk is filled (from a socket, or from host memory), its copy to the
device is queued, and the chunk goes back to the pool with that copy's event, so the next
chunk is filled while the copy runs. The message's last event is what the consumer's stream
waits for: the host never waits for the device on the receive path. The copies wait for the
consumer's stream first: while it is busy, a chunk goes back parked (``PinnedPool.park``), and
a message waits for its own oldest parked chunk rather than take more than the pool's depth.

Pieces (``StageIn.gather`` and ``scatter``): for one-sided operations through host memory, a
batch's tensors are laid end to end across chunks (small ones share a chunk, large ones span
several), and each chunk's pieces are moved by the caller (a batch of RDMA gets into the chunk,
or puts out of it) while the next chunks are being moved or copied: up to the pool's depth of
chunks in flight. The transport reads and writes the chunk itself, no copy in between.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._engine import CopyEngine, DeviceBuffer, Event, HostChunk, Lane, wait_event

if TYPE_CHECKING:
    from ._pinned import PinnedPool

__all__ = ["Move", "Piece", "StageIn", "download", "hand_back", "scatter", "stage_out"]

Fill = Callable[[memoryview, int], Awaitable[None] | None]
# (tensor index, byte offset in the tensor, byte offset in the chunk, length)
Piece = tuple[int, int, int, int]
# moves a chunk's pieces (a batch of gets into it, or puts from it); returns once done
Move = Callable[[HostChunk, list[Piece]], Awaitable[None]]


def _pieces(todo: deque[tuple[int, int, int]], size: int) -> list[Piece]:
    """Take the next ``size`` bytes of ``todo`` ((index, offset, end) runs) as one chunk's pieces."""
    pieces: list[Piece] = []
    used = 0
    while todo and used < size:
        i, pos, end = todo.popleft()
        k = min(end - pos, size - used)
        pieces.append((i, pos, used, k))
        used += k
        if pos + k < end:
            todo.appendleft((i, pos + k, end))
    return pieces


async def _alone(
    pool: PinnedPool, chunk: HostChunk, event: Event | None, move: Awaitable[None], spoiled: Callable[[], bool]
) -> None:
    """A move awaited here (the only one under way: no task, no hop through the loop); failed or
    cancelled, its chunk goes back to the pool or is retired, as ``_settle`` decides."""
    try:
        await move
    except BaseException:
        hand_back(pool, chunk, event, touched=spoiled())
        raise


def hand_back(pool: PinnedPool, chunk: HostChunk, event: Event | None, *, touched: bool) -> None:
    """A chunk whose move ended: back to the pool after ``event``, or retired where the move
    may still touch it (``touched``: it failed or was stopped, and its channel is closing)."""
    if touched:
        pool.retire(chunk)
    else:
        pool.release(chunk, after=event)


# a chunk being moved: its pieces, the event of the copies it waits for first, the move
_Flight = tuple[HostChunk, list[Piece], Event | None, "asyncio.Future[None]"]


async def _settle(pool: PinnedPool, inflight: deque[_Flight], spoiled: Callable[[], bool]) -> None:
    """Leaving early: stop the moves still going and wait for them (each waits for what its
    transport posted), then give their chunks back, or retire those a move may still touch: it
    failed or was stopped and ``spoiled()`` says its transport no longer waits for what it
    posted. A second cancellation while waiting is raised once all are settled."""
    for *_, task in inflight:
        task.cancel()
    cancelled = False
    pending = {task for *_, task in inflight}
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    doubt = spoiled()
    for chunk, _, event, task in inflight:
        clean = not task.cancelled() and task.exception() is None  # also marks it retrieved
        hand_back(pool, chunk, event, touched=doubt and not clean)
    inflight.clear()
    if cancelled:
        raise asyncio.CancelledError


async def stage_out(
    src: DeviceBuffer,
    start: int,
    end: int,
    after: Event | None = None,
    until: asyncio.Future[Any] | None = None,
) -> AsyncGenerator[tuple[int, memoryview], None]:
    """Yield ``(offset, bytes)`` host chunks of ``src[start:end]`` in order.

    ``after`` (the producer's event) is waited for on the copy lane, not on the host. A chunk
    yielded is valid until the next one is asked for. Close the generator (``aclosing``) when
    leaving early: chunks whose copies are still queued go back to the pool with their events.
    ``until`` cuts short the waits for those copies, which wait for ``after`` (``wait_event``),
    and for chunks, which other transfers' copies may hold as long (``PinnedPool.acquire``).
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
                chunk = await (pool.try_acquire(until) if pending else pool.acquire(until))
                if chunk is None:
                    break
                n = min(chunk.size, end - pos)
                queued = False
                try:
                    lane.to_host(chunk, 0, src, pos, n)
                    queued = True
                    event = lane.record()
                except BaseException:
                    hand_back(pool, chunk, None, touched=queued)  # a queued copy may still write it
                    raise
                pending.append((chunk, pos, n, event))
                pos += n
            chunk, off, n, event = pending[0]
            await wait_event(engine, event, until)
            pending.popleft()
            try:
                yield off, chunk.view[:n]
            finally:
                pool.release(chunk)
    finally:
        # left early: copies still queued wait for ``after`` if it has not completed (a wait
        # that ``until`` cut short, or a send cancelled), for as long as the producer's stream
        # is busy, and their chunks with them (``PinnedPool.park``)
        stuck = bool(pending) and after is not None and not after.query()
        for chunk, _, _, event in pending:
            if stuck:
                pool.park(chunk, event)
            else:
                pool.release(chunk, after=event)
        engine.give_back(lane)


async def download(
    src: DeviceBuffer, dst: memoryview, after: Event | None = None, until: asyncio.Future[Any] | None = None
) -> None:
    """Copy all of ``src`` into host memory ``dst`` (pageable is fine) through staging chunks
    (``until``: as for ``stage_out``)."""
    gen = stage_out(src, 0, src.nbytes, after, until)
    try:
        async for off, view in gen:
            dst[off : off + len(view)] = view
    finally:
        await gen.aclose()


async def _window(
    pool: PinnedPool,
    bufs: Sequence[DeviceBuffer],
    start: Callable[[HostChunk, list[Piece]], tuple[Event | None, Awaitable[None]]],
    done: Callable[[HostChunk, list[Piece]], None],
    spoiled: Callable[[], bool],
    take: Callable[[bool], Awaitable[HostChunk | None]],
) -> None:
    """``bufs`` laid end to end across chunks of ``pool``, up to its depth of them being moved at
    once: ``take(now)`` gets a chunk (``now``: only one free at once, else None, as
    ``PinnedPool.try_acquire``), ``start(chunk, pieces)`` begins a chunk's move (the event of
    copies the chunk must outlive, and the move; should it fail, it gives the chunk back itself,
    or retires it if it queued a copy touching it), ``done(chunk, pieces)`` takes each chunk
    back in order once moved. The one chunk left when nothing else is under way is moved in
    place (no task, no hop through the loop: a small tensor's whole move). Leaving early:
    ``_settle``."""
    todo = deque((i, 0, b.nbytes) for i, b in enumerate(bufs) if b.nbytes)
    inflight: deque[_Flight] = deque()
    try:
        while todo or inflight:
            while todo and len(inflight) < pool.depth:
                chunk = await take(bool(inflight))
                if chunk is None:
                    break
                pieces = _pieces(todo, chunk.size)
                event, move = start(chunk, pieces)  # (raising, it has handed the chunk back)
                if not todo and not inflight:
                    await _alone(pool, chunk, event, move, spoiled)
                    _done(pool, done, chunk, pieces)
                    break
                inflight.append((chunk, pieces, event, asyncio.ensure_future(move)))
            if not inflight:
                continue
            chunk, pieces, _, task = inflight[0]
            await asyncio.shield(task)
            inflight.popleft()
            _done(pool, done, chunk, pieces)
    finally:
        if inflight:
            await _settle(pool, inflight, spoiled)


def _done(
    pool: PinnedPool, done: Callable[[HostChunk, list[Piece]], None], chunk: HostChunk, pieces: list[Piece]
) -> None:
    """``done(chunk, pieces)``; should it fail (a copy that could not be queued), the chunk is
    retired: some of its copies may have been queued, and may still read it."""
    try:
        done(chunk, pieces)
    except BaseException:
        pool.retire(chunk)
        raise


def _taker(pool: PinnedPool) -> Callable[[bool], Awaitable[HostChunk | None]]:
    """``_window``'s ``take`` for chunks of ``pool`` as it has them."""

    async def take(now: bool) -> HostChunk | None:
        return await (pool.try_acquire() if now else pool.acquire())

    return take


async def scatter(
    srcs: Sequence[DeviceBuffer], push: Move, *, after: Sequence[Event] = (), spoiled: Callable[[], bool]
) -> None:
    """Move all of ``srcs`` (one engine's device memory) out through host chunks: each chunk's
    pieces are copied down on one lane that first waits for ``after`` (the producers' events),
    and ``push(chunk, pieces)`` moves them on once their copies are done; up to the pool's depth
    of chunks are being copied or pushed at once. Returns once every push has. Failed or
    cancelled, as :meth:`StageIn.gather`."""
    if not any(b.nbytes for b in srcs):
        return
    engine = srcs[0].engine
    pool = engine.pool("out")
    lane = engine.lane()
    for event in after:
        lane.wait(event)

    def start(chunk: HostChunk, pieces: list[Piece]) -> tuple[Event | None, Awaitable[None]]:
        queued = False
        try:
            for i, pos, off, k in pieces:
                lane.to_host(chunk, off, srcs[i], pos, k)
                queued = True
            event = lane.record()
        except BaseException:
            hand_back(pool, chunk, None, touched=queued)  # a queued copy may still write it
            raise
        return event, copied_then(event, chunk, pieces)

    async def copied_then(event: Event, chunk: HostChunk, pieces: list[Piece]) -> None:
        await wait_event(engine, event)
        await push(chunk, pieces)

    try:
        # pushed: nothing reads the chunk any more
        await _window(pool, srcs, start, lambda chunk, _: pool.release(chunk), spoiled, _taker(pool))
    finally:
        engine.give_back(lane)


class StageIn:
    """Host chunks into device memory for one message, on one lane; ``finish`` for the last event.

    ``consumer`` is an event the lane waits for before its first write (the receiving stream's
    work on the destination so far).

    The pool is the process's: a chunk whose copies up wait for a consumer's stream that is
    still busy goes back parked, out of the pool's depth (``_give_back``). Given back as any
    other, every transfer of the process that took it next waited for that stream, for as long
    as its work ran (a recv on another channel, too, and after this message's channel closed).
    The message itself waits for its own oldest parked chunk once it has parked the depth's
    worth (``_acquire``), so that a busy stream costs at most that much more memory.
    """

    __slots__ = ("_behind", "_consumer", "_lane", "_last", "engine", "pool")

    def __init__(self, engine: CopyEngine, consumer: Event | None = None) -> None:
        self.engine = engine
        self.pool: PinnedPool = engine.pool("in")
        self._consumer = consumer
        self._lane: Lane | None = None
        self._last: Event | None = None
        self._behind: deque[Event] = deque()  # the last copy of each chunk parked, oldest first

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
            chunk = await self._acquire()
            assert chunk is not None  # (only ``now`` gets none)
            k = min(chunk.size, n - pos)
            try:
                done = fill(chunk.view[:k], pos)
                if done is not None:
                    await done
            except BaseException:
                self.pool.release(chunk)
                raise
            queued = False
            try:
                lane = self.lane
                lane.to_device(dst(), dst_off + pos, chunk, 0, k)
                queued = True
                self._last = lane.record()
            except BaseException:
                hand_back(self.pool, chunk, None, touched=queued)  # a queued copy may still read it
                raise
            self._give_back(chunk, self._last)
            pos += k

    async def _acquire(self, until: asyncio.Future[Any] | None = None, now: bool = False) -> HostChunk | None:
        """A chunk of the pool (``now``: only one free at once, else None, as
        ``PinnedPool.try_acquire``; ``until``: as for ``PinnedPool.acquire``). While the depth's
        worth of this message's chunks are parked, the oldest's copy is waited for first (a wait
        for the consumer's stream, which ``until`` cuts short too); the pool hands it out again."""
        behind = self._behind
        while True:
            while behind and behind[0].query():  # (one lane's events, completing in order)
                behind.popleft()
            if len(behind) < self.pool.depth:
                return await (self.pool.try_acquire(until) if now else self.pool.acquire(until))
            if now:
                return None
            await wait_event(self.engine, behind[0], until)

    def behind_consumer(self) -> bool:
        """Whether the copies queued on the lane still wait for a consumer's stream
        (``Lane.waits``), which may stay busy for long: a chunk given back after them now is
        parked (``_give_back``; tcp's overflow chunks too). Asked with no lane, it makes the
        one the next copy would take (ordered after the consumer and what was queued before)."""
        return not all(e.query() for e in self.lane.waits)

    def _give_back(self, chunk: HostChunk, after: Event) -> None:
        """``chunk``, whose last copy up is ``after`` (queued on the lane), back to the pool:
        parked while the lane still waits for a consumer's stream (``behind_consumer``)."""
        if self.behind_consumer():
            self.pool.park(chunk, after)
            self._behind.append(after)
        else:
            self.pool.release(chunk, after=after)

    async def gather(
        self,
        dsts: Sequence[DeviceBuffer],
        fetch: Move,
        *,
        spoiled: Callable[[], bool],
        until: asyncio.Future[Any] | None = None,
    ) -> None:
        """Fill ``dsts`` whole through host chunks: ``fetch(chunk, pieces)`` lands each chunk's
        pieces in it (several chunks at once, up to the pool's depth), and each chunk's copies
        to the device are queued in order as it lands. Returns once every copy is queued
        (``finish`` for the event after them). Failed or cancelled, the fetches still going are
        stopped and waited for; ``spoiled()`` (asked then) says whether one that failed may
        still write into its chunk, which is then never reused. A chunk is reused once its
        copies have run, which wait for the consumer's stream (``consumer``; see the class's
        docstring): ``until`` (a channel's ``ended``) cuts that wait short, and the wait for a
        chunk of the pool."""

        def start(chunk: HostChunk, pieces: list[Piece]) -> tuple[Event | None, Awaitable[None]]:
            try:
                return None, fetch(chunk, pieces)
            except BaseException:
                self.pool.release(chunk)  # nothing was queued on it
                raise

        def take(now: bool) -> Awaitable[HostChunk | None]:
            return self._acquire(until, now)

        await _window(self.pool, dsts, start, lambda chunk, pieces: self._up(dsts, chunk, pieces), spoiled, take)

    def _up(self, dsts: Sequence[DeviceBuffer], chunk: HostChunk, pieces: list[Piece]) -> None:
        """Queue the copies of a landed chunk's pieces to the device; the chunk goes back after them."""
        lane = self.lane
        for i, pos, off, k in pieces:
            lane.to_device(dsts[i], pos, chunk, off, k)
        self._last = lane.record()
        self._give_back(chunk, self._last)

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
