"""Opt-in crc32c on staged-TCP frames: a corrupted frame is detected and never delivered."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
from collections.abc import AsyncIterator

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import CHECKS, connected_pair

_needs_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
)


@pytest.mark.parametrize(
    "name", ["every_dtype", "out_receive", "large_message_rendezvous", "cancelled_recv_loses_nothing"]
)
async def test_conformance_with_checksums(name: str) -> None:
    async with connected_pair("tcp", check=name, checksum=True) as (a, b):
        assert a.channel.checksum and b.channel.checksum
        await CHECKS[name](a, b)


@contextlib.asynccontextmanager
async def corrupting_proxy(target: tuple[str, int], flip_at: int) -> AsyncIterator[int]:
    """A loopback TCP proxy that flips one bit of the client->server stream at byte ``flip_at``;
    a negative ``flip_at`` is byte ``-flip_at - 1`` of the first MSG frame's header."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip: int | None) -> None:
        seen = 0
        try:
            while data := await reader.read(1 << 16):
                if flip is not None and flip < 0 and (at := data.find(b"TWR1\x04")) >= 0:
                    flip = seen + at - flip - 1
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


async def _through_proxy(
    checksum: bool, flip_at: int = 184 + 48 + 200 + 4096, n: int = 1 << 18, wait: float = 10
) -> tuple[object, np.ndarray]:
    """Send ``n`` uint32 through a proxy that flips a bit at ``flip_at`` (default: well inside
    the first message's payload; HELLO is 184 bytes, then the first frame's 48-byte header)."""
    x = np.arange(n, dtype=np.uint32)  # default 1 MiB: eager, inline in the first frames
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=checksum) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), checksum=checksum) as client,
    ):
        host, port = server.offers["tcp"].address.decode().rsplit(":", 1)
        async with corrupting_proxy((host, int(port)), flip_at=flip_at) as proxy_port:
            offer = server.offers["tcp"]
            server.offers["tcp"] = dataclasses.replace(offer, address=f"127.0.0.1:{proxy_port}".encode())
            a = await client.connect(server.address)
            b = await server.accept()
            await a.send(x, tag="v")
            try:
                got: object = await asyncio.wait_for(b.recv(tag="v"), wait)
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


async def test_a_corrupted_length_is_detected_at_its_header() -> None:
    """A flip in the first message's metadata length (+4096 bytes, under the header limit): the
    old code trusted it, read on into the bytes that never came, and the recv waited for good."""
    got, _ = await _through_proxy(checksum=True, flip_at=-(9 + 1), n=16, wait=5)
    assert isinstance(got, tensorwire.IntegrityError), got
    assert "frame header does not match its check" in str(got)


def test_every_single_bit_flip_of_a_header_is_caught() -> None:
    from tensorwire.transports._frames import FrameType, pack, unpack_fields

    for ftype, fields in [(FrameType.MSG, (0, 93, 64, 7, -3, 1 << 20, 5)), (FrameType.CREDIT, (0, 0, 0, 0, 0, 0, 0))]:
        raw = pack(ftype, *fields, checked=True)
        assert unpack_fields(raw, checked=True)[0] is ftype
        for bit in range(len(raw) * 8):
            bad = bytearray(raw)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(tensorwire.IntegrityError):
                unpack_fields(bad, checked=True)


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc", pytest.param("ucx", marks=_needs_ucx)])
async def test_a_path_without_checksums_says_so(transport: str, caplog: pytest.LogCaptureFixture) -> None:
    """checksum=True on nodes that prefer ucx (the default order): their peers opened over ucx,
    whose payloads carry no crc32c, and nothing said so. Each node now warns, once per such
    transport; over tcp (checksummed) and inproc (no wire) nothing is said."""
    caplog.set_level("WARNING", logger="tensorwire")
    options = {"transports": (transport,), "checksum": True}
    async with tensorwire.start("127.0.0.1:0", **options) as a, tensorwire.start("127.0.0.1:0", **options) as b:
        for _ in range(2):
            peer = await a.connect(b.address)
            await asyncio.wait_for(b.accept(), 10)
            assert peer.path.transport == transport
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checksum=True, but")]
    if transport == "ucx":
        assert len(said) == 2, said  # each node, once
        assert all("ucx does not checksum payloads" in line and "carry no crc32c" in line for line in said), said
    else:
        assert said == [], said
