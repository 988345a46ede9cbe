"""Out of memory on the receiving side: every allocation tensorwire makes on the caller's behalf
(a recv, a read or a call's result without out=, a message buffered before its recv, a staging
chunk) fails with an error of the tree, and what can be kept is kept.

The receiving side runs in a child process whose address space is capped (RLIMIT_AS) a little
above what it uses once connected, so a large allocation there really fails with MemoryError
while everything else goes on; the sending side is this process.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire.rpc import CallLimits
from tensorwire.rpc._server import server_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

_UCX = pytest.param(
    "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
)

BIG = 256 << 20  # past the default recv_buffer_bytes (64 MiB): rendezvous
EAGER = 48 << 20  # within it: buffered on arrival when no recv waits

# helpers of every child: cap the address space, report steps as JSON lines
_PRELUDE = """
import asyncio, json, resource, sys
import numpy as np
import tensorwire

def cap(headroom):
    size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))
    try:
        np.empty(headroom * 2, np.uint8)
    except MemoryError:
        return
    raise SystemExit("RLIMIT_AS did not cap allocations")

def report(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)

def digest(v):
    return int(np.asarray(v).sum(dtype=np.uint64))

def pattern(n):  # 0, 1, ..., 250, 0, 1, ... (np.resize repeats it: 1/50 of the CPU of arange % 251)
    return np.resize(np.arange(251, dtype=np.uint8), n)

async def attempt(step, coro, check=digest):
    try:
        v = await asyncio.wait_for(coro, 30)
    except Exception as exc:
        report(step, error=type(exc).__name__, tree=isinstance(exc, tensorwire.TensorWireError), text=str(exc))
    else:
        report(step, value=check(v))
"""


def _pattern(n: int) -> np.ndarray:
    """0, 1, ..., 250, 0, 1, ... (the children's ``pattern``): np.resize repeats the first 251,
    where ``(np.arange(n, dtype=np.uint32) % 251).astype(np.uint8)``, the same bytes, took 1 GiB
    and 2-5 CPU-seconds for each 256 MiB (a tenth of this file's CPU, in parent and children)."""
    return np.resize(np.arange(251, dtype=np.uint8), n)


@functools.cache
def _pattern_digest(n: int) -> int:
    """The children's ``digest`` of ``_pattern(n)``: what a recv of it whole reports."""
    return int(_pattern(n).sum(dtype=np.uint64))


async def _child(script: str, *args: str) -> asyncio.subprocess.Process:
    # one malloc arena: glibc reserves 64 MiB of address space for each thread's own arena when
    # that thread first allocates, and a native thread (OpenBLAS's, started by numpy's import)
    # that got round to it only after cap() measured took 64 MiB of the headroom (1 run in ~20
    # on a busy machine, with the staging pool's 64 MiB chunk refused)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PRELUDE + textwrap.dedent(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "MALLOC_ARENA_MAX": "1"},
    )


async def _steps(
    proc: asyncio.subprocess.Process, on_step: Callable[[str], None] | None = None
) -> AsyncIterator[dict[str, Any]]:
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            return
        step = json.loads(line)
        if on_step is not None:
            on_step(step["step"])
        yield step


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def _feed_when_capped(proc: asyncio.subprocess.Process, peer: Any, src: np.ndarray) -> dict[str, Any]:
    """Once the child says it capped its memory, send it ``src`` on "big" and a small message
    on "small"; its steps by name, up to "done"; then take its message on "back" and wait for
    both sends. Sends still going when this fails are cancelled (the caller kills the child)."""
    sends: list[asyncio.Task[Any]] = []

    def on_step(step: str) -> None:
        if step == "capped":
            sends.append(asyncio.ensure_future(peer.send(src, tag="big")))
            sends.append(asyncio.ensure_future(peer.send(np.arange(7), tag="small")))

    try:
        got = {}
        async for step in _steps(proc, on_step):
            got[step["step"]] = step
            if step["step"] == "done":
                break
        assert np.array_equal(await asyncio.wait_for(peer.recv(tag="back"), 10), np.arange(5))
        await asyncio.wait_for(asyncio.gather(*sends), 10)
        return got
    finally:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)


_RECEIVER = """
addr, transport, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])

async def main():
    out = np.zeros(nbytes, np.uint8)
    out2 = np.zeros(nbytes, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        peer = await node.connect(addr)
        h, h2 = await peer.lookup("big"), await peer.lookup("big2")
        await peer.call("big", _out=out)  # every path warmed up before the cap
        await peer.read_many([h, h2], outs=[out, out2])
        cap(nbytes // 2)
        report("capped")
        await attempt("recv", peer.recv(tag="big"))
        await attempt("recv_out", peer.recv(tag="big", out=out))
        await attempt("recv_small", peer.recv(tag="small"))
        await attempt("read", peer.read(h))
        await attempt("read_out", peer.read(h, out=out))
        await attempt("read_many", peer.read_many([h, h2]))
        await attempt("read_many_out", peer.read_many([h, h2], outs=[out, out2]), lambda v: digest(v[1]))
        await attempt("call", peer.call("big"))
        await attempt("call_out", peer.call("big", _out=out))
        await attempt("send", peer.send(np.arange(5), tag="back"), lambda r: 0)
        report("done")
        await asyncio.sleep(30)  # until the parent is done with us

asyncio.run(main())
"""


