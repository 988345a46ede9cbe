"""What a recv's receipt says of a message that a cancelled recv gave back: real nodes on
loopback, every transport here."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest
from _polling import eventually

from tensorwire import Peer
from tensorwire.metrics import snapshot
from tensorwire.testing import connected_pair
from tensorwire.testing._conformance import _counted, _labels

pytestmark = pytest.mark.timeout(60)
TRANSPORTS = ["tcp", "inproc"] + (["ucx"] if importlib.util.find_spec("ucxx") is not None else [])


async def _cancelled_once_landed(a: Peer, b: Peer, x: np.ndarray) -> asyncio.Future[Any] | None:
    """Post a recv into an out= of its own, send ``x``, and cancel the recv once the bytes have
    landed in its out=: the send, or None where the recv took its message before the cancel."""
    out = np.zeros_like(x)
    recv = asyncio.ensure_future(b.recv_with_receipt(tag="aside", out=out))
    await eventually(lambda: bool(b.channel.mailbox._posted), pause=0)
    send = asyncio.ensure_future(a.send(x, tag="aside"))
    await eventually(lambda: out[-1] == x[-1] or recv.done(), pause=0)  # (the bytes land in order)
    recv.cancel()
    try:
        await recv
    except asyncio.CancelledError:
        return send
    await send
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_message_a_cancelled_recv_had_landed_in_its_out_is_not_direct_at_the_next(transport: str) -> None:
    """A recv cancelled once its message had landed in its ``out=`` gives the message back: its
    bytes are copied out of that ``out=`` into a buffer of tensorwire's, which the next recv
    (without ``out=``) hands over. Every byte passed through that copy, so its receipt and its
    count in the metrics must not say ``direct``; they said direct, as for a message that
    landed straight in the buffer handed over."""
    x = (np.arange(1 << 20) % 251).astype(np.uint8)  # 1 MiB: no express delivery, nothing inline
    async with connected_pair(transport) as (a, b):
        for _ in range(20):  # until the cancel comes after the landing, before the recv takes it
            send = await _cancelled_once_landed(a, b, x)
            if send is not None:
                break
        else:
            pytest.fail("every recv took its message before its cancel")
        before = snapshot()
        got, receipt = await b.recv_with_receipt(tag="aside")
        counted = _counted(before, snapshot(), "recv")
        await send
    assert np.array_equal(got, x)
    assert not receipt.direct, receipt
    assert counted == {_labels(receipt, "messages"): (1, x.nbytes)}, counted
