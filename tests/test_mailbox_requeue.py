"""A recv cancelled while it copies a buffered message into its out= gives the message back to
its tag's queue; until a later recv takes it, the message still sits in this side's buffer and
must still count against what the sender was granted (``Limits.recv_buffer_bytes``)."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire._peer import tag_id
from tensorwire.tensors._offload import OFF_LOOP_BYTES
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(90)

_N = 2 * OFF_LOOP_BYTES  # its copy into out= runs in a copy thread, and it fills the whole credit
_TRANSPORTS = [
    "tcp",
    "inproc",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
    ),
]


@pytest.mark.parametrize("transport", _TRANSPORTS)
async def test_a_message_given_back_by_a_recv_cancelled_mid_copy_still_holds_its_buffer_credit(
    transport: str,
) -> None:
    """An eager message that fills the receiver's whole buffer credit arrives before its recv; the
    recv (into out=) is cancelled after 0..11 loop turns, some of them while its copy into out=
    runs in a copy thread. Whenever the recv was cancelled, the message is still buffered here,
    so a second such message must not come eager on top of it: its send waits for a recv and goes
    rendezvous. Before, the message's slot and credit went back to the sender as the copy began,
    and stayed given when the cancelled recv requeued it: the second send went eager and both
    messages sat in the receiver's memory, twice the recv_buffer_bytes it grants."""
    limits = tensorwire.Limits(recv_buffer_bytes=_N)
    mid_copy = 0
    async with connected_pair(transport, limits=limits) as (a, b):
        mailbox = b.channel.mailbox
        tag = tag_id("t")
        for turns in range(12):
            x = np.full(_N, turns + 1, np.uint8)
            sent = await asyncio.wait_for(a.send(x, tag="t"), 10)
            assert sent.protocol == "eager", sent
            # the whole message waits here, buffered, before any recv is posted
            await eventually(lambda: (m := mailbox.oldest(tag)) is not None and m.done.done(), 10, 0)
            out = np.zeros(_N, np.uint8)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            for _ in range(turns):
                await asyncio.sleep(0)
            recv.cancel()
            try:
                await recv
            except asyncio.CancelledError:
                # the copy into out= ends before the cancel returns: all of it or none of it
                assert np.array_equal(out, x) or not out.any()
                mid_copy += bool(out.any())
                follow = asyncio.ensure_future(a.send(np.full(_N, 200, np.uint8), tag="t"))
                await asyncio.sleep(0.1)  # time for credit the receiver gave back to reach the sender
                assert not follow.done(), (
                    f"after {turns} turns: a second {_N}-byte message went eager while the first, given back "
                    "by its cancelled recv, still filled the receiver's buffer credit"
                )
                got = await asyncio.wait_for(b.recv(tag="t"), 10)
                assert np.array_equal(got, x)
                assert (await asyncio.wait_for(b.recv(tag="t"), 10) == 200).all()
                assert (await asyncio.wait_for(follow, 10)).protocol == "rendezvous"
            else:
                assert np.array_equal(out, x)
            # a frame from the receiver brings back the credit its recvs returned: the next
            # message goes eager again
            ping = asyncio.ensure_future(b.send(np.zeros(1, np.uint8), tag="ping"))
            await asyncio.wait_for(a.recv(tag="ping"), 10)
            await asyncio.wait_for(ping, 10)
    assert mid_copy, "no recv was cancelled during its copy into out=: the test proved nothing"