@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_no_memory_for_a_result_is_a_transfer_error_and_loses_nothing(transport: str) -> None:
    """recv, read, read_many and call without out= of more than the process can allocate raise
    TransferError (numpy's MemoryError before), and the message stays for a recv(out=).

    The failed call's result is taken back by the server (WITHDRAW) and the call ends at once.
    Before, the result stayed queued at the caller and its send waited for good for a go-ahead
    that never came, holding the call's slot (max_concurrent=1 here: call_out waited for it)
    and its 256 MiB at the server."""
    src = _pattern(BIG)
    want = _pattern_digest(len(src))
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        node.expose(src, name="big")
        node.expose(src, name="big2")
        node.methods.limits = CallLimits(max_concurrent=1)

        @node.method("big")
        async def big() -> np.ndarray:
            return src

        proc = await _child(_RECEIVER, node.address, transport, str(BIG))
        try:
            peer = await asyncio.wait_for(node.accept(), 30)
            got = await _feed_when_capped(proc, peer, src)
            server = server_of(peer)
            assert server is not None
            assert not server.calls, server.calls
            assert node.methods.slots.used == 0
        finally:
            await _kill(proc)
    for step in ("recv", "read", "read_many", "call"):
        assert got[step].get("error") == "TransferError", got[step]
        assert "out of memory" in got[step]["text"], got[step]
    for step in ("recv_out", "read_out", "read_many_out", "call_out"):
        assert got[step].get("value") == want, got[step]
    assert got["recv_small"].get("value") == 21, got["recv_small"]
    assert got["send"].get("value") == 0, got["send"]


_EAGER_RECEIVER = """
addr, transport, nbytes, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])

async def main():
    out = np.zeros(nbytes, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), **options) as node:
        peer = await node.connect(addr)
        await peer.send(np.arange(3), tag="hello")
        await peer.recv(tag="hello")
        cap(nbytes // 3)
        report("capped")
        await asyncio.sleep(1.0)  # the big message comes (eager) before any recv waits for it
        report("state", open=not peer.closed and peer.channel.state.name == "OPEN")
        await attempt("recv_out", peer.recv(tag="big", out=out))
        await attempt("recv_small", peer.recv(tag="small"))
        await attempt("send", peer.send(np.arange(5), tag="back"), lambda r: 0)
        report("done")
        await asyncio.sleep(30)

asyncio.run(main())
"""


async def eager_without_memory(transport: str, **options: Any) -> dict[str, Any]:
    """Send a 48 MiB message (eager) to a receiver that cannot allocate 48 MiB before any recv
    waits for it, then a small one; the receiver's steps, by name (the verbs guest runs this too)."""
    src = _pattern(EAGER)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), **options) as node:
        proc = await _child(_EAGER_RECEIVER, node.address, transport, str(EAGER), json.dumps(options))
        try:
            peer = await asyncio.wait_for(node.accept(), 60)
            await peer.recv(tag="hello")
            await peer.send(np.arange(3), tag="hello")
            got = await _feed_when_capped(proc, peer, src)
        finally:
            await _kill(proc)
    got["want"] = _pattern_digest(len(src))
    return got


def check_eager_without_memory(got: dict[str, Any], *, kept: bool) -> None:
    """The channel stayed open; the big message was dropped and its recv told (``kept`` False),
    or waited unread for the recv(out=) that got it whole; the small one and a send went on."""
    assert got["state"]["open"], got
    if kept:
        assert got["recv_out"].get("value") == got["want"], got["recv_out"]
    else:
        assert got["recv_out"].get("error") == "TransferError", got["recv_out"]
        assert "dropped" in got["recv_out"]["text"], got["recv_out"]
    assert got["recv_small"].get("value") == 21, got["recv_small"]
    assert got["send"].get("value") == 0, got["send"]


@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_an_eager_message_without_memory_for_it_leaves_the_channel_open(transport: str) -> None:
    """A 48 MiB message that arrives (eager) before its recv, when the receiver cannot allocate
    48 MiB: the tcp reader broke the channel with BrokenResourceError('tcp reader failed:
    MemoryError'), and the ucx control handler likewise, losing every message after it. Now tcp,
    which must take the bytes off the stream, drops that message alone (its recv raises a
    TransferError that says so), and ucx keeps it unposted until a recv(out=) pulls it (verbs
    too: tests/verbs/test_verbs_guest.py)."""
    check_eager_without_memory(await eager_without_memory(transport), kept=transport != "tcp")


