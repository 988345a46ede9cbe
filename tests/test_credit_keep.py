"""Credit head-of-line blocking over tcp and ucx: a large message the receiver has not taken yet must
not use up the whole buffer credit, or a small message sent beside it goes rendezvous and waits
for its receiver (a ping behind back-to-back 64 MiB sends took ~8 ms instead of ~0.3 ms)."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import connected_pair
from tensorwire.transports._credit import SendWindow
from tensorwire.transports._frames import PeerLimits

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20

_TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
    ),
]


@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_small_message_goes_eager_beside_an_unreceived_message_the_size_of_the_credit(
    transport: str,
) -> None:
    """A message as large as the credit waits for its recv (rendezvous) instead of taking all of
    it eager; a small one on another tag, with no recv posted either, then still goes eager:
    its send returns before anything is received."""
    async with connected_pair(transport, limits=tensorwire.Limits(recv_buffer_bytes=MiB)) as (a, b):
        big = np.arange(MiB, dtype=np.uint8)
        bulk = asyncio.ensure_future(a.send(big, tag="bulk"))  # nobody receives it yet
        await asyncio.sleep(0.05)
        small = await asyncio.wait_for(a.send(np.ones(8), tag="ping"), 5)
        assert small.protocol in ("eager", "inline")  # (ucx names a payload in its frame inline)
        assert not bulk.done()  # rendezvous: it waits for its recv
        np.testing.assert_array_equal(await asyncio.wait_for(b.recv(tag="ping"), 5), np.ones(8))
        got = await asyncio.wait_for(b.recv(tag="bulk"), 5)
        assert (await asyncio.wait_for(bulk, 5)).protocol == "rendezvous"
        np.testing.assert_array_equal(got, big)


def test_the_kept_credit_is_for_small_messages_only() -> None:
    """An eighth of the grant is kept: larger messages leave it, small ones may take it all."""
    remote = PeerLimits(recv_buffer_bytes=64 * MiB, max_unexpected=16, max_message_bytes=1 << 40, max_header_bytes=MiB)
    w = SendWindow(remote, keep_for_small=True)
    assert (w.keep, w.small) == (8 * MiB, 512 << 10)
    assert not w.reserve(64 * MiB) and not w.reserve(56 * MiB + 1)
    assert w.reserve(56 * MiB) and w.credit == 8 * MiB
    assert not w.reserve(1 * MiB)  # not small: the kept bytes are not for it
    assert all(w.reserve(512 << 10) for _ in range(16)) and w.credit == 0
    plain = SendWindow(remote)  # without keep_for_small: the whole credit for any message
    assert plain.reserve(64 * MiB)
