"""Restarts and reconnects as a deployment sees them: a node process SIGKILLed and started again
at the same address (and node_id) while this side holds a Peer, pending operations and looked-up
handles. Every pending operation fails with PeerDisconnected, a new connect gives a working peer,
and nothing looked up from the old incarnation reaches the new one's memory."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import sys
import weakref
from collections.abc import AsyncIterator

import numpy as np
import pytest

import tensorwire
from tensorwire import HandleNotFound, PeerDisconnected

pytestmark = pytest.mark.multiprocess

_TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="needs ucxx")),
]


async def _child(address: str, node_id: str, transport: str, marker: float, lease: float) -> None:
    """The restartable node: exposes ``kv`` filled with ``marker``, serves ``echo`` and ``slow``."""
    async with tensorwire.start(address, node_id=node_id, transports=(transport,), lease_seconds=lease) as node:
        kv = np.full((4, 256), marker, np.float32)
        node.expose(kv, name="kv")

        @node.method("echo")
        async def echo(x: object) -> object:
            return x

        @node.method("slow")
        async def slow() -> None:
            await asyncio.sleep(3600)

        print("serving at", node.address, flush=True)
        await asyncio.Event().wait()


class _Incarnation:
    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc, self.address = proc, address

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


async def _start(address: str, node_id: str, transport: str, marker: float, lease: float = 1.0) -> _Incarnation:
    args = (address, node_id, transport, str(marker), str(lease))
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, *args, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert line.startswith(b"serving at "), line
    return _Incarnation(proc, line.split()[-1].decode())


@pytest.fixture
async def incarnations() -> AsyncIterator[list[_Incarnation]]:
    started: list[_Incarnation] = []
    yield started
    for inc in started:
        await inc.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_handle_from_an_earlier_incarnation_never_reaches_the_new_one(
    transport: str, incarnations: list[_Incarnation]
) -> None:
    """The node restarts at the same address with the same node_id and exposes ``kv`` again:
    same name, same generation (its counter starts over). A handle looked up from the old
    incarnation read the new process's memory and wrote into it (tcp: at once; ucx: once the
    name was looked up again on the new peer); now it is HandleNotFound, and the new handle works."""
    async with asyncio.timeout(50), tensorwire.start("127.0.0.1:0", transports=(transport,)) as node:
        incarnations.append(await _start("127.0.0.1:0", "stage-a", transport, 1.0))
        address = incarnations[0].address
        old_peer = await node.connect(address)
        old = await old_peer.lookup("kv")
        assert (await old_peer.read(old) == 1.0).all()
        pending = [
            asyncio.ensure_future(old_peer.recv(tag="never")),
            asyncio.ensure_future(old_peer.call("slow")),
        ]
        await asyncio.sleep(0.1)
        await incarnations[0].kill()
        incarnations.append(await _start(address, "stage-a", transport, 2.0))
        for op in pending:  # the transport's error (tcp) or the 1 s lease (ucx)
            with pytest.raises(PeerDisconnected):
                await op

        peer = await node.connect(address)
        assert peer.remote_node == old_peer.remote_node == "stage-a"
        assert await peer.call("echo", 7) == 7
        new = await peer.lookup("kv")
        assert (new.name, new.generation, new.shape) == (old.name, old.generation, old.shape)
        out = np.full((4, 256), -1.0, np.float32)
        attempts = [
            lambda: peer.read(old, out=out),
            lambda: peer.read(old[1:3]),
            lambda: peer.read_many([old[0]]),
            lambda: peer.write(old, np.full((4, 256), 9.0, np.float32)),
            lambda: peer.write_many([old[2]], [np.full(256, 9.0, np.float32)]),
        ]
        for attempt in attempts:
            with pytest.raises(HandleNotFound, match="another session"):
                await attempt()
        assert (out == -1.0).all()  # nothing of the new incarnation landed through the old handle
        assert (await peer.read(new) == 2.0).all()  # and nothing was written into it
        with pytest.raises(PeerDisconnected):
            await old_peer.read(old)
        await old_peer.aclose()
        await peer.aclose()


@pytest.mark.timeout(60)
async def test_a_handle_works_only_on_the_peer_that_looked_it_up() -> None:
    """Two Peer objects to one node: each has its own session, and a handle one looked up is
    refused by the other (it was served over tcp, and refused over ucx with another error)."""
    async with asyncio.timeout(30):
        async with tensorwire.start(transports=("tcp",)) as a, tensorwire.start(transports=("tcp",)) as b:
            b.expose(np.arange(8, dtype=np.int64), name="x")
            first, second = await a.connect(b.address), await a.connect(b.address)
            assert first.session is not None and second.session is not None
            assert first.session.id != second.session.id
            h = await first.lookup("x")
            with pytest.raises(HandleNotFound, match="another session"):
                await second.read(h)
            assert (await second.read(await second.lookup("x")) == np.arange(8)).all()
            await first.aclose()
            with pytest.raises(tensorwire.ClosedResourceError):
                await first.read(h)
            again = await a.connect(b.address)  # connect after the earlier peer was closed
            assert (await again.read(await again.lookup("x")) == np.arange(8)).all()


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="needs ucxx")
async def test_connect_to_a_restarted_node_is_not_refused_by_an_old_peers_backoff(
    incarnations: list[_Incarnation],
) -> None:
    """Over ucx the old Peer stays open until its lease (30 s here) ends, and its control channel
    keeps failing against the dead process (here: its lookups; renewals do the same). grpc shared
    that channel's connection, and its reconnect backoff, with every new channel to the address,
    so connect() to the node restarted there failed with a stale 'Connection refused' (for 1-2 s
    here, for up to the backoff, 2 minutes at most, in general). Now it connects at once."""
    async with asyncio.timeout(50), tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
        incarnations.append(await _start("127.0.0.1:0", "stage-c", "ucx", 1.0, lease=30.0))
        address = incarnations[0].address
        old_peer = await node.connect(address)
        await incarnations[0].kill()
        for _ in range(30):  # 3 s of the old peer's control calls failing: the backoff grows
            with pytest.raises(tensorwire.ControlPlaneError, match="cannot reach"):
                await old_peer.lookup("kv")
            await asyncio.sleep(0.1)
        incarnations.append(await _start(address, "stage-c", "ucx", 2.0, lease=30.0))
        peer = await node.connect(address)
        assert (await peer.read(await peer.lookup("kv")) == 2.0).all()
        await peer.aclose()
        await old_peer.aclose()


@pytest.mark.timeout(30)
async def test_a_called_peer_that_went_away_is_freed_without_aclose() -> None:
    """A server keeps no Peer (channel, mailbox, buffers) of a client that called it, or that it
    called, and then died; the user drops such peers (``async for peer in node``) unclosed."""
    async with asyncio.timeout(20):
        async with tensorwire.start(transports=("tcp",)) as a, tensorwire.start(transports=("tcp",)) as b:

            @b.method("echo")
            async def echo(x: int) -> int:
                return x

            gone = []
            for i in range(3):
                peer = await a.connect(b.address)
                assert await peer.call("echo", i) == i
                peer.abort()  # as a dead process's peer: its channel fails, nobody closes it
                gone.append(weakref.ref(peer))
                del peer
            await asyncio.sleep(0.2)
            gc.collect()
            assert [ref() for ref in gone] == [None, None, None]


async def _lookup_once_reached(peer: tensorwire.Peer, name: str) -> BaseException | None:
    """What a lookup raises once the node at the peer's address answers: the control channel
    may still be backing off from the dead process (ControlPlaneError: cannot reach ...)."""
    for _ in range(200):
        try:
            await peer.lookup(name)
        except tensorwire.ControlPlaneError as exc:
            if "cannot reach" not in str(exc):
                return exc
            await asyncio.sleep(0.05)
        except tensorwire.TensorWireError as exc:
            return exc
        else:
            return None
    raise AssertionError("the restarted node never answered the old peer's control channel")


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="needs ucxx")
async def test_a_lookup_the_restarted_node_cannot_know_is_peer_disconnected(
    incarnations: list[_Incarnation],
) -> None:
    """Over ucx a killed peer is noticed by the lease (30 s here), so until then the old Peer is
    open. A lookup through it that reaches the restarted node (which never had that session)
    raised AuthenticationError ('refused the handshake'); the session is gone, so it is
    PeerDisconnected, and the old peer is failed with it."""
    async with asyncio.timeout(50), tensorwire.start("127.0.0.1:0", transports=("ucx",)) as node:
        incarnations.append(await _start("127.0.0.1:0", "stage-b", "ucx", 1.0, lease=30.0))
        address = incarnations[0].address
        old_peer = await node.connect(address)
        await incarnations[0].kill()
        incarnations.append(await _start(address, "stage-b", "ucx", 2.0, lease=30.0))
        fresh = await node.connect(address)  # the restarted node answers
        error = await _lookup_once_reached(old_peer, "kv")
        assert isinstance(error, PeerDisconnected), error
        assert "no longer knows this session" in str(error)
        assert old_peer.closed
        assert (await fresh.read(await fresh.lookup("kv")) == 2.0).all()
        await old_peer.aclose()
        await fresh.aclose()


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])))
