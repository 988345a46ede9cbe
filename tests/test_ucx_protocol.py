"""The ucx channel against a peer that breaks its protocol or goes mid-transfer: control frames
cut short, frames UCX refuses, a BYE taken in a burst or while transfers still land, DATA tags
that wrap, payloads shorter than their headers say."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import connected_pair

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
    pytest.mark.timeout(30),
]


async def _outcome(aw: Any) -> object:
    async with asyncio.timeout(5):
        (got,) = await asyncio.gather(aw, return_exceptions=True)
    return got


@pytest.mark.parametrize("cut", [0, 1, 20, 47, 48, 60])
async def test_a_control_frame_shorter_than_its_own_lengths_breaks_the_channel(cut: int) -> None:
    """A control frame is one UCX message, and the receiver decoded what its fields declare
    (the frame header, meta_len + payload_len more bytes) from its control buffer, whatever
    number of bytes UCX actually received into it: the rest was what the previous frame had
    left there. A peer's frame cut short (here: the bytes of a good inline MSG, cut) was
    taken for the previous message once more, which a recv returned a second time (or for a
    mix of the new header and the old bytes). It must break the channel with a
    ProtocolError instead, and deliver nothing."""
    src = (np.arange(256) % 251 + 1).astype(np.uint8)
    async with connected_pair("ucx") as (a, b):
        ch = a.channel
        sent: list[bytes] = []
        real = ch._send_frame

        def keep(frame: Any) -> None:
            sent.append(bytes(frame))
            real(frame)

        ch._send_frame = keep
        try:
            await a.send(src, tag="x")
        finally:
            ch._send_frame = real
        assert np.array_equal(await b.recv(tag="x"), src)
        (frame,) = sent  # the inline MSG: frame header, message header, the 256 bytes
        waiting = asyncio.ensure_future(b.recv(tag="x"))
        await asyncio.sleep(0.01)
        ch._send_frame(frame[:cut])
        got = await _outcome(waiting)
        assert isinstance(got, tensorwire.ProtocolError), f"a frame of {cut} of {len(frame)} bytes gave {got!r}"
        assert b.channel.state is tensorwire.transports.ChannelState.BROKEN


_CONNECT_AND_WAIT = r"""
import asyncio, sys, numpy as np, tensorwire
async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("ucx",)) as n:
        p = await n.connect(sys.argv[1])
        await p.send(np.arange(3), tag="ready")
        await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("nbytes", [1024, 60 * 1024])
async def test_an_inline_send_whose_frame_ucx_refuses_raises_instead_of_returning_a_receipt(nbytes: int) -> None:
    """A peer SIGKILLed after its connect: the first frame bigger than UCX's eager-short size
    makes UCX attach the peer's shared memory, which went with its process, and
    ``ucp_tag_send_nbx`` fails at once (Shared memory error). For a message that rides inline
    (its bytes in the MSG frame) the channel broke on that, but the send returned a receipt
    (``protocol="inline"``) for a message that never left this process; only the next send
    raised. The send whose frame UCX refused must raise PeerDisconnected."""
    import sys

    async with tensorwire.start("127.0.0.1:0", transports=("ucx",), lease_seconds=60) as hub:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CONNECT_AND_WAIT, hub.address)
        try:
            peer = await hub.accept()
            async with asyncio.timeout(20):
                await peer.recv(tag="ready")
        finally:
            child.kill()
            await child.wait()
        got = await _outcome(peer.send(np.full(nbytes, 3, np.uint8), tag="x"))
        assert isinstance(got, tensorwire.PeerDisconnected), f"the send to a dead peer gave {got!r}"


@pytest.mark.parametrize("out", [False, True], ids=["new-array", "out"])
async def test_a_payload_shorter_than_its_header_says_is_not_delivered(out: bool) -> None:
    """An eager message whose header announces a 100 000-byte tensor, and whose payload (one UCX
    message on the message's DATA tag) carries 10 bytes: UCX completes the receive with those
    10 bytes and says nothing (only a longer one is truncated, an error). The recv returned
    the tensor whole, its other 99 990 bytes whatever the buffer held (an np.empty of ours:
    memory of this process's; or the caller's out= as it was). It must fail with a
    ProtocolError and break the channel, as a bad control frame does, not deliver the message."""
    from tensorwire._peer import tag_id
    from tensorwire.tensors import prepare
    from tensorwire.transports._frames import FrameType
    from tensorwire.transports.ucx._channel import DATA, _array, make_tag

    n = 100_000
    async with connected_pair("ucx") as (a, b):
        ch = a.channel
        msg = prepare(np.zeros(n, np.uint8))
        dest = np.full(n, 7, np.uint8) if out else None
        waiting = asyncio.ensure_future(b.recv(tag="x", out=dest))
        await asyncio.sleep(0.01)
        msg_id = ch._next_id
        ch._next_id += 1
        assert ch._window.reserve(n)
        ch._window.slots -= 1
        ch._send_frame(ch._frame(FrameType.MSG, meta_len=len(msg.header), msg_id=msg_id, arg=tag_id("x")) + msg.header)
        short = np.ones(10, np.uint8)
        buf = _array()(short)
        req = ch._ucp.tag_send_at(ch._ep_handle, buf.ptr, buf.nbytes, make_tag(ch._tx_key, DATA, msg_id))
        if req is not None:
            await ch._w.watch_raw(ch._ucp, req, short, owner=ch, what="test send")
        got = await _outcome(waiting)
        assert isinstance(got, tensorwire.TensorWireError), (
            f"a 10-byte payload of a {n}-byte message was delivered: "
            f"{np.count_nonzero(np.asarray(got) == 1)} bytes of ones, the rest {np.unique(np.asarray(got)[10:])[:8]}"
        )
        assert isinstance(got, tensorwire.ProtocolError), f"a short payload gave {got!r}"
        assert b.channel.state is tensorwire.transports.ChannelState.BROKEN


