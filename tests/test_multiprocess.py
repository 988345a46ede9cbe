"""Real processes on loopback: a served node in a child process, and the demo end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import numpy as np
import pytest

import tensorwire

pytestmark = pytest.mark.multiprocess


async def _spawn_server(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tensorwire.cli",
        "serve",
        "--address",
        "127.0.0.1:0",
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert b"serving at" in line, line
    return proc, line.decode().split("serving at")[1].strip()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.wait()


@pytest.fixture
async def echo_server() -> AsyncIterator[str]:
    proc, address = await _spawn_server("--echo", "0", "--echo", "big")
    try:
        yield address
    finally:
        await _stop(proc)


async def test_echo_across_processes(echo_server: str) -> None:
    rng = np.random.default_rng(0)
    async with tensorwire.start("127.0.0.1:0") as node:
        peer = await node.connect(echo_server)
        assert peer.path.transport in node.offers and peer.path.transport != "inproc"
        assert dict(peer.path.passed_over)["inproc"] == "peer is in another process"
        tree = {
            "a": rng.standard_normal((64, 33)).astype(np.float32),
            "nc": rng.standard_normal((50, 40))[::2, ::-3],
            "ints": [np.arange(7, dtype=np.uint64), (np.int8(-3), None)],
            "s": "hello",
            "f": 1.5,
        }
        await peer.send(tree)
        back = await peer.recv()
        assert np.array_equal(back["a"], tree["a"])
        assert np.array_equal(back["nc"], tree["nc"])
        assert np.array_equal(back["ints"][0], tree["ints"][0])
        assert back["s"] == "hello" and back["ints"][1][1] is None
        big = rng.integers(0, 255, size=48 << 20, dtype=np.uint8)
        out = np.empty_like(big)
        await peer.send(big, tag="big")
        await peer.recv(tag="big", out=out)
        assert np.array_equal(out, big)


async def test_child_killed_mid_transfer_fails_pending_ops() -> None:
    proc, address = await _spawn_server("--transports", "tcp")  # no echo: never receives
    try:
        async with tensorwire.start("127.0.0.1:0") as node:
            peer = await node.connect(address)
            send = asyncio.ensure_future(peer.send(np.ones(512 << 20, np.uint8), tag="x"))
            recv = asyncio.ensure_future(peer.recv(tag="y"))
            await asyncio.sleep(0.3)
            await _stop(proc)
            results = await asyncio.wait_for(asyncio.gather(send, recv, return_exceptions=True), 10)
            assert all(isinstance(r, tensorwire.PeerDisconnected) for r in results), results
            # the node keeps working for new peers
            async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as other:
                p2 = await other.connect(node.address)
                p1 = await node.accept()
                await p2.send(np.arange(3))
                assert np.array_equal(await p1.recv(), np.arange(3))
    finally:
        await _stop(proc)


async def test_token_across_processes() -> None:
    proc, address = await _spawn_server("--token", "abc", "--echo", "0")
    try:
        async with tensorwire.start("127.0.0.1:0") as node:
            with pytest.raises(tensorwire.AuthenticationError):
                await node.connect(address)
        async with tensorwire.start("127.0.0.1:0", auth_token="abc") as node:
            peer = await node.connect(address)
            await peer.send(np.arange(4))
            assert np.array_equal(await peer.recv(), np.arange(4))
    finally:
        await _stop(proc)


def test_demo_runs_and_verifies() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "demo", "--size-mib", "16", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every byte matches" in proc.stdout
    assert "path: " in proc.stdout
    assert "demo passed" in proc.stdout


def test_doctor_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "doctor", "--json"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["transports"]["tcp"]["usable"]
    pick = report["connect_to_another_process"]["transport"]
    assert pick != "inproc" and report["transports"][pick]["usable"]
    assert "memlock" in report
