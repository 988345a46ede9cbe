"""The staging pools are the process's (``CudaEngine.get`` gives every thread the same engine,
and with it the same pools): nodes on event loops of their own, in threads of their own, take
and give back chunks of one pool. The host engine stands in for a GPU."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest
from _polling import eventually

from tensorwire.memory import HostEngine, PinnedPool
from tensorwire.memory._engine import _HostEvent
from tensorwire.tensors import EngineArray
from tensorwire.testing import busy_stream, connected_pair

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024


async def test_a_chunk_given_back_on_one_loop_wakes_a_waiter_on_another_at_once() -> None:
    """A loop waiting for a chunk that another loop holds gets it as soon as that loop gives it
    back. Before, the waiter's future was completed from the other thread, which does not wake
    its loop: it slept on until something else woke it (here its 10 s timeout; with nothing
    else to do, for good)."""
    engine = HostEngine()
    try:
        pool = PinnedPool(engine, 1024, 1)
        held = await pool.acquire()
        took: list[float | BaseException] = []

        def other() -> None:
            async def run() -> None:
                t0 = time.monotonic()
                async with asyncio.timeout(10):
                    chunk = await pool.acquire()
                took.append(time.monotonic() - t0)
                pool.release(chunk)

            try:
                asyncio.run(run())
            except BaseException as exc:
                took.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        try:
            await eventually(lambda: bool(pool._waiters), 10)  # it waits for the chunk
            t0 = time.monotonic()
            pool.release(held)
            await asyncio.to_thread(thread.join, 20)
        finally:
            thread.join(20)
        assert len(took) == 1 and isinstance(took[0], float), took
        assert time.monotonic() - t0 < 2.0, f"the other loop got the chunk only after {took[0]:.1f} s"
        assert pool.free == 1
    finally:
        engine.close()


def test_loops_in_threads_sharing_a_pool_never_get_one_chunk_at_once() -> None:
    """Three loops in three threads take and give back chunks of one pool (depth 3), with the
    interpreter switching threads as often as it can: each chunk is held by one taker at a time,
    and no take fails. Before, two takers could be handed the same chunk (one's staged bytes
    overwritten by the other's: corrupted data) and a take raised RuntimeError ('deque mutated
    during iteration')."""
    engine = HostEngine()
    pool = PinnedPool(engine, 64, 3)
    holders: dict[int, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def worker(me: int) -> None:
        async def run() -> None:
            for i in range(20000):
                async with asyncio.timeout(10):
                    chunk = await pool.acquire()
                with lock:
                    if id(chunk) in holders:
                        errors.append(f"chunk {id(chunk):#x} handed to {me} while {holders[id(chunk)]} held it")
                    holders[id(chunk)] = me
                await asyncio.sleep(0)
                with lock:
                    if holders.get(id(chunk)) == me:
                        del holders[id(chunk)]
                done = _HostEvent()
                done.set()
                pool.release(chunk, after=done if i % 2 else None)

        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        sys.setswitchinterval(interval)
        engine.close()
    assert not errors, errors[:5]
    assert pool.free == 3


async def test_a_device_send_on_another_threads_node_goes_on_once_the_chunk_it_waits_for_is_back() -> None:
    """Two nodes, each on its own loop in its own thread, send device tensors through the one
    process-wide staging ring (one chunk here). Node B's send waits for the chunk that node A's
    send holds while A's producer stream is busy; once that stream frees, B's send goes on at
    once. Before, B's loop was not woken by A's giving the chunk back, and B's send waited on
    for whatever woke its loop next (half a second here; a loop with nothing else to do, for good).
    The bound below is loose (a loaded machine): the lost wakeup itself is the first test's."""
    engine = HostEngine()
    engine.pool("out").configure(CHUNK, 1)
    engine.pool("in").configure(CHUNK, 4)
    pool = engine.pool("out")
    go = threading.Event()
    done: list[float | BaseException] = []

    def node_b() -> None:
        async def run() -> None:
            async with connected_pair("tcp") as (c, d):
                await asyncio.to_thread(go.wait, 20)
                async with asyncio.timeout(20):
                    await asyncio.gather(
                        c.send(EngineArray(engine, np.full(CHUNK, 2, np.uint8)), tag="b"), d.recv(tag="b")
                    )
                done.append(time.monotonic())

        try:
            asyncio.run(run())
        except BaseException as exc:
            done.append(exc)

    thread = threading.Thread(target=node_b)
    try:
        async with connected_pair("tcp") as (a, b):
            with busy_stream(engine) as (stream, gate):
                send = asyncio.ensure_future(
                    a.send(EngineArray(engine, np.ones(CHUNK, np.uint8), stream=stream), tag="a")
                )
                await eventually(lambda: pool.free == 0)  # A's send holds the chunk, its copy behind the stream
                thread.start()
                go.set()
                await eventually(lambda: bool(pool._waiters), 20)  # B's send waits for it
                freed = time.monotonic()
                gate.set()  # A's stream frees: its copy runs, its frame goes, the chunk comes back
                async with asyncio.timeout(10):
                    await asyncio.gather(send, b.recv(tag="a"))
            await asyncio.to_thread(thread.join, 30)
    finally:
        go.set()
        if thread.ident is not None:  # (started)
            thread.join(30)
        engine.close()
    assert len(done) == 1 and isinstance(done[0], float), done
    assert done[0] - freed < 5.0, f"B's send went on {done[0] - freed:.2f} s after the chunk came back"
