"""Lifecycle of direct (rkey) handles over ucx: revocation reaching the end that holds the key.
Real UCX on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import connected_pair

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
    pytest.mark.timeout(20),
]


async def test_unexpose_revokes_the_handle_of_a_node_connected_to_itself() -> None:
    """Both ends of a node's connection to itself share one session id, and ``_sessions`` holds
    one of them: the revocation went through the reader's own end to the other, which marked
    and acknowledged a handle it never held. ``await unexpose`` returned, the memory was
    unregistered, and the reader still got and put through its old rkey (a use after free once
    the owner lets the tensor go)."""
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "sm,self"}) as node:
        p = await node.connect(node.address)
        x = np.arange(1000, dtype=np.int64)
        node.expose(x, name="x")
        h = await p.lookup("x")
        assert h.direct
        assert np.array_equal(await p.read(h), x)
        await node.unexpose("x")  # every holder of the key acknowledged: nothing reaches x now
        with pytest.raises(tensorwire.HandleNotFound):
            await p.read(h)
        with pytest.raises(tensorwire.HandleNotFound):
            await p.write(h, np.zeros_like(x))
        assert np.array_equal(x, np.arange(1000))
        await p.aclose()


async def test_a_revoked_key_leaves_its_channel() -> None:
    """The reader destroys a revoked handle's rkey when it acknowledges; the channel's set of
    keys (those it destroys when it closes) kept the closed key object all the same, one more
    for every generation a long-lived channel ever read (a name exposed again and again)."""
    async with connected_pair("ucx", ucx_options={"TLS": "sm,self"}) as (a, b):
        x = np.arange(10, dtype=np.int64)
        for _ in range(50):
            a.node.expose(x, name="x")
            h = await b.lookup("x")
            assert h.direct and np.array_equal(await b.read(h), x)
            await a.node.unexpose("x")
        keys = b.channel._rkeys  # type: ignore[attr-defined]
        assert len(keys) == 0, f"{len(keys)} closed rkeys still held by the channel"


_OWNER = """
import asyncio, gc, sys, time, numpy as np, tensorwire
async def main():
    async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}) as n:
        x = np.ones(512 << 20, np.uint8)
        n.expose(x, name="x")
        print(n.address, flush=True)
        p = await n.accept()
        await p.recv(tag="closing")
        if sys.argv[1] == "after-close":
            async with asyncio.timeout(10):
                while not p.closed:
                    await asyncio.sleep(0.001)
        await n.unexpose("x")  # no peer's operation reaches x from now on
        del x
        gc.collect()  # (512 MiB: numpy's memory goes back to the system, unmapped)
        reused = [np.full(64 << 20, 2, np.uint8) for _ in range(4)]
        await asyncio.sleep(1.5)
        print("alive", len(reused), flush=True)
asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _reading_from_an_owner(when: str) -> AsyncIterator[tuple[tensorwire.Peer, asyncio.Future[object], Any]]:
    """An owner child (``_OWNER``, unexposing ``when``) and this process's ucx peer of it, with a
    512 MiB get of its tensor under way (some of it landed): (peer, the read, the child). The
    child is killed on the way out if it is still running."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _OWNER, when, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    try:
        async with asyncio.timeout(15):
            address = (await child.stdout.readline()).decode().strip()
        async with tensorwire.start(transports=("ucx",), ucx_options={"TLS": "tcp"}) as node:
            peer = await node.connect(address)
            h = await peer.lookup("x")
            assert h.direct
            out = np.zeros(512 << 20, np.uint8)
            read = asyncio.ensure_future(peer.read(h, out=out))
            async with asyncio.timeout(10):
                while not out[0] and not read.done():  # noqa: ASYNC110 - the landing is the point
                    await asyncio.sleep(0)
            assert not read.done(), "the get ended before the reader closed"
            yield peer, read, child
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before-close", "after-close"])
async def test_an_owner_lets_go_of_an_unexposed_tensor_a_closed_readers_get_was_reading(when: str) -> None:
    """Over UCX's tcp lanes a get is served by the owner's worker, from the owner's memory. The
    reader closes (saying goodbye) while a large get is under way; the owner unexposes the
    tensor (before or after its channel to the reader shut), awaits it and frees the memory.
    The revocation took the reader's goodbye, or the session's end, for the end of its access,
    while the owner's worker went on answering the get from the tensor: the owner died of
    SIGSEGV (or sent the reader memory it had reused)."""
    async with _reading_from_an_owner(when) as (peer, read, child):
        await peer.send(None, tag="closing")
        await peer.aclose()
        await asyncio.gather(read, return_exceptions=True)
        assert child.stdout is not None
        async with asyncio.timeout(20):
            said = (await child.stdout.read()).decode()
            code = await child.wait()
    assert code == 0 and "alive" in said, f"the owner exited with {code} after it let the tensor go"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_an_owner_lets_go_of_an_unexposed_tensor_only_once_a_slow_closed_readers_get_was_answered() -> None:
    """As above, with a reader that takes the get's answer slowly (its loop stalls now and then)
    and stays up: the owner's endpoint close gave up on its flush after 1 s while UCX went on
    answering the get from the tensor, ``await unexpose`` returned, and the owner freed it and
    died of SIGSEGV as the reader took more. Now unexpose waits for UCX's close to end."""
    async with _reading_from_an_owner("after-close") as (peer, read, child):

        async def stall() -> None:
            while True:
                time.sleep(0.1)  # noqa: ASYNC251 - a slow reader is the point
                await asyncio.sleep(0.001)

        staller = asyncio.ensure_future(stall())
        try:
            await peer.send(None, tag="closing")
            await peer.aclose()
            assert child.stdout is not None
            async with asyncio.timeout(40):
                said = (await child.stdout.read()).decode()
                code = await child.wait()
        finally:
            staller.cancel()
        await asyncio.gather(read, staller, return_exceptions=True)
    assert code == 0 and "alive" in said, f"the owner exited with {code} after it let the tensor go"


