"""Liveness: a peer that stops answering is declared dead within the lease, never hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np
import pytest

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
            with pytest.raises(tensorwire.PeerDisconnected, match="lease"):
                await asyncio.wait_for(pending, 10)
            detected = time.monotonic() - t0
            assert detected < 5.0, detected
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
