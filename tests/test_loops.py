"""A node and its peers belong to the event loop the node was started on: a call from another
loop (another thread's) is refused at once, and abort() alone may come from anywhere."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from _elsewhere import on_another_loop

import tensorwire
from tensorwire._peer import RESERVED_TAGS
from tensorwire.testing import connected_pair


async def _drain(it: Any) -> None:
    async for _ in it:
        pass


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.timeout(60)
async def test_a_node_and_its_peers_refuse_calls_from_another_loop(transport: str) -> None:
    """A peer used from a second loop while its own loop used it too hung that loop's recvs
    (40 s over tcp, 200 x 1 MiB each way), then the channel broke; a lone call from the other
    loop went through by luck. Every method but abort() is now refused there at once, nothing
    of it reaches the peer, and the node's own loop goes on using it."""
    async with connected_pair(transport) as (a, b):
        na, nb = a.node, b.node

        @nb.method("echo")
        async def echo(x: Any) -> Any:
            return x

        @nb.method("count")
        async def count(n: int) -> Any:
            for i in range(n):
                yield i

        x = np.arange(8, dtype=np.float32)
        nb.expose(np.zeros(8, np.float32), name="h")
        h = await a.lookup("h")
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "peer.send": lambda: a.send(x, tag="t"),
            "peer.recv": lambda: a.recv(tag="t"),
            "peer.recv_with_receipt": lambda: a.recv_with_receipt(tag="t"),
            "peer.call": lambda: a.call("echo", x),
            "peer.call_with_receipt": lambda: a.call_with_receipt("echo", x),
            "peer.stream": lambda: _drain(a.stream("count", 2)),
            "peer.stream_with_receipts": lambda: _drain(a.stream_with_receipts("count", 2)),
            "peer.lookup": lambda: a.lookup("h"),
            "peer.read": lambda: a.read(h),
            "peer.read_with_receipt": lambda: a.read_with_receipt(h),
            "peer.write": lambda: a.write(h, x),
            "peer.read_many": lambda: a.read_many([h]),
            "peer.read_many_with_receipt": lambda: a.read_many_with_receipt([h]),
            "peer.write_many": lambda: a.write_many([h], [x]),
            "peer.aclose": a.aclose,
            "node.connect": lambda: na.connect(nb.address),
            "node.accept": nb.accept,
            "node.aclose": na.aclose,
        }
        for what, make in calls.items():
            err = await asyncio.to_thread(on_another_loop, make)
            assert isinstance(err, tensorwire.ConfigurationError), (what, err)
            assert f"{what} was called on an event loop that is not the node's" in str(err), err
            assert "asyncio.run_coroutine_threadsafe(coro, node_loop)" in str(err), err
        # where no loop runs at all (a worker thread): the synchronous methods
        for what, fn in {
            "node.expose": lambda: na.expose(x, name="g"),
            "node.unexpose": lambda: nb.unexpose("h"),
            "peer.stream": lambda: a.stream("count", 2),
        }.items():
            with pytest.raises(tensorwire.ConfigurationError, match=f"{what} was called where no event loop runs"):
                await asyncio.to_thread(fn)

        # nothing of the refused calls reached the other side, and both loops' objects serve on
        assert not a.closed and not b.closed and na.peers == [a]
        await a.send(x, tag="t")
        np.testing.assert_array_equal(await b.recv(tag="t"), x)
        assert not b.channel.mailbox.holds_messages(ignore=RESERVED_TAGS)
        np.testing.assert_array_equal(await a.call("echo", x), x)
        await a.write(h, x)
        np.testing.assert_array_equal(await a.read(h), x)
        with pytest.raises(tensorwire.HandleNotFound):
            await b.lookup("g")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", ["stream", "stream_with_receipts"])