async def test_a_channel_shut_by_a_bye_taken_in_a_burst_leaves_no_control_receive_behind() -> None:
    """A peer sends a message and closes at once: its MSG matches the posted control receive,
    and its BYE waits in UCX, so the receiver takes it in the burst loop of ``_post_ctrl_recv``.
    The BYE shut the channel there, yet the loop went on and posted another control receive,
    which the worker kept (with the closed channel, its control buffer and mailbox, through the
    callback) until the node closed: one per peer that came and went like this. None may be
    left: the worker's raw receives are those of channels still open."""
    import gc
    import weakref

    async with connected_pair("ucx") as (a, b):
        ch = b.channel
        w = ch._w
        await a.send(np.arange(3), tag="x")
        await a.channel.aclose()
        async with asyncio.timeout(5):
            while ch.state is tensorwire.transports.ChannelState.OPEN:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        left = [x for x in w._raw_recv.values() if x.owner is ch]
        assert not left, f"{len(left)} control receive(s) of the closed channel still posted"
        gone = weakref.ref(ch)
        del ch, left
        assert np.array_equal(await b.recv(tag="x"), np.arange(3))  # (delivered before the BYE)
        gc.collect()
        assert gone() is None or not any(x.owner is gone() for x in w._raw_recv.values())


@pytest.mark.parametrize("tls", ["sm,self", "tcp"])
async def test_a_send_begun_after_the_peers_bye_raises_while_transfers_in_flight_finish(tls: str) -> None:
    """The peer closes its channel (BYE) while a 64 MiB send of ours is still moving: the
    channel stays open until the transfers in flight end (``_shut_when_landed``, up to
    ``BYE_GRACE``). A small send begun then went inline and returned a receipt, though the
    peer takes no message any more: lost, the send saying it was sent (5 of 5 runs, sm and
    tcp). It must raise PeerDisconnected, as a send does once the peer says goodbye over the
    control plane (``_ending``); the send in flight still ends as it would have."""
    limits = tensorwire.Limits(recv_buffer_bytes=256 << 20)
    async with connected_pair("ucx", limits=limits, ucx_options={"TLS": tls}) as (a, b):
        big = asyncio.ensure_future(b.send(np.ones(64 << 20, np.uint8), tag="big"))
        for _ in range(3):
            await asyncio.sleep(0)  # (its MSG frame and payload are posted)
        await a.channel.aclose()
        async with asyncio.timeout(5):
            while not b.channel._peer_said_bye:  # noqa: ASYNC110
                await asyncio.sleep(0)
        if b.channel.state is not tensorwire.transports.ChannelState.OPEN:
            pytest.skip("the big send ended before the goodbye came: nothing was in flight")
        got = await _outcome(b.send(np.arange(10), tag="small"))
        assert isinstance(got, tensorwire.PeerDisconnected), f"a send after the peer's goodbye gave {got!r}"
        await _outcome(big)


async def test_message_ids_that_wrap_the_28_bit_data_tag_do_not_swap_payloads() -> None:
    """A payload travels on a DATA tag whose sequence is the message id's low 28 bits
    (``make_tag``), so message ``X`` and message ``X + 2**28`` share one: a rendezvous message
    that waits to be received (for as long as its tag is not read) while 2**28 others go meets
    its namesake. (Here the ids jump, as 268 million messages would move them.) The receiver
    pulls the first (its receive posted, CTS on the way), the second comes eager and its
    payload goes at once: UCX matches it to the first's receive, posted earlier with the same
    tag. The first message was delivered with the second's bytes (and the rest of its buffer
    as it was), the second's receive then took the first's payload, truncated: the channel
    broke. Each must arrive intact."""
    from tensorwire.transports.ucx._channel import _SEQ

    limits = tensorwire.Limits(recv_buffer_bytes=1 << 20)
    first = np.full(2 << 20, 1, np.uint8)  # beyond the credit: rendezvous
    second = np.full(512 << 10, 2, np.uint8)  # eager
    async with connected_pair("ucx", limits=limits) as (a, b):
        slow = asyncio.ensure_future(a.send(first, tag="slow"))
        async with asyncio.timeout(5):
            while not a.channel._cts:  # noqa: ASYNC110 - its MSG is out, CTS awaited
                await asyncio.sleep(0)
        (waiting,) = a.channel._cts
        a.channel._next_id = waiting + _SEQ + 1  # (2**28 messages later)
        got_first = asyncio.ensure_future(b.recv(tag="slow"))
        async with asyncio.timeout(5):
            while waiting not in b.channel._incoming:  # noqa: ASYNC110 - pulled: receive posted, CTS sent
                await asyncio.sleep(0)
        fast = asyncio.ensure_future(a.send(second, tag="fast"))
        got_second = asyncio.ensure_future(b.recv(tag="fast"))
        one, two, *_ = [await _outcome(f) for f in (got_first, got_second, slow, fast)]
        assert not isinstance(one, BaseException) and np.array_equal(one, first), f"first message: {one!r}"
        assert not isinstance(two, BaseException) and np.array_equal(two, second), f"second message: {two!r}"
