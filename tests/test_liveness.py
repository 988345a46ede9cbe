"""Liveness: a peer that stops answering is declared dead within the lease, never hangs."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import time
import weakref

import numpy as np
import pytest
from _polling import eventually

import tensorwire

pytestmark = pytest.mark.multiprocess

CLIENT = """
import asyncio, sys, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", lease_seconds=1.0) as node:
        peer = await node.connect(sys.argv[1])
        print("connected", flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, *args, stdout=asyncio.subprocess.PIPE)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.wait()


async def test_frozen_server_is_declared_dead_by_client() -> None:
    proc = await _spawn("-m", "tensorwire.cli", "serve", "--address", "127.0.0.1:0", "--transports", "tcp")
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        address = line.decode().split("serving at")[1].strip()
        async with tensorwire.start("127.0.0.1:0", lease_seconds=1.0) as node:
            peer = await node.connect(address)
            pending = asyncio.ensure_future(peer.recv(tag="never"))
            await asyncio.sleep(1.5)  # renewals succeed meanwhile
            assert not pending.done()
            os.kill(proc.pid, signal.SIGSTOP)  # sockets stay open: only the lease can tell
            t0 = time.monotonic()
            # a lookup the frozen node never answers is pending too: the lease's end closes the
            # control connection under it, which is the peer going away (it said
            # ClosedResourceError, 'closed by this side', while the recv said PeerDisconnected)
            looking = asyncio.ensure_future(peer.lookup("x"))
            with pytest.raises(tensorwire.PeerDisconnected, match="lease"):
                await asyncio.wait_for(pending, 10)
            detected = time.monotonic() - t0
            assert detected < 5.0, detected
            with pytest.raises(tensorwire.PeerDisconnected, match="lease"):
                await asyncio.wait_for(looking, 10)
            with pytest.raises(tensorwire.PeerDisconnected):
                await peer.send(np.arange(3))
    finally:
        await _stop(proc)


async def test_frozen_client_is_declared_dead_by_server() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=1.0) as node:
        proc = await _spawn("-c", CLIENT, node.address)
        try:
            peer = await asyncio.wait_for(node.accept(), 30)
            pending = asyncio.ensure_future(peer.recv(tag="never"))
            await asyncio.sleep(1.5)
            assert not pending.done(), "lease expired although the client renewed it"
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(tensorwire.PeerDisconnected, match="lease"):
                await asyncio.wait_for(pending, 10)
            assert time.monotonic() - t0 < 5.0
            assert node._leases == {}
        finally:
            await _stop(proc)


async def test_a_peer_declared_dead_is_let_go() -> None:
    """The lease watch kept its loop's last peer bound while it slept: a peer declared dead was
    kept, with its channel, its failure's traceback and what its sends held (a ucx hub's
    payloads to a peer that died), until another peer's lease came to be looked at."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=1.0) as node:
        proc = await _spawn("-c", CLIENT, node.address)
        try:
            peer = await asyncio.wait_for(node.accept(), 30)
            gone = weakref.ref(peer)
            os.kill(proc.pid, signal.SIGSTOP)
            with pytest.raises(tensorwire.PeerDisconnected, match="lease"):
                await asyncio.wait_for(peer.recv(tag="never"), 10)
            del peer
            await eventually(lambda: not node.peers and not node._leases)
            await asyncio.sleep(0.6)  # the watch has slept again since
            gc.collect()
            assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
        finally:
            await _stop(proc)


def _renewing(peer: tensorwire.Peer) -> bool:
    """The peer's lease renewal is a control call in flight (its coroutine waits in _unary)."""
    assert peer._renewals is not None
    coro: object = peer._renewals.task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None)
        if frame is not None and frame.f_code.co_name == "_unary":
            return True
        coro = getattr(coro, "cr_await", None)
    return False


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_a_stall_of_the_loop_both_ends_share_kills_no_session(transport: str) -> None:
    """Stalls of a node's own loop are not counted against its peers: two nodes in one process
    whose loop blocks for most of a lease (shorter than one) while a renewal is in flight stay
    connected. (The renewal's deadline passed during the stall, the server, on the same loop,
    could not answer, and the connecting side declared it dead.)"""
    lease = 1.0
    async with (
        tensorwire.start("127.0.0.1:0", transports=(transport,), lease_seconds=lease) as a,
        tensorwire.start("127.0.0.1:0", transports=(transport,), lease_seconds=lease) as b,
    ):
        peer = await a.connect(b.address)
        accepted = await b.accept()
        for _ in range(2):
            await eventually(lambda: _renewing(peer), seconds=10, pause=0)
            time.sleep(0.8 * lease)  # noqa: ASYNC251 - the stall under test: blocks the loop both nodes live on
            await asyncio.sleep(lease)
            assert not peer.closed, peer.channel.mailbox.failure
            assert not accepted.closed, accepted.channel.mailbox.failure
        await peer.send(np.arange(3), tag="after")
        assert np.array_equal(await accepted.recv(tag="after"), np.arange(3))


