"""Opt-in crc32c on staged-TCP frames: a corrupted frame is detected and never delivered."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import CHECKS, connected_pair


@pytest.mark.parametrize(
    "name", ["every_dtype", "out_receive", "large_message_rendezvous", "cancelled_recv_loses_nothing"]
)
async def test_conformance_with_checksums(name: str) -> None:
    async with connected_pair("tcp", check=name, checksum=True) as (a, b):
        assert a.channel.checksum and b.channel.checksum
        await CHECKS[name](a, b)


@contextlib.asynccontextmanager
async def corrupting_proxy(target: tuple[str, int], flip_at: int) -> AsyncIterator[int]:
    """A loopback TCP proxy that flips one bit of the client->server stream at byte ``flip_at``."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip: int | None) -> None:
        seen = 0
        try:
            while data := await reader.read(1 << 16):
                if flip is not None and seen <= flip < seen + len(data):
                    buf = bytearray(data)
                    buf[flip - seen] ^= 0x10
                    data = bytes(buf)
                seen += len(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(cr, sw, flip_at), pipe(sr, cw, None))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def _through_proxy(checksum: bool) -> tuple[object, np.ndarray]:
    x = np.arange(1 << 18, dtype=np.uint32)  # 1 MiB: eager, inline in the first frames
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=checksum) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=checksum) as client,
    ):
        host, port = server.offers["tcp"].address.decode().rsplit(":", 1)
        # HELLO is 184 bytes; flip a byte well inside the first message's payload
        async with corrupting_proxy((host, int(port)), flip_at=184 + 48 + 200 + 4096) as proxy_port:
            offer = server.offers["tcp"]
            server.offers["tcp"] = dataclasses.replace(offer, address=f"127.0.0.1:{proxy_port}".encode())
            a = await client.connect(server.address)
            b = await server.accept()
            await a.send(x, tag="v")
            try:
                got: object = await asyncio.wait_for(b.recv(tag="v"), 10)
            except tensorwire.TensorWireError as exc:
                got = exc
            await a.aclose()
    return got, x


async def test_corruption_is_silent_without_checksums() -> None:
    got, x = await _through_proxy(checksum=False)
    assert isinstance(got, np.ndarray)
    assert not np.array_equal(got, x), "the proxy did not corrupt anything: the test proves nothing"


async def test_corruption_is_detected_with_checksums() -> None:
    got, _ = await _through_proxy(checksum=True)
    assert isinstance(got, tensorwire.IntegrityError), got
    assert "crc32c" in str(got)


async def test_either_side_can_ask() -> None:
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=True) as a_node,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as b_node,
    ):
        a = await b_node.connect(a_node.address)
        b = await a_node.accept()
        assert a.channel.checksum and b.channel.checksum
        await a.send(np.ones(10))
        assert np.array_equal(await b.recv(), np.ones(10))