async def test_a_stream_made_on_the_nodes_loop_refuses_to_be_read_on_another(verb: str) -> None:
    """A stream made on the node's loop and read from another loop ran there, on the peer's
    channel, unchecked; its first item read there sent the request from that loop, whose end
    (asyncio.run closing its async generators) then closed the stream: the node's own loop
    read nothing more, the other items lost without a word. Each read (and aclose) from
    another loop is now refused at once, and the stream goes on on its own loop."""
    async with connected_pair("tcp") as (a, b):

        @b.node.method("count")
        async def count(n: int) -> Any:
            for i in range(n):
                yield i

        def items(got: list[Any]) -> list[Any]:
            return [g[0] for g in got] if verb == "stream_with_receipts" else got

        fresh, begun = getattr(a, verb)("count", 3), getattr(a, verb)("count", 3)
        first = await anext(begun)
        errors = [
            await asyncio.to_thread(on_another_loop, make)
            for stream in (fresh, begun)
            for make in (lambda s=stream: anext(s), lambda s=stream: s.aclose())
        ]
        assert items([g async for g in fresh]) == [0, 1, 2]
        assert items([first, *[g async for g in begun]]) == [0, 1, 2]
        for err in errors:
            assert isinstance(err, tensorwire.ConfigurationError), err
            assert f"peer.{verb} was called on an event loop that is not the node's" in str(err), err


@pytest.mark.timeout(60)
async def test_registering_a_method_from_another_thread_is_refused_too() -> None:
    """README (Lifecycle): every method but abort() belongs to the node's loop and raises
    ConfigurationError at once elsewhere. node.method registered from a worker thread went
    through, into the registry the node's loop reads as it serves calls and ListMethods."""
    async with connected_pair("tcp") as (a, b):

        async def late(x: Any) -> Any:
            return x

        with pytest.raises(tensorwire.ConfigurationError, match=r"node\.method was called where no event loop runs"):
            await asyncio.to_thread(lambda: b.node.method("late")(late))
        err = await asyncio.to_thread(on_another_loop, lambda: _register_on(b.node, late))
        assert isinstance(err, tensorwire.ConfigurationError), err
        assert "node.method was called on an event loop that is not the node's" in str(err), err
        assert "late" not in b.node.methods
        b.node.method("late")(late)  # on its own loop, as ever
        assert await a.call("late", 3) == 3


async def _register_on(node: Any, fn: Any) -> None:
    node.method("late")(fn)


@pytest.mark.timeout(60)
async def test_registering_or_unregistering_through_node_methods_from_another_thread_is_refused() -> None:
    """``node.methods.register(fn, name)`` and ``unregister(name)``, the registry's own verbs
    under ``node.method``, went through from a worker thread or another loop unchecked (only
    ``node.method`` and ``node.methods.limits`` were): they changed the dict the node's loop
    serves calls and ListMethods from, off that loop."""
    async with connected_pair("tcp") as (a, b):

        async def late(x: Any) -> Any:
            return x

        async def kept(x: Any) -> Any:
            return x

        b.node.methods.register(kept, "kept")
        verbs: list[tuple[str, Callable[[], Any]]] = [
            ("node.methods.register", lambda: b.node.methods.register(late, "late")),
            ("node.methods.unregister", lambda: b.node.methods.unregister("kept")),
        ]
        for what, verb in verbs:
            with pytest.raises(tensorwire.ConfigurationError, match=rf"^{what} was called where no event loop runs"):
                await asyncio.to_thread(verb)

            async def on_theirs(verb: Callable[[], Any] = verb) -> None:
                verb()

            err = await asyncio.to_thread(on_another_loop, on_theirs)
            assert isinstance(err, tensorwire.ConfigurationError), err
            assert f"{what} was called on an event loop that is not the node's" in str(err), err
        assert "late" not in b.node.methods and "kept" in b.node.methods
        b.node.methods.register(late, "late")  # on its own loop, as ever
        b.node.methods.unregister("kept")
        assert await a.call("late", 3) == 3
        with pytest.raises(tensorwire.MethodNotFound):
            await a.call("kept", 3)