async def _serve_child() -> tuple[asyncio.subprocess.Process, str]:
    proc = await _spawn("-m", "tensorwire.cli", "serve", "--address", "127.0.0.1:0", "--transports", "tcp")
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc, line.decode().split("serving at")[1].strip()


async def test_sigkill_mid_gigabyte_transfer_then_restart() -> None:
    """Every pending op on the survivor fails promptly; other peers and a restarted peer work."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as bystander_node,
    ):
        bystander = await bystander_node.connect(node.address)
        bystander_remote = await node.accept()
        proc, address = await _serve_child()
        try:
            peer = await node.connect(address)
            payload = np.ones(1 << 30, np.uint8)
            pending = [
                asyncio.ensure_future(peer.send(payload, tag="big")),  # the child never receives it
                asyncio.ensure_future(peer.recv(tag="a")),
                asyncio.ensure_future(peer.recv(tag="b", out=np.empty(16))),
            ]
            await asyncio.sleep(0.3)
            proc.kill()
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
            detected = time.monotonic() - t0
            assert all(isinstance(r, tensorwire.PeerDisconnected) for r in results), results
            assert detected < 5.0, detected
            print(f"\nkilled peer detected in {detected * 1000:.1f} ms")
        finally:
            await _stop(proc)
        # the survivor keeps serving its other peer
        await bystander.send(np.arange(10), tag="still")
        assert np.array_equal(await bystander_remote.recv(tag="still"), np.arange(10))
        # and a restarted peer can be reached again
        proc, address = await _serve_child()
        try:
            again = await node.connect(address)
            r = await again.send(np.arange(1000), tag="hello")
            assert r.nbytes == 8000
        finally:
            await _stop(proc)


OWNER = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=(sys.argv[1],)) as node:
        big = np.ones(1 << 30, np.uint8)
        node.expose(big, name="big")
        target = np.ones(512 << 20, np.uint8)
        node.expose(target, name="target")

        @node.method("slow")
        async def slow():
            await asyncio.sleep(600)

        print(node.address, flush=True)
        peer = await node.accept()
        await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.mark.parametrize("transport", ["tcp"])
async def test_sigkill_fails_pending_reads_writes_sends_recvs_and_calls(transport: str) -> None:
    proc = await _spawn("-c", OWNER, transport)
    try:
        assert proc.stdout is not None
        address = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        async with tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
            peer = await node.connect(address)
            h = await peer.lookup("big")
            t = await peer.lookup("target")
            pending = [
                asyncio.ensure_future(peer.read(h)),  # 1 GiB: still moving when the owner dies
                asyncio.ensure_future(peer.write(t, np.zeros(512 << 20, np.uint8))),
                asyncio.ensure_future(peer.send(np.ones(256 << 20, np.uint8), tag="never-received")),
                asyncio.ensure_future(peer.recv(tag="never-sent")),
                asyncio.ensure_future(peer.call("slow")),
            ]
            await asyncio.sleep(0.05)
            proc.kill()
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
            detected = time.monotonic() - t0
            read, rest = results[0], results[1:]
            # our busy loop can stretch the sleep above until the read is done: then it must be whole
            assert isinstance(read, tensorwire.PeerDisconnected) or (
                isinstance(read, np.ndarray) and read.size == 1 << 30 and bool(read.all())
            ), read
            assert all(isinstance(r, tensorwire.PeerDisconnected) for r in rest), rest
            assert detected < 5.0, detected
    finally:
        await _stop(proc)