_EAGER_CLOSER = """
addr, nbytes, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]

async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=30.0) as node:
        peer = await node.connect(addr)
        await peer.send(np.arange(3), tag="hello")
        await peer.recv(tag="hello")
        cap(nbytes // 3)
        report("capped")
        # the big message comes (eager) before any recv waits for it, and there is no memory
        # to receive it into: it is kept unposted, its payload held by UCX
        for _ in range(1000):
            kept = [a.nbytes for a, needs_cts in peer.channel._waiting.values() if not needs_cts]
            if kept:
                break
            await asyncio.sleep(0.01)
        report("kept", value=kept)
        if how == "close":
            await peer.aclose()
        else:
            peer.abort()
        report("closed")
        await asyncio.sleep(30)  # lives on, until the parent is done with us

asyncio.run(main())
"""


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
@pytest.mark.parametrize("how", ["close", "abort"])
async def test_an_eager_message_kept_unposted_for_want_of_memory_is_dropped_when_its_receiver_closes(
    how: str,
) -> None:
    """A 48 MiB message comes (eager: within the receiver's credit) before its recv, when the
    receiver cannot allocate 48 MiB: ucx keeps it unposted (``_adopt``), its payload held by
    UCX, for a recv(out=) to pull it. The receiver then closes its peer (or aborts it) and
    lives on. Its close (``_drop_unread``) receives the payload into scratch, so the sender's
    send ends at once with its receipt, as for a message buffered there and dropped unread,
    and the sender keeps nothing of it. Without that, no receive ever took the payload: the
    send ended only when the sender's channel shut, a second after the BYE, with
    PeerDisconnected saying the receiver 'may still read' its tensors (so it did after an
    abort until 2026-12-02: only a graceful close dropped it)."""
    src = _pattern(EAGER)
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=30.0) as node:
        proc = await _child(_EAGER_CLOSER, node.address, str(EAGER), how)
        send: asyncio.Future[Any] | None = None
        try:
            peer = await asyncio.wait_for(node.accept(), 60)
            await peer.recv(tag="hello")
            await peer.send(np.arange(3), tag="hello")
            got: dict[str, Any] = {}
            async for step in _steps(proc):
                got[step["step"]] = step
                if step["step"] == "capped":
                    send = asyncio.ensure_future(peer.send(src, tag="big"))
                elif step["step"] == "closed":
                    break
            assert got["kept"]["value"] == [EAGER], got  # (else this checks nothing)
            assert send is not None
            (result,) = await asyncio.gather(asyncio.wait_for(send, 10), return_exceptions=True)
            assert isinstance(result, tensorwire.Receipt), repr(result)
            assert (result.nbytes, result.protocol) == (EAGER, "eager")
            graveyard = node.transports["ucx"].worker._raw_graveyard  # type: ignore[attr-defined]
            assert not [keep for keep in graveyard.values() if keep is not None]
        finally:
            if send is not None:
                send.cancel()
                await asyncio.gather(send, return_exceptions=True)
            await _kill(proc)


_INPROC = """
nbytes = int(sys.argv[1])

async def main():
    src = pattern(nbytes)
    small = np.ones(48 << 20, np.uint8)
    out = np.zeros(nbytes, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=("inproc",)) as a, \\
            tensorwire.start("127.0.0.1:0", transports=("inproc",)) as b:
        p = await a.connect(b.address)
        q = await b.accept()
        cap(nbytes // 8)
        # eager (within the receiver's credit): the receiver cannot buffer it
        await attempt("send_eager", p.send(small, tag="e"), lambda r: r.protocol)
        await attempt("send_small", p.send(np.arange(7), tag="e"), lambda r: 0)
        await attempt("recv_small", q.recv(tag="e"))
        # rendezvous: recv without out= cannot allocate, the message waits for recv(out=)
        send = asyncio.ensure_future(p.send(src, tag="r"))
        await attempt("recv", q.recv(tag="r"))
        await attempt("recv_out", q.recv(tag="r", out=out))
        await attempt("send_big", send, lambda r: r.protocol)
        report("done")

asyncio.run(main())
"""


async def test_inproc_without_memory_for_a_message() -> None:
    """inproc buffers an eager message in the sender's send: its MemoryError came out of the
    sender's send while the message stayed announced to the receiver, so a recv of that tag
    hung for good. Now the send raises TransferError, nothing is delivered, and the tag goes on."""
    n = 256 << 20
    proc = await _child(_INPROC, str(n))
    try:
        got = {step["step"]: step async for step in _steps(proc)}
    finally:
        await _kill(proc)
    assert got["send_eager"].get("error") == "TransferError" and got["send_eager"]["tree"], got["send_eager"]
    assert got["send_small"].get("value") == 0, got["send_small"]
    assert got["recv_small"].get("value") == 21, got["recv_small"]
    assert got["recv"].get("error") == "TransferError", got["recv"]
    assert got["recv_out"].get("value") == _pattern_digest(n), got["recv_out"]
    assert got["send_big"].get("value") == "rendezvous", got["send_big"]
    assert "done" in got


_POOL = """
from tensorwire.memory._engine import HostEngine
from tensorwire.memory._pinned import PinnedPool

async def main():
    chunk = 64 << 20
    engine = HostEngine(poison=False)
    pool = PinnedPool(engine, chunk_bytes=chunk, depth=4)
    cap(chunk + chunk // 2)
    first = await pool.acquire()  # fits
    report("first", value=first.size)
    await attempt("grow", pool.try_acquire(), lambda c: None if c is None else c.size)
    waiter = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.05)
    report("waiting", value=not waiter.done())
    pool.release(first)
    await attempt("again", waiter, lambda c: c is first)
    engine.close()

asyncio.run(main())
"""


