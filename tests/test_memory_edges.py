"""Edges of the memory layer, with the host copy engine standing in for a GPU: the staging pool
under cancellation and failed copies, and waits for device events that take long."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from _polling import eventually

from tensorwire.memory import HostEngine, PinnedPool, StageIn, download, scatter
from tensorwire.testing import busy_stream

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024
DEPTH = 3


async def test_a_waiter_woken_then_cancelled_passes_its_chunk_on() -> None:
    """A chunk given back wakes one waiter; if that waiter is cancelled before it runs, the next
    waiter gets the chunk (it waited forever with the chunk lying free)."""
    engine = HostEngine()
    try:
        pool = PinnedPool(engine, 1024, 1)
        held = await pool.acquire()
        first = asyncio.ensure_future(pool.acquire())
        second = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        pool.release(held)  # wakes ``first``...
        first.cancel()  # ...which is cancelled before it takes the chunk
        async with asyncio.timeout(10):
            chunk = await second
        assert first.cancelled()
        pool.release(chunk)
        assert pool.free == 1
    finally:
        engine.close()


class _Refusing(HostEngine):
    """A host engine whose lanes fail to queue a copy, or to record an event after one (on a GPU:
    a CUDA error from cudaMemcpyAsync or cudaEventRecord)."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.step = step

    def _new_lane(self) -> Any:
        lane = super()._new_lane()

        def refuse(*_: object) -> Any:
            raise RuntimeError("refused")

        if self.step == "copy":
            lane.to_host = refuse  # type: ignore[method-assign]
            lane.to_device = refuse  # type: ignore[method-assign]
        else:
            lane.record = refuse  # type: ignore[method-assign]
        return lane


@pytest.mark.parametrize("step", ["copy", "record"])
@pytest.mark.parametrize("way", ["stage_out", "stage_in"])
async def test_a_staging_copy_that_cannot_be_queued_loses_no_chunk(way: str, step: str) -> None:
    """A chunk whose copy could not be queued goes back to the pool; one whose copy was queued
    but whose event could not be recorded is retired (the copy may still touch it). Lost, each
    failure took a chunk from the process's pool for good, and after ``depth`` of them every
    staged transfer hung."""
    engine = _Refusing(step)
    try:
        pool = engine.pool("out" if way == "stage_out" else "in")
        pool.configure(CHUNK, DEPTH)

        async def move() -> None:
            if way == "stage_out":
                data = np.arange(CHUNK * 2, dtype=np.uint8)
                await download(engine.buffer(data), np.zeros_like(data).data)
            else:
                dst = engine.empty(CHUNK * 2)
                await StageIn(engine).write(lambda: dst, 0, dst.nbytes, lambda view, pos: None)

        for _ in range(DEPTH + 1):
            async with asyncio.timeout(10):
                with pytest.raises(RuntimeError, match="refused"):
                    await move()
        assert pool.free == DEPTH
        assert pool.retired == (DEPTH + 1 if step == "record" else 0)
    finally:
        engine.close()


async def test_a_scatter_chunk_whose_second_copy_cannot_be_queued_is_retired() -> None:
    """Two pieces share one chunk; the first piece's copy is queued, the second's refused: the
    first may still write into the chunk, so it is retired, never handed to the next transfer
    (it went back to the pool, where a download could take it while that copy ran)."""
    engine = HostEngine()
    try:
        pool = engine.pool("out")
        pool.configure(CHUNK, DEPTH)
        lane = engine.lane()
        queued = lane.to_host

        def second_refused(*args: Any) -> None:
            lane.to_host = refuse  # type: ignore[method-assign]
            queued(*args)

        def refuse(*_: object) -> None:
            raise RuntimeError("refused")

        lane.to_host = second_refused  # type: ignore[method-assign]
        engine.give_back(lane)  # the lane scatter takes

        async def push(chunk: Any, pieces: Any) -> None:
            raise AssertionError("nothing is pushed")

        srcs = [engine.buffer(np.arange(1024, dtype=np.uint8)), engine.buffer(np.arange(2048, dtype=np.uint8))]
        with pytest.raises(RuntimeError, match="refused"):
            await scatter(srcs, push, spoiled=lambda: False)
        assert pool.retired == 1  # (before: released, pool.retired == 0)
    finally:
        engine.close()


async def test_a_wait_for_a_stuck_stream_holds_up_no_other() -> None:
    """Transfers waiting for a producer stream that stays busy (a long kernel, or one that never
    ends) do not hold up other transfers of the engine: each wait for a device event is polled
    on its own, not in one of a few shared threads that the stuck waits kept busy."""
    engine = HostEngine(copy_delay=0.01)  # slower than wait_event's spin: every wait is polled
    try:
        data = np.arange(CHUNK, dtype=np.uint8)
        with busy_stream(engine) as (stream, _gate):
            stuck = [
                asyncio.ensure_future(download(engine.buffer(data), np.zeros_like(data).data, engine.record_on(stream)))
                for _ in range(4)
            ]
            await eventually(lambda: engine.max_queued >= len(stuck))  # copies queued behind the stream...
            await asyncio.sleep(0.2)  # ...and they wait for the first one's event
            out = np.zeros_like(data)
            async with asyncio.timeout(10):
                await download(engine.buffer(data), out.data)
            assert np.array_equal(out, data)
            assert not any(t.done() for t in stuck)
        async with asyncio.timeout(10):
            await asyncio.gather(*stuck)
    finally:
        engine.close()


@pytest.mark.parametrize("way", ["cancelled-send", "landed-recv"])
async def test_a_lane_waiting_for_a_busy_stream_is_not_handed_to_the_next_transfer(way: str) -> None:
    """A lane goes back to the engine's free list while it still waits for a framework's busy
    stream (a send cancelled while its producer's stream is busy; a recv whose copies wait for
    its consumer's stream): the next transfer takes another lane, and does not wait for that
    stream too (it hung for as long as the stream stayed busy)."""
    engine = HostEngine()
    try:
        data = np.arange(CHUNK, dtype=np.uint8)
        with busy_stream(engine) as (stream, _gate):
            if way == "cancelled-send":
                send = asyncio.ensure_future(
                    download(engine.buffer(data), np.zeros_like(data).data, engine.record_on(stream))
                )
                await eventually(lambda: engine.max_queued >= 1)  # its copy is queued behind the stream
                send.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await send
            else:
                dst = engine.empty(data.nbytes)
                stage = StageIn(engine, consumer=engine.record_on(stream))
                await stage.write(lambda: dst, 0, dst.nbytes, lambda view, pos: None)
                assert stage.finish() is not None  # what the consumer's stream would wait for
            out = np.zeros_like(data)
            async with asyncio.timeout(10):
                await download(engine.buffer(data), out.data)
            assert np.array_equal(out, data)
    finally:
        engine.close()
