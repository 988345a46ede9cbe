"""The other node's goodbye (its ``Leave`` call as it closes) over verbs (inside the Soft-RoCE
guest): the sends waiting on it end then, as over tcp and ucx (tests/test_leases.py), but never
while it may be reading their memory with RDMA READ.

The guest is emulated (qemu TCG), so control-plane wall-clock limits are scaled (EMULATED).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire._leases import say_goodbye
from tensorwire.errors import PeerDisconnected
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits
from tensorwire.transports.verbs import VerbsChannel
from tensorwire.transports.verbs import _channel as verbs_channel

MiB = 1 << 20
EMULATED = {"lease_seconds": 30.0, "connect_timeout": 60.0, "goodbye_seconds": 5.0}
pytestmark = pytest.mark.timeout(180)


async def test_sends_waiting_for_the_receiver_end_at_its_goodbye() -> None:
    """A rendezvous send whose message the other node holds unread (its payload waits in our
    memory for a recv to RDMA-READ it), and a send waiting for a message slot, end when that
    node says goodbye, with the goodbye's PeerDisconnected: the first is asked back (ABORT) and
    fails once the node dropped it, the second fails at once. A send begun after it raises it
    too, a small inline one as well. They waited for the channel's close before (here the node
    says goodbye and keeps its channel open: until the test's end)."""
    # everything rendezvous (no credit), one message slot for the user's messages
    limits = Limits(recv_buffer_bytes=0, max_unexpected=1)
    async with connected_pair("verbs", limits=limits, **EMULATED) as (a, b):
        cb = b.channel
        assert isinstance(cb, VerbsChannel)
        big = asyncio.ensure_future(a.send(np.ones(MiB, np.uint8), tag="big"))  # takes the slot, waits for FIN
        await eventually(lambda: bool(cb._waiting), 30)  # (b holds it unread: no recv)
        slot = asyncio.ensure_future(a.send(np.ones(8, np.uint8), tag="small"))  # waits for a slot
        await asyncio.sleep(0.2)
        assert not big.done() and not slot.done()
        await say_goodbye(b.node, [b])  # (the Leave call a closing node makes; b stays open)
        await asyncio.wait([big, slot], timeout=20)
        for send in (big, slot):
            assert send.done(), "a send waiting on the peer outlived its goodbye"
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                send.result()
        assert not cb._waiting, "b still holds the message its sender gave up"
        for n in (MiB, 8):  # (rendezvous, and inline)
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                await asyncio.wait_for(a.send(np.ones(n, np.uint8), tag="later"), 20)


async def test_a_send_the_receiver_is_reading_at_its_goodbye_is_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rendezvous send whose payload the other node has begun to read when it says goodbye
    (its recv's RDMA READs are under way: held here before they are posted, while the fresh
    out= is faulted in) is not failed then, which would hand the caller back memory still
    being read: asked back, it waits for the FIN of the read, returns, and the recv has it."""
    held = threading.Event()
    fault_in = verbs_channel.fault_in

    def held_fault_in(arrays: list[np.ndarray]) -> None:
        held.wait(60)
        fault_in(arrays)

    monkeypatch.setattr(verbs_channel, "fault_in", held_fault_in)
    src = (np.arange(2 * MiB) % 251).astype(np.uint8)
    limits = Limits(recv_buffer_bytes=0)
    try:
        async with connected_pair("verbs", limits=limits, **EMULATED) as (a, b):
            cb = b.channel
            assert isinstance(cb, VerbsChannel)
            send = asyncio.ensure_future(a.send(src, tag="t"))
            out = np.empty_like(src)  # (fresh, not registered: faulted in by a worker first)
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            await eventually(lambda: bool(cb._incoming), 30)  # (its recv is reading it)
            await say_goodbye(b.node, [b])  # (b stays open)
            await eventually(lambda: a.channel.ended.done(), 20)
            await asyncio.sleep(0.2)  # (the ABORT reaches b, which is reading it: no answer yet)
            assert not send.done(), f"the send ended while its payload was being read: {send!r}"
            held.set()
            sent, got = await asyncio.wait_for(asyncio.gather(send, recv), 30)
            assert isinstance(sent, tensorwire.Receipt)
            assert got is out and np.array_equal(out, src)
    finally:
        held.set()