async def test_a_staging_pool_that_cannot_grow_makes_do_with_its_chunks() -> None:
    """A pipeline that holds a staging chunk asks for one more (try_acquire) when there is no
    memory for it: numpy's MemoryError (cudaHostAlloc's RegistrationError on a GPU) failed the
    transfer; now it goes on with the chunks it has, and a taker holding none waits for one."""
    proc = await _child(_POOL)
    try:
        got = {step["step"]: step async for step in _steps(proc)}
    finally:
        await _kill(proc)
    assert got["first"]["value"] == 64 << 20
    assert got["grow"] == {"step": "grow", "value": None}, got["grow"]
    assert got["waiting"]["value"] is True
    assert got["again"] == {"step": "again", "value": True}, got["again"]


async def test_default_limits_bound_what_a_peer_makes_us_buffer() -> None:
    """What a peer can make us allocate before any recv asks: the eager credit
    (recv_buffer_bytes, 64 MiB) in all; anything larger waits in the sender's memory until a
    recv takes it, and a message over max_message_bytes is refused at the sender with the
    channel still usable."""
    limits = tensorwire.Limits()
    assert limits.recv_buffer_bytes == 64 << 20
    small = tensorwire.Limits(max_message_bytes=1 << 20)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as a,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), limits=small) as b,
    ):
        p = await a.connect(b.address)
        q = await b.accept()
        with pytest.raises(tensorwire.MessageRefused):
            await p.send(np.zeros((1 << 20) + 1, np.uint8))
        await p.send(np.arange(3))
        assert np.array_equal(await asyncio.wait_for(q.recv(), 10), np.arange(3))


_EAGER_REPLY_CALLER = """
addr, transport, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
options, patience = json.loads(sys.argv[4]), float(sys.argv[5])

async def attempt(step, coro, check=digest):  # shorter than the prelude's: a held slot fails, not hangs
    try:
        v = await asyncio.wait_for(coro, patience)
    except Exception as exc:
        report(step, error=type(exc).__name__, tree=isinstance(exc, tensorwire.TensorWireError), text=str(exc))
    else:
        report(step, value=check(v))

async def main():
    out = np.zeros(nbytes, np.uint8)
    short = np.zeros(nbytes // 2, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), **options) as node:
        peer = await node.connect(addr)
        await peer.call("eager", _out=out)  # every path warmed up before the cap
        cap(nbytes // 3)
        report("capped")
        await attempt("call", peer.call("eager"))
        await attempt("call_short", peer.call("eager", _out=short))
        # gives up before the reply comes: the reply finds no recv and no memory
        await attempt("call_gone", peer.call("slow", _deadline=0.2))
        await asyncio.sleep(0.5)
        await attempt("call_out", peer.call("eager", _out=out))
        await attempt("ping", peer.call("ping"), lambda v: v)
        budget = _budgets[peer]
        for _ in range(250):  # what this side holds for its calls to the peer goes back too
            if not budget.calls:
                break
            await asyncio.sleep(0.02)
        report("outstanding", value=budget.calls)
        report("done")
        await asyncio.sleep(30)  # until the parent is done with us

from tensorwire.rpc._client import _budgets
asyncio.run(main())
"""


async def eager_reply_without_memory(transport: str, patience: float = 8.0, **options: Any) -> dict[str, Any]:
    """Calls whose 48 MiB (eager) result the caller, capped, cannot take, to a node that serves
    one call at a time; the caller's steps by name, and "want" (the verbs guest runs this too,
    with ``patience``: the seconds a call may take there)."""
    src = _pattern(EAGER)
    want = _pattern_digest(len(src))
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), **options) as node:
        node.methods.limits = CallLimits(max_concurrent=1)

        @node.method("eager")
        async def eager() -> np.ndarray:
            return src

        @node.method("slow")
        async def slow() -> np.ndarray:
            await asyncio.sleep(0.4)
            return src

        @node.method("ping")
        async def ping() -> int:
            return 1

        proc = await _child(
            _EAGER_REPLY_CALLER, node.address, transport, str(EAGER), json.dumps(options), str(patience)
        )
        try:
            peer = await asyncio.wait_for(node.accept(), 60)
            got: dict[str, Any] = {}
            async for step in _steps(proc):
                got[step["step"]] = step
                if step["step"] == "done":
                    break
            server = server_of(peer)
            assert server is not None
            await eventually(lambda: not server.calls and not node.methods.slots.used, 10)
        finally:
            await _kill(proc)
    got["want"] = want
    return got


def check_eager_reply_without_memory(got: dict[str, Any]) -> None:
    for step in ("call", "call_gone"):
        assert got[step].get("tree"), got[step]
    assert "out of memory" in got["call"]["text"], got["call"]
    assert got["call_gone"].get("error") == "DeadlineExceeded", got["call_gone"]
    assert got["call_short"].get("error") == "ShapeMismatchError", got["call_short"]
    assert got["call_out"].get("value") == got["want"], got["call_out"]
    assert got["ping"].get("value") == 1, got["ping"]
    assert got["outstanding"].get("value") == 0, got["outstanding"]


@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_an_eager_reply_without_memory_for_it_frees_the_servers_call(transport: str) -> None:
    """A result within the caller's eager credit (48 MiB) that the caller cannot take: no memory
    for it (no _out=), an _out= it does not fit, or a caller that gave up before it came. Each
    call fails with an error of the tree (ShapeMismatchError for the _out= that does not fit), and
    the server's call ends at once: max_concurrent=1 here, so the next call (call_out) and the
    ping after it get the slot. Over ucx the payload of such a reply, handed to UCX, waited at the
    caller unposted for a memory that never came, holding the server's call and its slot until
    the channel closed; now the caller drops it unread (UCX truncates its receive). Over tcp,
    which drops such a reply as it comes, the caller waited 60 s for another reply that would
    never come, holding its room for the call (outstanding), and the _out= that did not fit
    was told as a TransferError. Verbs kept it unread too (the FIN its sender waits for never
    came): now it answers as to an ABORT (tests/verbs/test_verbs_guest.py)."""
    check_eager_reply_without_memory(await eager_reply_without_memory(transport))


