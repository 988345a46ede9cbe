"""Configuration is checked where it is given: a wrong node option, limit, address or call limit
is a ConfigurationError saying what is allowed, raised by start(), the constructor or connect(),
never a hang, a spinning watchdog or a foreign error later; the values at each bound work."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire import ConfigurationError, Limits
from tensorwire.rpc import CallLimits
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)

U32, U64 = 1 << 32, 1 << 64
MIN_CHUNK = 4096  # Limits.MIN_CHUNK_BYTES


# -- Limits -----------------------------------------------------------------------------------------
BAD_LIMITS = [
    ("recv_buffer_bytes", -1),
    ("recv_buffer_bytes", 1.5),
    ("recv_buffer_bytes", U64),
    ("recv_buffer_bytes", True),
    ("max_unexpected", 0),  # every send would wait for a slot forever
    ("max_unexpected", -1),
    ("max_unexpected", U32),  # a uint32 in the wire's limits record
    ("max_unexpected", "4"),
    ("max_message_bytes", -1),
    ("max_message_bytes", U64),
    ("max_message_bytes", 1e6),
    ("max_header_bytes", U32),
    ("max_header_bytes", U64),
    ("chunk_bytes", 0),  # ValueError from range() in every send
    ("chunk_bytes", -1),  # every send hung
    ("chunk_bytes", 1),  # a frame header per byte
    ("chunk_bytes", MIN_CHUNK - 1),
    ("chunk_bytes", 1.5),
    ("chunk_bytes", U64),
    ("inline_bytes", -1),
    ("inline_bytes", None),
    ("handshake_seconds", 0),  # every connect failed
    ("handshake_seconds", -1),
    ("handshake_seconds", math.nan),
    ("handshake_seconds", math.inf),
    ("handshake_seconds", "10"),
    ("handshake_seconds", False),
]


@pytest.mark.parametrize(("field", "value"), BAD_LIMITS, ids=[f"{f}={v!r}" for f, v in BAD_LIMITS])
def test_limits_reject(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Limits(**{field: value})


SMALLEST = {
    "recv_buffer_bytes": 0,  # valid: every message waits for its recv (rendezvous)
    "max_unexpected": 1,
    "max_header_bytes": Limits.MIN_HEADER_BYTES,
    "chunk_bytes": MIN_CHUNK,
    "inline_bytes": 0,
}


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_limits_at_their_bounds_work(transport: str) -> None:
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        Limits(chunk_bytes=MIN_CHUNK - 1)
    lim = Limits(**SMALLEST, handshake_seconds=5)  # type: ignore[arg-type]
    assert type(lim.handshake_seconds) is float
    big = Limits(max_unexpected=U32 - 1, max_header_bytes=U32 - 1, recv_buffer_bytes=U64 - 1)
    for limits in (lim, big):
        async with connected_pair(transport, limits=limits) as (a, b):
            for i in range(3):
                x = np.arange(100_000 + i, dtype=np.float32)  # many 4 KiB chunks
                recv = asyncio.ensure_future(b.recv(tag=i))
                await a.send(x, tag=i)
                assert np.array_equal(await recv, x)
                recv = asyncio.ensure_future(a.recv(tag=i))
                await b.send(x, tag=i)
                assert np.array_equal(await recv, x)


async def test_max_message_bytes_zero_allows_header_only_messages() -> None:
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        Limits(max_message_bytes=-1)
    async with connected_pair("tcp", limits=Limits(max_message_bytes=0)) as (a, b):
        await a.send({"s": "hello", "n": 3}, tag=1)
        assert await b.recv(tag=1) == {"s": "hello", "n": 3}
        with pytest.raises(tensorwire.TransferError, match="0-byte limit"):
            await a.send(np.ones(1), tag=1)


# -- CallLimits --------------------------------------------------------------------------------------
BAD_CALL_LIMITS = [
    ("max_concurrent", math.nan),  # every call hung
    ("max_concurrent", 1.5),
    ("max_concurrent", "4"),  # TypeError later
    ("max_concurrent", True),
    ("max_inflight_bytes", math.nan),
    ("max_inflight_bytes", math.inf),
    ("max_inflight_bytes", U64),  # reported in a uint64 field (GetMethods)
    ("max_inflight_bytes", "1"),
    ("max_arg_bytes", math.nan),
    ("max_arg_bytes", 1.0),
    ("max_arg_bytes", U64),
]


@pytest.mark.parametrize(("field", "value"), BAD_CALL_LIMITS, ids=[f"{f}={v!r}" for f, v in BAD_CALL_LIMITS])
def test_call_limits_reject(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        CallLimits(**{field: value})


async def test_call_limits_at_their_bounds_work() -> None:
    async with connected_pair("tcp") as (a, b):

        @b.node.method("add")
        async def add(x: int, y: int) -> int:
            return x + y

        with pytest.raises(ConfigurationError, match="max_arg_bytes"):
            b.node.method("nan", max_arg_bytes=math.nan)(add)
        with pytest.raises(ConfigurationError, match="max_concurrent"):
            CallLimits(max_concurrent=math.nan)
        b.node.methods.limits = CallLimits(max_concurrent=1, max_inflight_bytes=1, max_arg_bytes=0)
        assert await asyncio.gather(*[a.call("add", i, 1) for i in range(4)]) == [1, 2, 3, 4]
        b.node.methods.limits = CallLimits(max_concurrent=np.int64(2), max_inflight_bytes=U64 - 1)  # type: ignore[arg-type]
        assert type(b.node.methods.limits.max_concurrent) is int
        assert await a.call("add", 1, 1) == 2