@pytest.mark.timeout(60)
async def test_setting_call_limits_from_another_thread_is_refused() -> None:
    """README (Lifecycle, Tensor RPC): ``node.methods.limits = CallLimits(...)`` belongs to the
    node's loop like every method but abort(). Set from a worker thread it went through: it
    resized the slots the loop admits calls by from that thread, waking a call waiting for a
    slot with a future set off its loop (under PYTHONASYNCIODEBUG a RuntimeError, outside the
    error tree, with the new limits half applied and the waiting call never let in; without
    it the loop took the wake-up only at its next timer, 1.0 s later here)."""
    async with connected_pair("tcp") as (a, b):
        gate, second = asyncio.Event(), asyncio.Event()

        async def hold(i: int) -> int:
            if i == 2:
                second.set()
            await gate.wait()
            return i

        b.node.method("hold")(hold)
        b.node.methods.limits = tensorwire.rpc.CallLimits(max_concurrent=1)
        calls = [asyncio.create_task(a.call("hold", i)) for i in (1, 2)]
        try:
            wider = tensorwire.rpc.CallLimits(max_concurrent=2)

            def set_limits() -> None:
                b.node.methods.limits = wider

            refused = r"node\.methods\.limits was set where no event loop runs"
            with pytest.raises(tensorwire.ConfigurationError, match=refused):
                await asyncio.to_thread(set_limits)

            async def set_on_another_loop() -> None:
                set_limits()

            err = await asyncio.to_thread(on_another_loop, set_on_another_loop)
            assert isinstance(err, tensorwire.ConfigurationError), err
            assert "node.methods.limits was set on an event loop that is not the node's" in str(err), err
            assert b.node.methods.limits.max_concurrent == 1
            assert not second.is_set()
            set_limits()  # on its own loop, as ever: the waiting call goes in
            async with asyncio.timeout(10):
                await second.wait()
        finally:
            gate.set()
        assert [await c for c in calls] == [1, 2]


@pytest.mark.timeout(60)
async def test_a_call_handed_to_the_nodes_loop_from_another_thread_works() -> None:
    """What the refusal tells users to do: ``asyncio.run_coroutine_threadsafe`` onto the node's
    loop, from a thread that runs a loop of its own or none."""
    async with connected_pair("tcp") as (a, b):
        home = asyncio.get_running_loop()
        x = np.arange(4, dtype=np.int64)

        def from_a_thread() -> Any:
            return asyncio.run_coroutine_threadsafe(a.send(x, tag="t"), home).result(10)

        async def from_another_loop() -> Any:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(a.send(x, tag="u"), home))

        receipt = await asyncio.to_thread(from_a_thread)
        assert receipt.nbytes == x.nbytes
        assert await asyncio.to_thread(on_another_loop, from_another_loop) is None
        np.testing.assert_array_equal(await b.recv(tag="t"), x)
        np.testing.assert_array_equal(await b.recv(tag="u"), x)


# A node and a peer left open on a loop closed by hand (``run_until_complete``, then
# ``close()``, no ``shutdown_asyncgens``), in a process of its own (gRPC keeps such a node, its
# ports bound, until the process exits): what their aclose() and abort() do later, from
# another loop, twice. Prints one JSON line.
_CLOSED_BY_HAND = r"""
import asyncio, json, sys
import numpy as np
import tensorwire

loop = asyncio.new_event_loop()
start = lambda: tensorwire.start("127.0.0.1:0", transports=(sys.argv[1],))
node = loop.run_until_complete(start())
other = loop.run_until_complete(start())
peer = loop.run_until_complete(other.connect(node.address))
loop.close()


def outcome(make):
    try:
        asyncio.run(asyncio.wait_for(make(), 10))
        return "ok"
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"


report = {}
for what, make in [("peer.aclose", peer.aclose), ("other.aclose", other.aclose), ("node.aclose", node.aclose)]:
    report[what] = [outcome(make), outcome(make)]
peer.abort()
node.abort()
report["send"] = outcome(lambda: peer.send(np.ones(3), tag="t"))
print(json.dumps(report), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.timeout(60)
def test_aclose_after_the_nodes_loop_was_closed_by_hand_is_no_runtime_error(transport: str) -> None:
    """Such a node holds its ports until the process exits (README, Lifecycle: its closing never
    ran), and its other methods are refused as closed; but aclose(), of the node or of a peer,
    raised asyncio's RuntimeError('Event loop is closed'), at every call, from outside the
    error tree (cancelling the lease task, or the lease watchdog, on that loop). Now it returns,
    as for an object closed already: it went with its loop."""
    proc = subprocess.run(
        [sys.executable, "-c", _CLOSED_BY_HAND, transport], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, f"the child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.splitlines()[-1])
    for what in ("peer.aclose", "other.aclose", "node.aclose"):
        assert report[what] == ["ok", "ok"], report
    refused = "ClosedResourceError: peer.send: the event loop this node was started on has closed"
    assert report["send"].startswith(refused), report