_BROADCAST_WRITER = """
addr, transport, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])

async def main():
    src = np.ones(nbytes, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        peer = await node.connect(addr)
        h = await peer.lookup("dst")
        await peer.write_many([h], [src])  # every path warmed up before the cap
        wide = np.broadcast_to(np.full(1, 7, np.uint8), (nbytes,))  # stride 0: packs to nbytes
        cap(nbytes // 4)
        report("capped")
        await attempt("write_many", peer.write_many([h], [wide]), lambda r: r.nbytes)
        await attempt("write", peer.write(h, wide), lambda r: r.nbytes)
        await attempt("write_src", peer.write(h, src), lambda r: r.nbytes)
        report("done")
        await asyncio.sleep(30)  # until the parent is done with us

asyncio.run(main())
"""


@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_a_write_of_a_view_too_large_to_pack_is_a_transfer_error(transport: str) -> None:
    """write_many (and write) of a broadcast view whose C-order copy the process cannot allocate:
    a one-sided write (ucx) packed it with np.ascontiguousarray, and numpy's MemoryError came
    out of write_many; now it is the TransferError an owner-assisted write (tcp) and a send
    raise for it, nothing was written, and the next write goes on."""
    n = EAGER
    dst = np.zeros(n, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        node.expose(dst, name="dst")
        proc = await _child(_BROADCAST_WRITER, node.address, transport, str(n))
        try:
            await asyncio.wait_for(node.accept(), 30)
            got = {}
            async for step in _steps(proc):
                got[step["step"]] = step
                if step["step"] == "done":
                    break
            assert np.all(dst == 1)  # the writes that failed wrote nothing
        finally:
            await _kill(proc)
    for step in ("write_many", "write"):
        assert got[step].get("error") == "TransferError", got[step]
        assert "out of memory" in got[step]["text"], got[step]
    assert got["write_src"].get("value") == n, got["write_src"]


_DEVICE_BUFFERED = """
from tensorwire._peer import tag_id
from tensorwire.memory import HostEngine
from tensorwire.tensors import EngineArray
from tensorwire.tensors._device import DeviceTensor
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits

nbytes, steps = int(sys.argv[1]), sys.argv[2].split(",")

def engine_of(device):
    engine = HostEngine(device=device, copy_delay=0.0002)
    engine.pool("out").configure(64 << 10, 3)
    engine.pool("in").configure(64 << 10, 3)
    return engine

async def main():
    engine, other = engine_of(0), engine_of(1)
    src = EngineArray(engine, pattern(nbytes))
    out, out2, there = (EngineArray(e, np.zeros(nbytes, np.uint8)) for e in (engine, engine, other))
    async with connected_pair("tcp", limits=Limits(recv_buffer_bytes=1 << 20)) as (a, b):
        for o in (out, there):  # every path warmed up before the cap (lanes, staging chunks)
            await asyncio.gather(a.send(src, tag="warm"), b.recv(tag="warm", out=o))
        mailbox, tid = b.channel.mailbox, tag_id("d")
        recv = asyncio.ensure_future(b.recv(tag="d", out=out))
        send = asyncio.ensure_future(a.send(src, tag="d"))
        # cancelled while the bytes land: the rest lands in a buffer of ours on that device
        while not any(m.tag == tid and max(m.landed or 0, m.written) > nbytes // 8 for m in mailbox._held):
            await asyncio.sleep(0)
        recv.cancel()
        await asyncio.gather(recv, return_exceptions=True)
        await send
        left = mailbox.oldest(tid)
        await asyncio.shield(left.done)
        report("left", value=[type(d).__name__ for d in left.dest])
        cap(nbytes // 3)
        report("capped")
        if "host" in steps:
            await attempt("recv", b.recv(tag="d"))
        if "other" in steps:
            await attempt("recv_other", b.recv(tag="d", out=there))
        await attempt("recv_out", b.recv(tag="d", out=out2), lambda v: digest(v.array))
        await attempt("send", asyncio.gather(a.send(np.arange(7), tag="s"), b.recv(tag="s")), lambda v: digest(v[1]))
    engine.close()
    other.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("steps", ["host", "other", "host,other"])
async def test_no_memory_for_a_message_left_in_device_memory_loses_nothing(steps: str) -> None:
    """A recv into device memory cancelled while the bytes land leaves the message in a buffer of
    ours on that device (a host engine stands in for CUDA). A recv without out= that cannot
    allocate its host result ("host"), or one into another device's memory that cannot allocate
    the host memory the bytes pass through ("other"), raises TransferError and the message stays
    for a recv with out=. Before, either recv took the message with it: it was lost, and the
    recv(out=) after it waited for good."""
    n = EAGER
    proc = await _child(_DEVICE_BUFFERED, str(n), steps)
    try:
        got = {step["step"]: step async for step in _steps(proc)}
    finally:
        await _kill(proc)
    assert got["left"]["value"] == ["DeviceTensor"], got["left"]
    for step in ("recv", "recv_other"):
        if step in got:
            assert got[step].get("error") == "TransferError", got[step]
            assert "out of memory" in got[step]["text"], got[step]
    assert got["recv_out"].get("value") == _pattern_digest(n), got["recv_out"]
    assert got["send"].get("value") == 21, got["send"]


# tensor RPC on a serving node that has no memory for what a call sends it (the child serves)
_SERVER = """
addr, nbytes, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]

