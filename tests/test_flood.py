"""A node under attack on its data and control ports keeps serving honest peers, in bounded memory.

The target runs in a child process so that its peak RSS (VmHWM) is its own. Attackers send random
bytes, truncated headers, huge length claims and slow-loris connections; an honest peer keeps
exchanging verified 8 MiB tensors the whole time.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import sys
import time

import grpc
import numpy as np
import pytest

import tensorwire
from tensorwire.control import PROTOCOL_VERSION
from tensorwire.control._pb import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.multiprocess

FLOOD_SECONDS = 4.0
MAGIC = b"TWR1"


def _vmhwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(host, port)


async def _burst(host: str, port: int, data: bytes, stop: float) -> int:
    n = 0
    rng = np.random.default_rng(n)
    while time.monotonic() < stop:
        with contextlib.suppress(OSError):
            _, w = await _connect(host, port)
            w.write(data or rng.bytes(4096))
            with contextlib.suppress(OSError):
                await w.drain()
            w.close()
            n += 1
        await asyncio.sleep(0.005)
    return n


async def _slow_loris(host: str, port: int, stop: float) -> int:
    writers = []
    for _ in range(40):
        with contextlib.suppress(OSError):
            writers.append((await _connect(host, port))[1])
    while time.monotonic() < stop:
        for w in writers:
            with contextlib.suppress(OSError):
                w.write(b"\x00")
        await asyncio.sleep(0.2)
    for w in writers:
        w.close()
    return len(writers)


async def _handshake_spam(address: str, stop: float) -> int:
    n = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = control_pb2_grpc.ControlStub(ch)
        while time.monotonic() < stop:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Handshake(control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=2)
            n += 1
            await asyncio.sleep(0.01)
    return n


async def test_flood_leaves_honest_traffic_and_memory_intact() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tensorwire.cli",
        "serve",
        "--address",
        "127.0.0.1:0",
        "--echo",
        "0",
        "--transports",
        "tcp",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        address = line.decode().split("serving at")[1].strip()
        chost, cport = address.rsplit(":", 1)
        async with tensorwire.start("127.0.0.1:0") as node:
            peer = await node.connect(address)
            # learn the data port the way any client can: from a handshake
            async with grpc.aio.insecure_channel(address) as ch:
                req = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, node_id="attacker")
                req.offers.add(name="tcp", version=1, address=b"127.0.0.1:9")
                resp = await control_pb2_grpc.ControlStub(ch).Handshake(req, timeout=5)
            dhost, dport = resp.chosen.address.decode().rsplit(":", 1)
            stop = time.monotonic() + FLOOD_SECONDS
            huge = struct.pack("<4sBBHIQQqQI", MAGIC, 2, 0, 0, 2**31, 2**40, 1, 0, 0, 0)
            attacks = [
                _burst(dhost, int(dport), b"", stop),  # random bytes
                _burst(dhost, int(dport), huge, stop),  # huge length claims
                _burst(dhost, int(dport), MAGIC + b"\x02\x00", stop),  # truncated header
                _burst(dhost, int(dport), b"GET / HTTP/1.1\r\n\r\n", stop),  # wrong protocol
                _slow_loris(dhost, int(dport), stop),
                _burst(chost, int(cport), b"", stop),  # garbage at gRPC
                _slow_loris(chost, int(cport), stop),
                _handshake_spam(address, stop),
            ]
            attack_task = asyncio.gather(*attacks)
            rng = np.random.default_rng(1)
            honest = 0
            out = np.empty(8 << 20, np.uint8)
            while time.monotonic() < stop:
                x = rng.integers(0, 255, size=8 << 20, dtype=np.uint8)
                await asyncio.wait_for(peer.send(x), 10)
                await asyncio.wait_for(peer.recv(out=out), 10)
                assert np.array_equal(out, x), "an honest transfer was corrupted"
                honest += 1
            counts = await asyncio.wait_for(attack_task, 30)
            peak_mib = _vmhwm_kib(proc.pid) / 1024
            print(
                f"\nhonest 8 MiB round trips: {honest}; attack connections: {counts}; "
                f"target peak RSS {peak_mib:.0f} MiB"
            )
            assert honest >= 3
            assert proc.returncode is None, "the target node died"
            assert 0 < peak_mib < 768, f"target peak RSS {peak_mib:.0f} MiB"
            # and it still serves a newcomer
            async with tensorwire.start("127.0.0.1:0") as late:
                p = await late.connect(address)
                await p.send(np.arange(5))
                assert np.array_equal(await asyncio.wait_for(p.recv(), 10), np.arange(5))
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
