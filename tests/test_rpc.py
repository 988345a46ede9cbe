"""Tensor RPC over the data plane: echo, concurrency, deadlines, cancellation, errors, streams."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire._onesided import _OPS_TAG
from tensorwire.rpc import CallLimits, current_deadline, deadline
from tensorwire.rpc._protocol import CONTROL_TAG, REQUEST_TAG, Kind, Reply, meta, reply_tag
from tensorwire.rpc._server import server_of
from tensorwire.tensors import DTYPES
from tensorwire.testing import connected_pair
from tensorwire.testing._conformance import _rand, _same
from tensorwire.transports import Limits

TRANSPORTS = ["tcp", "inproc"]
SERVICE_TAGS = {REQUEST_TAG, CONTROL_TAG, _OPS_TAG}  # recvs that are always posted


@pytest.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[tensorwire.Peer, tensorwire.Peer]]:
    async with connected_pair(request.param) as (a, b):
        yield a, b


def _register_basics(node: tensorwire.Node) -> dict[str, Any]:
    seen: dict[str, Any] = {"cancelled": [], "started": asyncio.Event(), "finished": []}

    @node.method("echo")
    async def echo(*args: Any, **kwargs: Any) -> Any:
        return {"args": args, "kwargs": kwargs}

    @node.method()
    async def add(a: int, b: int = 0) -> int:
        return a + b

    @node.method("sleep")
    async def sleep(seconds: float, tag: str = "") -> str:
        seen["started"].set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            seen["cancelled"].append((tag, current_deadline()))
            raise
        seen["finished"].append(tag)
        return tag

    @node.method("fail")
    async def fail(message: str) -> None:
        raise ValueError(message)

    return seen


async def _eventually(pred: Callable[[], bool], seconds: float = 3.0) -> None:
    await eventually(pred, seconds)


def _await_chain(task: asyncio.Task[Any]) -> list[str]:
    """Where a task waits: its coroutines, innermost last, and what the innermost awaits."""
    chain, obj = [], task.get_coro()
    while obj is not None:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        if frame is None:
            chain.append(repr(obj))
            break
        chain.append(f"{frame.f_code.co_qualname}:{frame.f_lineno}")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None)
    return chain


async def _settled(a: tensorwire.Peer, b: tensorwire.Peer, seconds: float = 3.0) -> None:
    """Wait until no call is running and no RPC message or recv lingers on either side."""

    def lingering() -> list[str]:
        left = []
        for name, p in (("a", a), ("b", b)):
            mb = p.channel.mailbox
            if set(mb._arrived):
                left.append(f"{name}: arrived {sorted(mb._arrived)}")
            if set(mb._posted) - SERVICE_TAGS:
                left.append(f"{name}: posted {sorted(set(mb._posted) - SERVICE_TAGS)}")
            server = server_of(p)
            if server is not None and server.calls:
                for cid, call in server.calls.items():
                    state = {k: getattr(call, k) for k in type(call).__slots__ if k not in ("req", "task")}
                    stack = _await_chain(call.task) if call.task is not None else None
                    left.append(f"{name}: call {cid} {call.req!r} {state} at {stack}")
        return left

    give_up = time.monotonic() + seconds
    while left := lingering():
        assert time.monotonic() < give_up, f"still there after {seconds} s: {left}"
        await asyncio.sleep(0.01)


# -- echo -----------------------------------------------------------------------------------------
async def test_echo_every_dtype_and_nested_pytrees(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    _register_basics(b.node)
    rng = np.random.default_rng(0)
    for name, dt in DTYPES.items():
        x = _rand(rng, dt, (3, 5))
        got = await a.call("echo", x, scale=_rand(rng, dt, ()))
        assert _same(got["args"][0], x), name
        assert got["kwargs"]["scale"].dtype == dt
    tree = {
        "x": _rand(rng, np.dtype(np.float32), (4, 4)),
        "nested": [(_rand(rng, np.dtype(np.int64), (2,)), None), {"deep": {"er": [1, 2.5, True, -0.0]}}],
        "scalars": (None, False, -7, 2**70, 3.25, "text", b"\x00bytes"),
        "empty": ([], {}, ()),
        7: "int key",
    }
    got = await a.call("echo", tree, [tree["x"]], mask=tree["nested"])
    assert _same(got, {"args": (tree, [tree["x"]]), "kwargs": {"mask": tree["nested"]}})
    # non-contiguous arguments arrive C-contiguous; scalars-only calls work too
    base = np.arange(64.0).reshape(8, 8)
    got = await a.call("echo", base.T, base[::2, 1::3])
    assert np.array_equal(got["args"][0], base.T) and got["args"][0].flags.c_contiguous
    assert np.array_equal(got["args"][1], base[::2, 1::3])
    assert await a.call("add", 2, b=40) == 42
    # the same structure again goes through the cached encoding and must still be right
    for i in range(3):
        y = np.full((2, 3), i, np.int16)
        assert _same((await a.call("echo", y))["args"][0], y)
    # either side may serve: the accepting side calls the connecting side
    _register_basics(a.node)
    assert await b.call("add", 1, 2) == 3
    await _settled(a, b)


async def test_large_arguments_and_results(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    _register_basics(b.node)

    @b.node.method("total")
    async def total(x: np.ndarray) -> float:
        return float(x.sum(dtype=np.float64))

    big = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: sent after GO
    got = await a.call("echo", big, small=np.ones(3))
    assert _same(got["args"][0], big)
    assert await a.call("total", big) == pytest.approx(float(big.sum(dtype=np.float64)))

    @b.node.method("ident")
    async def ident(x: Any) -> Any:
        return x

    # _out=: the result lands in the caller's tensors
    out = np.empty_like(big)
    got = await a.call("ident", big, _out=out)
    assert got is out and np.array_equal(out, big)
    small = np.empty(3)
    assert await a.call("ident", np.arange(3.0), _out=small) is small and small.tolist() == [0, 1, 2]
    pair_out = {"a": np.empty(2, np.int8), "b": np.empty((2, 2), np.float32)}
    sent = {"a": np.array([1, 2], np.int8), "b": np.eye(2, dtype=np.float32)}
    assert _same(await a.call("ident", sent, _out=pair_out), sent)
    with pytest.raises(tensorwire.ShapeMismatchError, match="_out"):
        await a.call("ident", np.arange(4.0), _out=small)
    with pytest.raises(tensorwire.RemoteError, match="ValueError"):
        await a.call("fail", "no result", _out=small)
    await _settled(a, b)


# -- concurrency ----------------------------------------------------------------------------------
async def test_concurrent_calls_and_a_slow_one_blocks_nothing(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    seen = _register_basics(b.node)
    release = asyncio.Event()

    @b.node.method("wait")
    async def wait() -> str:
        await release.wait()
        return "slow done"

    slow = asyncio.ensure_future(a.call("wait"))
    big = asyncio.ensure_future(a.call("echo", np.ones(4 << 20, np.uint8)))
    t0 = time.perf_counter()
    results = await asyncio.gather(*[a.call("add", i, i) for i in range(200)])
    assert results == [2 * i for i in range(200)]
    assert np.array_equal((await big)["args"][0], np.ones(4 << 20, np.uint8))
    assert time.perf_counter() - t0 < 5
    assert not slow.done(), "the slow call should still be running"
    tags = [f"t{i}" for i in range(20)]
    assert sorted(await asyncio.gather(*[a.call("sleep", 0.05, tag=t) for t in tags])) == sorted(tags)
    release.set()
    assert await slow == "slow done"
    assert seen["cancelled"] == []
    await _settled(a, b)


async def test_many_peers_call_one_node() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server:
        _register_basics(server)
        async with (
            tensorwire.start("127.0.0.1:0", transports=("tcp",)) as c1,
            tensorwire.start("127.0.0.1:0", transports=("tcp",)) as c2,
            tensorwire.start("127.0.0.1:0", transports=("tcp",)) as c3,
        ):
            peers = [await c.connect(server.address) for c in (c1, c2, c3)]

            async def hammer(p: tensorwire.Peer, k: int) -> list[Any]:
                return await asyncio.gather(*[p.call("add", k, i) for i in range(50)])

            out = await asyncio.gather(*[hammer(p, 1000 * k) for k, p in enumerate(peers)])
            for k, res in enumerate(out):
                assert res == [1000 * k + i for i in range(50)]


async def test_concurrency_limit_applies_backpressure(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    b.node.methods.limits = CallLimits(max_concurrent=2)
    running = 0
    peak = 0
    release = asyncio.Event()

    @b.node.method("hold")
    async def hold(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await release.wait()
        finally:
            running -= 1
        return i

    calls = [asyncio.ensure_future(a.call("hold", i)) for i in range(12)]
    await asyncio.sleep(0.3)
    assert running == 2 and peak == 2
    # the server stopped reading: the other requests wait in the transport, not in server tasks
    server = server_of(b)
    assert server is not None and len(server.calls) <= 3
    assert len(b.channel.mailbox._arrived.get(REQUEST_TAG, ())) >= 8
    release.set()
    assert await asyncio.gather(*calls) == list(range(12))
    assert peak == 2
    await _settled(a, b)


async def test_bytes_in_flight_limit(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    b.node.methods.limits = CallLimits(max_concurrent=16, max_inflight_bytes=1 << 20)
    running = 0
    peak = 0

    @b.node.method("chew")
    async def chew(x: np.ndarray) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return int(x[0])

    xs = [np.full(600 << 10, i, np.uint8) for i in range(5)]  # 600 KiB: two never fit in 1 MiB
    assert await asyncio.gather(*[a.call("chew", x) for x in xs]) == list(range(5))
    assert peak == 1
    # one call bigger than the whole budget can never run: a clear error, not a hang
    with pytest.raises(tensorwire.InvalidArguments, match="limit"):
        await a.call("chew", np.zeros(2 << 20, np.uint8))
    await _settled(a, b)


# -- deadlines and cancellation -------------------------------------------------------------------
async def test_deadline_enforced_by_the_server(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """A raw request with a 0.2 s deadline and a caller that never cancels: the server alone
    must stop the method and answer DeadlineExceeded."""
    a, b = pair
    seen = _register_basics(b.node)
    request = (meta(987654, 0.2, Kind.UNARY, -1), "sleep", (30.0,), {"tag": "raw"})
    t0 = time.perf_counter()
    await a._send_own(request, tag=REQUEST_TAG)
    reply = await a._recv_own(tag=reply_tag(987654))
    elapsed = time.perf_counter() - t0
    assert reply[0] == Reply.ERROR and "deadline" in reply[3], reply
    assert 0.15 < elapsed < 2.0
    assert [t for t, _ in seen["cancelled"]] == ["raw"]
    await _settled(a, b)


async def test_deadline_from_the_caller(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    seen = _register_basics(b.node)
    t0 = time.perf_counter()
    with pytest.raises(tensorwire.DeadlineExceeded) as info:
        await a.call("sleep", 30.0, tag="kw", _deadline=0.3)
    assert isinstance(info.value, TimeoutError)
    assert 0.25 < time.perf_counter() - t0 < 2.0
    # the method saw the deadline (what was left of it) and was cancelled
    await _eventually(lambda: bool(seen["cancelled"]))
    tag, left = seen["cancelled"][0]
    assert tag == "kw" and left is not None and left < 0.3

    # a deadline() block travels the same way, and its expiry is the plain TimeoutError
    async def in_a_deadline_block() -> None:
        async with deadline(0.3):
            left = current_deadline()
            assert left is not None and 0 < left <= 0.3
            await a.call("sleep", 30.0, tag="block")

    with pytest.raises(TimeoutError) as block:
        await in_a_deadline_block()
    assert not isinstance(block.value, tensorwire.TensorWireError)
    await _eventually(lambda: len(seen["cancelled"]) >= 2)
    assert seen["cancelled"][1][0] == "block"
    # a generous deadline changes nothing
    assert await a.call("add", 1, 2, _deadline=5) == 3
    with pytest.raises(tensorwire.ConfigurationError):
        await a.call("add", 1, 2, _deadline="soon")
    await _settled(a, b)


async def test_a_call_without_a_deadline_makes_no_timeout_and_one_with_a_deadline_still_does(
    pair: tuple[tensorwire.Peer, tensorwire.Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with no deadline (most) enters no ``asyncio.timeout`` on either side: three a call
    cost ~5 us of its ~140 us in one process. A call or stream with one still runs under it."""
    a, b = pair
    seen = _register_basics(b.node)

    @b.node.method("count")
    async def count(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    made: list[str] = []

    class Counted(asyncio.timeouts.Timeout):
        def __init__(self, when: float | None) -> None:
            where = sys._getframe(2).f_code.co_filename
            if f"tensorwire{os.sep}rpc" in where:
                made.append(where)
            super().__init__(when)

    monkeypatch.setattr(asyncio.timeouts, "Timeout", Counted)
    for _ in range(5):
        assert await a.call("add", 1, 2) == 3
    assert [i async for i in a.stream("count", 3)] == [0, 1, 2]
    assert made == []
    assert await a.call("add", 1, 2, _deadline=5) == 3
    assert made  # (the caller's and the server's)
    with pytest.raises(tensorwire.DeadlineExceeded):
        await a.call("sleep", 30.0, tag="late", _deadline=0.2)
    await _eventually(lambda: [t for t, _ in seen["cancelled"]] == ["late"])
    await _settled(a, b)


async def test_a_call_runs_no_generator_block(
    pair: tuple[tensorwire.Peer, tensorwire.Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks every call enters (the server's deadline scope and slot loan, the caller's
    ``lending``) are classes, not generators (``_blocks.block``, ~0.5-1 us more each), and still
    lend a method's slot to its calls back (``test_rpc_nested``) and leave its errors as they are
    (``test_rpc_edges``)."""
    from tensorwire import _blocks

    a, b = pair
    _register_basics(b.node)
    made: list[object] = []

    class Counted(_blocks._Block):
        def __init__(self, gen: Any) -> None:
            made.append(gen)
            super().__init__(gen)

    monkeypatch.setattr(_blocks, "_Block", Counted)
    for _ in range(5):
        assert await a.call("add", 1, 2) == 3
    assert made == []
    await _settled(a, b)


async def test_cancelling_the_caller_cancels_the_server_task(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    seen = _register_basics(b.node)
    task = asyncio.ensure_future(a.call("sleep", 30.0, tag="cancel-me"))
    await asyncio.wait_for(seen["started"].wait(), 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _eventually(lambda: bool(seen["cancelled"]))
    assert seen["cancelled"][0][0] == "cancel-me"
    # an enclosing asyncio.timeout cancels the same way
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await a.call("sleep", 30.0, tag="timeout")
    await _eventually(lambda: len(seen["cancelled"]) >= 2)
    assert seen["finished"] == []
    await _settled(a, b)
    assert await a.call("add", 2, 3) == 5


async def _cancel_at_random_moments(a: tensorwire.Peer, b: tensorwire.Peer, big: np.ndarray) -> None:
    @b.node.method("take")
    async def take(x: np.ndarray) -> int:
        return x.size

    for delay in (0.0, 0.0005, 0.001, 0.003, 0.01, 0.03):
        task = asyncio.ensure_future(a.call("take", big))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await _settled(a, b, seconds=8)
    assert await a.call("take", np.ones(10, np.uint8)) == 10
    assert await a.call("take", big) == big.size


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cancel_during_large_argument_transfer(transport: str) -> None:
    """Arguments past the peer's credit go rendezvous; a caller cancelled at any moment (before
    GO, while the tensors move) leaves nothing behind on either side."""
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=8 << 20)) as (a, b):
        await _cancel_at_random_moments(a, b, np.ones(24 << 20, np.uint8))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cancel_during_eager_argument_transfer(transport: str) -> None:
    """The same within the peer's credit: the tensors go eagerly, the first chunk with the header."""
    async with connected_pair(transport) as (a, b):
        await _cancel_at_random_moments(a, b, np.ones(24 << 20, np.uint8))


# -- errors ---------------------------------------------------------------------------------------
async def test_remote_exceptions_keep_type_message_and_traceback(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    _register_basics(b.node)
    with pytest.raises(tensorwire.RemoteError) as info:
        await a.call("fail", "bad input 42")
    err = info.value
    assert type(err) is tensorwire.RemoteError
    assert err.remote_type == "ValueError"
    assert err.remote_message == "bad input 42"
    assert "in fail" in err.remote_traceback and "raise ValueError(message)" in err.remote_traceback
    assert "ValueError" in str(err) and "bad input 42" in str(err) and err.method == "fail"
    assert any("remote traceback" in note for note in err.__notes__)
    assert await a.call("add", 1, 1) == 2  # the node keeps serving


class _Halt(BaseException):
    """Neither an Exception nor a cancellation: a framework's "abort this request", say."""


async def _answer(aw: Any, seconds: float = 5.0) -> Any:
    """``await aw``; a call that never answers fails the test instead of hanging it."""
    tm = asyncio.timeout(seconds)
    try:
        async with tm:
            return await aw
    except TimeoutError:
        if tm.expired():
            pytest.fail(f"no answer within {seconds} s: the call hangs")
        raise


async def test_a_method_raising_a_base_exception_still_answers(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """A BaseException of the method's own (a BaseExceptionGroup out of its TaskGroup among them)
    comes back as an error, and the call's slot comes back with it (the node has one here)."""
    a, b = pair
    _register_basics(b.node)
    b.node.methods.limits = CallLimits(max_concurrent=1)

    async def stop() -> None:
        raise _Halt("stop here")

    @b.node.method()
    async def halt() -> None:
        await stop()

    @b.node.method()
    async def group() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(stop())

    @b.node.method()
    async def halting() -> AsyncIterator[int]:
        yield 1
        await stop()

    for name, remote_type in (("halt", "_Halt"), ("group", "BaseExceptionGroup")):
        with pytest.raises(tensorwire.RemoteError) as info:
            await _answer(a.call(name))
        assert info.value.remote_type == remote_type and "stop" in info.value.remote_traceback
    got: list[int] = []

    async def consume() -> None:
        async for x in a.stream("halting"):
            got.append(x)

    with pytest.raises(tensorwire.RemoteError, match="_Halt: stop here"):
        await _answer(consume())
    assert got == [1]
    assert await _answer(a.call("add", 1, 2)) == 3
    await _settled(a, b)


async def test_a_method_cancelled_by_the_serving_application_still_answers(
    pair: tuple[tensorwire.Peer, tensorwire.Peer],
) -> None:
    """Its caller did not cancel and its peer is open: the caller gets an error, not silence."""
    a, b = pair
    _register_basics(b.node)
    running: set[asyncio.Task[Any]] = set()

    @b.node.method()
    async def work() -> str:
        task = asyncio.current_task()
        assert task is not None
        running.add(task)  # say, to drop the work in flight when the model reloads
        try:
            await asyncio.sleep(30)
            return "done"
        finally:
            running.discard(task)

    call = asyncio.ensure_future(a.call("work"))
    await _eventually(lambda: bool(running))
    for task in list(running):
        task.cancel()
        task.cancel()  # twice: all of it is taken back before the reply goes
    with pytest.raises(tensorwire.RemoteError) as info:
        await _answer(call)
    assert type(info.value) is tensorwire.RemoteError and info.value.remote_type == "CancelledError"
    assert await _answer(a.call("add", 1, 2)) == 3
    await _settled(a, b)


async def test_errors_raised_inside_a_method_are_its_own(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """MethodNotFound, InvalidArguments and DeadlineExceeded say something of the call itself.
    Raised by a call the method makes, they are the method's error (RemoteError, with their type
    as remote_type): a caller of "relay" must not be told that "relay" does not exist."""
    a, b = pair
    _register_basics(a.node)  # what b's methods call on a
    _register_basics(b.node)

    @b.node.method()
    async def relay(name: str, *args: Any) -> Any:
        return await b.call(name, *args)

    @b.node.method()
    async def impatient() -> Any:
        return await b.call("sleep", 5.0, _deadline=0.05)

    for args, remote_type in (
        (("not_on_a",), "MethodNotFound"),
        (("add", 1, 2, 3), "InvalidArguments"),
    ):
        with pytest.raises(tensorwire.RemoteError) as info:
            await _answer(a.call("relay", *args))
        assert type(info.value) is tensorwire.RemoteError, info.value
        assert info.value.remote_type == remote_type and "relay" in info.value.remote_traceback
    with pytest.raises(tensorwire.RemoteError) as info:
        await _answer(a.call("impatient"))
    assert type(info.value) is tensorwire.RemoteError and info.value.remote_type == "DeadlineExceeded"
    assert await _answer(a.call("relay", "add", 1, 2)) == 3
    # the call's own lookup, arguments and deadline still say so
    with pytest.raises(tensorwire.MethodNotFound):
        await _answer(a.call("not_on_b"))
    with pytest.raises(tensorwire.InvalidArguments):
        await _answer(a.call("relay"))
    with pytest.raises(tensorwire.DeadlineExceeded):
        await _answer(a.call("impatient", _deadline=0.02))
    await _settled(a, b)


async def test_out_takes_tensors_only(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """The result's tensors land in ``_out`` and the call returns ``_out`` itself. An ``_out``
    without a tensor would take an error reply (which carries none) for a result and swallow it,
    and a scalar in it would come back as it was, not as the method returned it: both are
    refused before anything is sent."""
    a, b = pair
    _register_basics(b.node)
    calls = 0

    @b.node.method()
    async def step() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"x": np.arange(4, dtype=np.float32), "step": 12}

    x = np.zeros(4, np.float32)
    refused: list[Any] = [(), {}, [[], {}], {"x": x, "step": 0}, [x, None], "x", b"x"]
    for out in refused:
        with pytest.raises(tensorwire.ConfigurationError, match="_out"):
            await _answer(a.call("step", _out=out))
        with pytest.raises(tensorwire.ConfigurationError, match="_out"):
            await _answer(a.call("fail", "swallowed", _out=out))
    assert calls == 0
    nested: Any = x
    for _ in range(40):
        nested = [nested]
    with pytest.raises(tensorwire.ConfigurationError, match="deeper"):
        await _answer(a.call("step", _out=nested))
    # with a tensor in _out, errors come through as they do without
    with pytest.raises(tensorwire.RemoteError, match="ValueError"):
        await _answer(a.call("fail", "not swallowed", _out={"x": x}))
    with pytest.raises(tensorwire.MethodNotFound):
        await _answer(a.call("no_such_method", _out=(x,)))
    assert (await _answer(a.call("step")))["step"] == 12
    await _settled(a, b)


async def test_bad_calls_get_clear_errors_and_the_node_keeps_serving(
    pair: tuple[tensorwire.Peer, tensorwire.Peer],
) -> None:
    a, b = pair
    _register_basics(b.node)

    @b.node.method("small", max_arg_bytes=1024)
    async def small(x: np.ndarray) -> int:
        return x.nbytes

    @b.node.method("gen")
    async def gen(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @b.node.method("unmovable")
    async def unmovable() -> object:
        return object()

    with pytest.raises(tensorwire.MethodNotFound, match=r"no method named 'nope'.*add.*echo"):
        await a.call("nope", 1)
    with pytest.raises(tensorwire.InvalidArguments, match="add"):
        await a.call("add")  # missing argument
    with pytest.raises(tensorwire.InvalidArguments):
        await a.call("add", 1, 2, 3)
    with pytest.raises(tensorwire.InvalidArguments):
        await a.call("add", 1, c=3)
    with pytest.raises(tensorwire.InvalidArguments, match="limit"):
        await a.call("small", np.zeros(2048, np.uint8))  # inline, over the declared limit
    with pytest.raises(tensorwire.InvalidArguments, match="limit"):
        await a.call("small", np.zeros(1 << 20, np.uint8))  # sent after GO: refused before it moves
    assert await a.call("small", np.zeros(1024, np.uint8)) == 1024
    with pytest.raises(tensorwire.InvalidArguments, match="streaming"):
        await a.call("gen", 3)
    with pytest.raises(tensorwire.InvalidArguments, match="not a streaming"):
        async for _ in a.stream("add", 1):
            pass
    with pytest.raises(tensorwire.RemoteError, match="UnsupportedTensorError"):
        await a.call("unmovable")
    with pytest.raises(tensorwire.UnsupportedTensorError):
        await a.call("echo", object())  # refused locally, nothing sent
    with pytest.raises(tensorwire.ConfigurationError):
        await a.call(42)  # type: ignore[arg-type]
    # a hostile or broken peer's garbage on the reserved tags is dropped, with nothing lost
    await a._send_own({"not": "a request"}, tag=REQUEST_TAG)
    await a._send_own(("x",), tag=CONTROL_TAG)
    await a._send_own((meta(5555, None, Kind.UNARY, -1), "echo", "not a tuple", {}), tag=REQUEST_TAG)
    bad = await a._recv_own(tag=reply_tag(5555))
    assert bad[0] == Reply.ERROR and "malformed" in bad[3]
    assert await a.call("add", 20, 22) == 42
    assert [x async for x in a.stream("gen", 3)] == [0, 1, 2]
    await _settled(a, b)


async def test_registration_errors() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("inproc",)) as node:

        def sync(x: int) -> int:
            return x

        with pytest.raises(tensorwire.ConfigurationError, match="async"):
            node.method("sync")(sync)

        async def reserved(x: int, _deadline: float) -> int:
            return x

        with pytest.raises(tensorwire.ConfigurationError, match="_deadline"):
            node.method()(reserved)

        async def reserved_out(x: int, **_out: Any) -> int:
            return x

        node.method()(reserved_out)  # a **kwargs catch-all named _out is not a parameter named _out

        async def takes_out(x: int, _out: Any = None) -> int:
            return x

        with pytest.raises(tensorwire.ConfigurationError, match="_out"):
            node.method()(takes_out)
        node.methods.unregister("reserved_out")

        @node.method
        async def plain(x: int) -> int:
            """Doubles x.

            More words."""
            return 2 * x

        with pytest.raises(tensorwire.ConfigurationError, match="already"):
            node.method("plain")(plain)
        assert list(node.methods) == ["plain"]
        m = node.methods["plain"]
        assert (m.signature, m.doc, m.streaming) == ("(x: int)", "Doubles x.", False)
        node.methods.unregister("plain")
        assert len(node.methods) == 0
        with pytest.raises(tensorwire.ConfigurationError):
            tensorwire.rpc.CallLimits(max_concurrent=0)


async def test_partials_and_objects_with_an_async_call_serve(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """An object whose class declares ``async def __call__`` serves like a bound method (it was
    refused as "not declared with 'async def'"), and a functools.partial lists its function's
    doc (it listed functools.partial's own)."""
    a, b = pair

    class Scale:
        """Scales x."""

        def __init__(self, k: int) -> None:
            self.k = k

        async def __call__(self, x: int) -> int:
            return self.k * x

    class Count:
        async def __call__(self, n: int) -> AsyncIterator[int]:
            """Counts to n."""
            for i in range(n):
                yield i

    async def add(x: int, y: int) -> int:
        """Adds y to x."""
        return x + y

    node = b.node
    node.method("scale")(Scale(3))
    node.method("count")(Count())
    node.method("add5")(functools.partial(add, y=5))
    with pytest.raises(tensorwire.ConfigurationError, match="give the method a name"):
        node.method()(Scale(2))
    with pytest.raises(tensorwire.ConfigurationError, match="async def"):
        node.method("cls")(Scale)  # the class: calling it makes an object, not a coroutine
    methods = node.methods
    got = {n: (methods[n].signature, methods[n].doc, methods[n].streaming) for n in ("scale", "count", "add5")}
    assert got == {
        "scale": ("(x: int)", "Scales x.", False),
        "count": ("(n: int)", "Counts to n.", True),
        "add5": ("(x: int, *, y: int = 5)", "Adds y to x.", False),
    }
    async with asyncio.timeout(10):
        assert await a.call("scale", 7) == 21
        assert [i async for i in a.stream("count", 3)] == [0, 1, 2]
        assert await a.call("add5", 1) == 6


async def test_peer_going_away_fails_pending_calls() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client:
        server = await tensorwire.start("127.0.0.1:0", transports=("tcp",))
        seen = _register_basics(server)
        peer = await client.connect(server.address)
        task = asyncio.ensure_future(peer.call("sleep", 30.0))
        await asyncio.wait_for(seen["started"].wait(), 2)
        await server.aclose()
        with pytest.raises((tensorwire.PeerDisconnected, tensorwire.ClosedResourceError)):
            async with asyncio.timeout(3):
                await task
        with pytest.raises(tensorwire.TensorWireError):
            await peer.call("add", 1, 2)


# -- streams --------------------------------------------------------------------------------------
async def test_streaming(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    closed: list[str] = []

    @b.node.method("count")
    async def count(n: int, width: int = 4) -> AsyncIterator[Any]:
        try:
            for i in range(n):
                yield {"i": i, "x": np.full(width, i, np.int32)}
        finally:
            closed.append(f"count {n}")

    @b.node.method("broken")
    async def broken() -> AsyncIterator[int]:
        yield 1
        raise KeyError("gone")

    items = [item async for item in a.stream("count", 100)]
    assert [it["i"] for it in items] == list(range(100))
    assert all(np.array_equal(it["x"], np.full(4, it["i"], np.int32)) for it in items)
    # a slow consumer: the server waits for acknowledgements instead of flooding the peer
    got = []
    async for item in a.stream("count", 40, width=1 << 16):
        got.append(item["i"])
        if len(got) % 10 == 0:
            await asyncio.sleep(0.02)
    assert got == list(range(40))
    # leaving early cancels the generator on the server
    agen = a.stream("count", 10_000)
    async with contextlib.aclosing(agen):  # type: ignore[type-var]
        async for item in agen:
            if item["i"] == 5:
                break
    await _eventually(lambda: "count 10000" in closed)
    with pytest.raises(tensorwire.RemoteError, match="KeyError") as info:
        async for _ in a.stream("broken"):
            pass
    assert info.value.remote_type == "KeyError"
    with pytest.raises(tensorwire.DeadlineExceeded):
        async for _ in a.stream("count", 10**9, _deadline=0.2):
            pass
    await _settled(a, b)


async def test_nothing_leaks_after_many_calls(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    a, b = pair
    seen = _register_basics(b.node)
    for i in range(300):
        await a.call("add", i, 1)
    for _ in range(20):
        with contextlib.suppress(tensorwire.RemoteError):
            await a.call("fail", "x")
    for _ in range(10):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.01):
                await a.call("sleep", 1.0)
    await _settled(a, b)
    assert len(seen["cancelled"]) == 10
    await asyncio.sleep(0.05)
    # per peer: the one-sided service, the request reader and the control reader; nothing else
    assert len(a._tasks) == 3 and len(b._tasks) == 3, (a._tasks, b._tasks)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_random_cancellations_and_deadlines_leave_nothing_behind(transport: str) -> None:
    """Calls of every size and streams, 40 at a time under tight limits, some cancelled at random
    moments by timeouts and some running out of deadline: every answer that comes is right, and
    afterwards no call, message or recv lingers on either side."""
    rng = random.Random(7)
    async with connected_pair(transport, limits=Limits(recv_buffer_bytes=16 << 20)) as (a, b):
        b.node.methods.limits = CallLimits(max_concurrent=8, max_inflight_bytes=64 << 20)

        @b.node.method()
        async def echo(x: np.ndarray, delay: float = 0.0) -> np.ndarray:
            await asyncio.sleep(delay)
            return x

        @b.node.method()
        async def gen(n: int, size: int) -> AsyncIterator[np.ndarray]:
            for i in range(n):
                yield np.full(size, i % 250, np.uint8)

        outcomes: dict[str, int] = {"ok": 0, "timeout": 0, "deadline": 0}

        async def one(i: int) -> None:
            size = rng.choice([8, 1000, 70_000, 1 << 20, 12 << 20, 20 << 20])
            x = np.full(size, i % 250, np.uint8)
            kind = rng.random()
            try:
                if kind < 0.6:
                    async with asyncio.timeout(rng.uniform(0, 0.2) if rng.random() < 0.3 else None):
                        y = await a.call("echo", x, delay=rng.uniform(0, 0.01))
                    assert y.size == size and y[0] == y[-1] == i % 250
                elif kind < 0.8:
                    await a.call("echo", x, delay=0.02, _deadline=rng.uniform(0.001, 0.04))
                else:
                    n = rng.randint(0, 40)
                    got = 0
                    async for item in a.stream("gen", n, rng.choice([4, 100_000])):
                        assert item[0] == got % 250
                        got += 1
                        if rng.random() < 0.05:
                            break
                outcomes["ok"] += 1
            except tensorwire.DeadlineExceeded:
                outcomes["deadline"] += 1
            except TimeoutError:
                outcomes["timeout"] += 1

        for _ in range(3):
            await asyncio.gather(*[one(i) for i in range(40)])
        await _settled(a, b, seconds=8)
        assert outcomes["ok"] > 40 and outcomes["deadline"] > 5 and outcomes["timeout"] > 0, outcomes
        assert a.channel.state.value == "open" and await a.call("echo", np.ones(2)) is not None