async def main():
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        @node.method("size")
        async def size(x):
            return int(x.nbytes)

        @node.method("ping")
        async def ping():
            return 1

        peer = await node.connect(addr)
        await peer.send(np.arange(3), tag="hello")
        cap(nbytes // 3)
        report("capped")
        await asyncio.sleep(60)  # serving, until the parent is done with us

asyncio.run(main())
"""


async def _capped_server(node: Any, nbytes: int, transport: str = "tcp") -> tuple[asyncio.subprocess.Process, Any]:
    """A child serving "size" and "ping" to ``node``, its memory capped below ``nbytes`` / 3 more."""
    proc = await _child(_SERVER, node.address, str(nbytes), transport)
    try:
        peer = await asyncio.wait_for(node.accept(), 60)
        await asyncio.wait_for(peer.recv(tag="hello"), 30)
        steps = _steps(proc)
        assert (await anext(steps))["step"] == "capped"
        assert await peer.call("ping", _deadline=10) == 1
    except BaseException:
        await _kill(proc)
        raise
    return proc, peer


@pytest.mark.parametrize("transport", ["tcp", _UCX])
@pytest.mark.parametrize("nbytes", [BIG, EAGER], ids=["rendezvous", "eager"])
async def test_call_arguments_the_server_has_no_memory_for_fail_the_call_and_the_node_serves_on(
    nbytes: int, transport: str
) -> None:
    """A call whose arguments the serving node cannot allocate (tcp). Before: rendezvous
    arguments (256 MiB) failed their receive (TransferError, the message left queued for a recv
    with memory), and the server's ``_receive_args`` took them again at once, and again, for
    ever, never yielding to the event loop: the whole serving process froze (no call, lease
    renewal or close got through; the caller saw its lease run out). Eager arguments (48 MiB),
    dropped as they came, left the call waiting 60 s (ARGS_SECONDS) for arguments that would
    never come. Now the call fails at once, saying why, and the node serves the next call."""
    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        proc, peer = await _capped_server(node, nbytes, transport)
        try:
            big = np.zeros(nbytes, np.uint8)  # (calloc: pages of zeros, none of them resident)
            with pytest.raises(tensorwire.RemoteError) as info:
                async with asyncio.timeout(15):  # (the call's own deadline is longer: not what ends it)
                    await peer.call("size", big, _deadline=60)
            assert info.value.remote_type == "TransferError", info.value
            assert "could not be received here" in str(info.value) and "memory" in str(info.value), info.value
            assert await peer.call("ping", _deadline=10) == 1
            assert await peer.call("size", np.zeros(16, np.uint8), _deadline=10) == 16
        finally:
            await _kill(proc)


@pytest.mark.parametrize("transport", ["tcp", _UCX])
async def test_a_request_the_server_has_no_memory_for_is_dropped_and_the_node_serves_on(transport: str) -> None:
    """A message on the RPC request tag that the serving node cannot allocate (a broken or
    hostile peer's 256 MiB "request", rendezvous over tcp): its receive fails with the channel
    still open. Before, the request reader took that for the channel's end: it stopped reading
    this peer's requests for good (every later call waited unread until its deadline) and
    cancelled the peer's calls then running. Now the message is dropped (its bytes go nowhere,
    its sender's send completes), and the node serves the peer's next calls."""
    from tensorwire.rpc._protocol import REQUEST_TAG

    async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        proc, peer = await _capped_server(node, BIG, transport)
        bogus = asyncio.ensure_future(peer._send_own(np.zeros(BIG, np.uint8), tag=REQUEST_TAG))
        try:
            await asyncio.sleep(0.5)
            assert await peer.call("ping", _deadline=10) == 1
            await asyncio.wait_for(bogus, 10)  # let go there: nothing waits on it
        finally:
            bogus.cancel()
            await _kill(proc)


# a pipeline stage whose node has no memory for what the driver's call brings it (the child is
# the last stage; stage 0 and the driver are this process)
_LAST_STAGE = """
from tensorwire import pipeline
from tensorwire.transports import Limits

nbytes, slots = int(sys.argv[1]), int(sys.argv[2])

class Layer:
    def __init__(self):
        self.w = np.eye(4, dtype=np.float32)
    def forward(self, x):
        return x @ self.w, x
    def backward(self, ctx, grad):
        return grad @ self.w.T

def mse(y, target):
    d = y - target
    return float(np.mean(d * d)), 2 * d / d.size

async def main():
    limits = Limits(max_unexpected=slots)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), limits=limits) as node:
        async with pipeline.Stage(node, pipeline.FunctionPart(Layer(), loss=mse)) as stage:
            report("serving", address=node.address)
            while stage.prev is None:  # linked by the driver's connect
                await asyncio.sleep(0.01)
            cap(nbytes // 3)
            report("capped")
            await asyncio.sleep(120)  # serving, until the parent is done with us

asyncio.run(main())
"""


@pytest.mark.parametrize("call", ["evaluate", "step"])
async def test_a_stage_whose_node_has_no_memory_for_its_call_is_a_refusal_before_it_ran(call: str) -> None:
    """The last stage's node cannot allocate the targets a call brings it (256 MiB over tcp):
    its node fails the call before the stage runs it ("could not be received here"), as it
    refuses one past its CallLimits. docs/pipeline.md: the driver then cancels the other stages'
    calls at once and refuses this pipeline's later calls until the next Pipeline.connect.
    Before, that refusal came back as a plain RemoteError, which the driver took for the
    stage's own error: a step waited abort_grace (6 s) for stage 0, which waited for gradients
    that would never come; an evaluation's stage 0 finished and left its 4 activations
    unreceived on the link, holding the last stage's 4 message slots, and the next evaluation
    waited for good."""
    from _pipeline_fixtures import NumpyLinear, nodes

    from tensorwire import pipeline

    m = 4
    proc = await _child(_LAST_STAGE, str(BIG), str(m))
    try:
        steps = _steps(proc)
        serving = await anext(steps)
        rng = np.random.default_rng(0)
        async with nodes(2) as (first, driver), pipeline.Stage(first, NumpyLinear(rng, 4, 4, tanh=True)):
            async with await pipeline.Pipeline.connect(driver, [first.address, serving["address"]]) as pipe:
                assert (await anext(steps))["step"] == "capped"
                x = np.ones((2 * m, 4), np.float32)
                run = pipe.evaluate if call == "evaluate" else pipe.step
                big = np.zeros((2 * m, BIG // (8 * m)), np.float32)  # 256 MiB of targets (calloc)
                began = asyncio.get_running_loop().time()
                with pytest.raises(tensorwire.RemoteError) as info:
                    async with asyncio.timeout(30):
                        await run(x, big, microbatches=m, schedule="gpipe")
                took = asyncio.get_running_loop().time() - began
                assert info.value.remote_type == "TransferError", info.value
                assert "could not be received here" in str(info.value), info.value
                assert took < pipe.abort_grace, f"{took:.1f} s: the driver waited for stage 0"
                with pytest.raises(tensorwire.BrokenResourceError, match=r"until the next Pipeline\.connect"):
                    async with asyncio.timeout(15):
                        await run(x, np.zeros((2 * m, 4), np.float32), microbatches=m, schedule="gpipe")
    finally:
        await _kill(proc)


_STREAM_CALLER = """
from tensorwire.transports import Limits

addr, nbytes = sys.argv[1], int(sys.argv[2])

async def main():
    # room for several items to come eager (the stream's window grows as it is read)
    limits = Limits(recv_buffer_bytes=6 * nbytes)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), limits=limits) as node:
        peer = await node.connect(addr)
        got = 0
        try:
            async for x in peer.stream("gen", 40):
                got += 1
                if got == 4:  # the window is open: the next items come while this one is held
                    cap(nbytes // 3)
                    await asyncio.sleep(0.5)
        except tensorwire.TensorWireError as exc:
            report("stream", error=type(exc).__name__, got=got)
        mailbox = peer.channel.mailbox
        for _ in range(300):  # the drain takes what the call still gets, up to its terminal reply
            left = sum(len(q) for q in mailbox._arrived.values())
            if not left:
                break
            await asyncio.sleep(0.02)
        report("left", unread=left)
        report("ping", value=await peer.call("ping", _deadline=10))

asyncio.run(main())
"""


async def test_stream_items_dropped_for_want_of_memory_leave_nothing_unread() -> None:
    """A stream whose caller runs out of memory part way (tcp): items that come eager (48 MiB,
    several in flight) are dropped as they come, and the stream fails with TransferError. The
    drain its end starts took the next dropped item (TransferError) for the end of the drain
    and stopped: the items after it and the call's terminal reply (11 messages) stayed unread
    on the call's reply tag for good, each holding one of the caller's message slots. Now the
    drain goes on past dropped replies up to the terminal one, and nothing is left."""
    src = np.ones(EAGER, np.uint8)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:

        @node.method("gen")
        async def gen(n: int) -> AsyncIterator[np.ndarray]:
            for _ in range(n):
                yield src

        @node.method("ping")
        async def ping() -> int:
            return 1

        proc = await _child(_STREAM_CALLER, node.address, str(EAGER))
        try:
            got = {}
            async for step in _steps(proc):
                got[step["step"]] = step
                if step["step"] == "ping":
                    break
        finally:
            await _kill(proc)
    assert got["stream"]["error"] == "TransferError", got
    assert got["left"]["unread"] == 0, got
    assert got["ping"]["value"] == 1, got


_WITHDRAWN = """
from tensorwire._peer import tag_id
from tensorwire.testing import connected_pair
nbytes = int(sys.argv[1])

async def main():
    first = np.ones(nbytes, np.uint8)
    second = pattern(nbytes)
    out = np.zeros(nbytes, np.uint8)
    limits = tensorwire.Limits(recv_buffer_bytes=1 << 20, chunk_bytes=64 << 10)
    async with connected_pair("tcp", limits=limits) as (a, b):
        await a.send(np.arange(3), tag="warm")
        await b.recv(tag="warm")
        mailbox, tid, channel = b.channel.mailbox, tag_id("k"), b.channel
        cap(nbytes // 2)  # room for anything but a buffer of a message's size
        recv = asyncio.ensure_future(b.recv(tag="k", out=out))
        while not mailbox.has_posted(tid):
            await asyncio.sleep(0)
        send1 = asyncio.ensure_future(a.send(first, tag="k"))
        send2 = asyncio.ensure_future(a.send(second, tag="k"))
        # the first lands in out= (pulled), the second's header waits in the queue for its go-ahead
        while not (any(x.written for x in channel._incoming.values()) and mailbox._arrived.get(tid)):
            await asyncio.sleep(0)
        send1.cancel()  # withdrawn part way: the recv keeps its place, and takes the second
        try:
            got = await asyncio.wait_for(recv, 30)
        except Exception as exc:
            report("recv", error=type(exc).__name__, text=str(exc))
        else:
            step = 1 << 20  # (compared piece by piece: a whole comparison would allocate its size)
            equal = all(np.array_equal(out[i : i + step], second[i : i + step]) for i in range(0, nbytes, step))
            report("recv", same=got is out, equal=equal)
        await asyncio.gather(send1, return_exceptions=True)
        try:
            await asyncio.wait_for(send2, 10)
        except Exception as exc:
            report("send2", error=type(exc).__name__, text=str(exc))
        report("done")

asyncio.run(main())
"""


async def test_a_recv_whose_message_was_withdrawn_takes_the_next_rendezvous_one_into_its_out() -> None:
    """A recv(out=) whose message its sender withdrew part way keeps its place and takes the
    tag's next message, a rendezvous one whose header waited for its go-ahead (nothing of it had
    come): its payload lands straight in that recv's out=. Before, the recv took it as one given
    back by a cancelled recv and allocated a buffer of ours of the message's size to land it in
    (then copied it into out=, past Limits.recv_buffer_bytes); with no memory for that, it failed
    with "out of memory ... receive into a buffer of your own (out=)", though it had brought one."""
    proc = await _child(_WITHDRAWN, str(BIG))
    try:
        got = {step["step"]: step async for step in _steps(proc)}
    finally:
        await _kill(proc)
    assert got["recv"].get("same") and got["recv"].get("equal"), got["recv"]
    assert "send2" not in got, got["send2"]


_UNPULLED = """
from tensorwire._peer import tag_id
from tensorwire.testing import connected_pair
transport, nbytes, behind = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "behind"

async def main():
    src = pattern(nbytes)
    out, out2 = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    async with connected_pair(transport) as (a, b):
        await a.send(np.arange(3), tag="warm")
        await b.recv(tag="warm")
        mailbox, tid = b.channel.mailbox, tag_id("big")
        cap(nbytes // 2)  # room for anything but a buffer of the message's size
        recv = asyncio.ensure_future(b.recv(tag="big", out=out))
        while not mailbox.has_posted(tid):
            await asyncio.sleep(0)
        # "behind": a second recv(out=) waits behind it, and takes the message it gives back
        second = asyncio.ensure_future(b.recv(tag="big", out=out2)) if behind else None
        await asyncio.sleep(0)
        send = asyncio.ensure_future(a.send(src, tag="big"))
        while len(mailbox._posted.get(tid, ())) > behind:  # matched: its task has yet to run (and pull)
            await asyncio.sleep(0)
        recv.cancel()
        outcome = (await asyncio.gather(recv, return_exceptions=True))[0]
        report("cancelled", cancelled=isinstance(outcome, asyncio.CancelledError))
        mine = out2 if behind else out
        await attempt("recv", second or b.recv(tag="big", out=out), lambda v: [digest(v), v is mine])
        await attempt("send", send, lambda r: r.protocol)
        report("done")

asyncio.run(main())
"""


@pytest.mark.parametrize("next_recv", ["later", "behind"])
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_recv_cancelled_before_it_pulled_its_rendezvous_message_loses_nothing_without_memory(
    transport: str, next_recv: str
) -> None:
    """A recv(out=) cancelled after its rendezvous message matched it, before its task pulled
    it: no CTS went out (tcp) or nothing was copied (inproc), its sender still holds the bytes.
    Nothing needs keeping, and the next recv(out=), posted after the cancel ("later") or waiting
    behind it ("behind"), takes the message whole into its out=. Before, neither transport said
    such a message is ``unread``: the cancel allocated a buffer of the whole message's size to
    keep what had "landed" (nothing), and with no memory for that the message was dropped (the
    next recv raised "... dropped ... no memory here to keep them") while its sender's send
    returned a receipt; a recv waiting behind was handed it in a buffer of ours, not its out=
    (and failed "out of memory" though it brought its own memory)."""
    proc = await _child(_UNPULLED, transport, str(BIG), next_recv)
    try:
        got = {step["step"]: step async for step in _steps(proc)}
    finally:
        await _kill(proc)
    assert got["cancelled"]["cancelled"], "the recv completed before its cancel (the test missed its moment)"
    assert got["recv"].get("value") == [_pattern_digest(BIG), True], got["recv"]
    assert got["send"].get("value") == "rendezvous", got["send"]
    assert "done" in got