_EXPOSER = """
import asyncio, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start(transports=("ucx",)) as n:
        x = np.arange(1000.0)
        n.expose(x, name="x")
        await n.connect(sys.argv[1])
        await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
async def test_a_lookup_on_a_killed_ucx_peer_is_peer_disconnected() -> None:
    """Over ucx a SIGKILLed peer's channel stays open until the lease runs out (UCX runs without
    its peer error handling), and its reads and sends already fail with PeerDisconnected. A
    lookup went to the dead node's control plane, was refused, and raised a bare
    ControlPlaneError ("cannot reach a tensorwire node"), as if the peer lived and only its
    control plane were unreachable."""
    async with tensorwire.start(transports=("ucx",)) as node:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", _EXPOSER, node.address)
        try:
            async with asyncio.timeout(15):
                peer = await node.accept()
            h = await peer.lookup("x")
            child.kill()
            await child.wait()
            assert not peer.closed  # the lease has not run out yet: the channel knows nothing
            with pytest.raises(tensorwire.PeerDisconnected):
                await peer.lookup("x")
            with pytest.raises(tensorwire.PeerDisconnected):
                await peer.read(h)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()


@pytest.mark.timeout(40)
async def test_an_emulated_read_under_way_when_its_owner_closes_ends_with_the_goodbye() -> None:
    """Over UCX's tcp lanes a get is served by the owner's worker. The owner's node closes while
    a large read from it is under way: it says goodbye (Leave), its BYE on the data connection
    waits behind the get's answer and is dropped with the endpoint, and its worker is destroyed,
    so the get never completes. The goodbye ended nothing over ucx: the read waited for the whole
    lease (here 20 s) and then its landing grace, and failed with "did not answer lease
    renewals". Now a read left unserved after the goodbye fails with it, within the grace."""
    options = {"transports": ("ucx",), "ucx_options": {"TLS": "tcp"}, "lease_seconds": 20.0}
    async with tensorwire.start(**options) as owner:  # type: ignore[arg-type]
        reader = await tensorwire.start(**options)  # type: ignore[arg-type]
        try:
            peer = await reader.connect(owner.address)
            await owner.accept()
            x = np.ones(512 << 20, np.uint8)
            owner.expose(x, name="x")
            h = await peer.lookup("x")
            assert h.direct and not peer.channel.one_sided_direct
            out = np.zeros(512 << 20, np.uint8)  # (pages never touched: the get lands slowest)
            read = asyncio.ensure_future(peer.read(h, out=out))
            await asyncio.sleep(0.1)
            if read.done():
                pytest.skip("the read ended before the owner closed")
            await owner.aclose()
            async with asyncio.timeout(10):  # half the lease
                got: object = (await asyncio.gather(read, return_exceptions=True))[0]
            assert isinstance(got, tensorwire.PeerDisconnected), repr(got)
            assert "lease" not in str(got), got
        finally:
            await reader.aclose()
