"""Verbs failures (inside the Soft-RoCE guest): a send or an RDMA read whose post fails at once,
and a rendezvous message the receiver has no memory for, let go (``Channel.discard``).

The guest is emulated (qemu TCG), so control-plane wall-clock limits are scaled (EMULATED).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tensorwire
from tensorwire.errors import TensorWireError, TransferError
from tensorwire.rpc._protocol import REQUEST_TAG
from tensorwire.testing import connected_pair
from tensorwire.transports import ChannelState, Limits
from tensorwire.transports._mailbox import Arrival
from tensorwire.transports.verbs import VerbsChannel
from tensorwire.transports.verbs._verbs import pv

MiB = 1 << 20
EMULATED = {"lease_seconds": 30.0, "connect_timeout": 60.0, "goodbye_seconds": 5.0}
pytestmark = pytest.mark.timeout(180)


async def test_an_inline_send_whose_post_fails_at_once_raises() -> None:
    """``ibv_post_send`` refusing the MSG frame at once (a queue pair in error, say) breaks the
    channel; the send whose frame it was must raise, not return a receipt for a message that
    never left (an inline send returned one)."""
    async with connected_pair("verbs", **EMULATED) as (a, _b):
        ch = a.channel
        assert isinstance(ch, VerbsChannel)

        def refuse(*args: object) -> None:
            raise pv().pyverbs_error.PyverbsError("Failed to post send. Errno: 22, Invalid argument")

        ch._qp.post_send = refuse  # type: ignore[method-assign]
        with pytest.raises(TransferError, match="post_send"):
            await asyncio.wait_for(a.send(np.arange(8, dtype=np.uint8), tag="x"), 30)
        assert ch.state is ChannelState.BROKEN


async def test_a_one_sided_read_whose_post_fails_at_once_raises() -> None:
    """An RDMA READ that ``ibv_post_send`` refuses at once breaks the channel; the read must
    fail with it. Its completion callback was taken out before the shutdown, which fails the
    callbacks still registered: a read of one chunk (up to 4 MiB) was never told, and waited
    for good (here until the test's 30 s)."""
    async with connected_pair("verbs", **EMULATED) as (a, b):
        kv = np.arange(4096, dtype=np.uint8)
        a.node.expose(kv, name="kv")
        h = await b.lookup("kv")
        ch = b.channel
        assert isinstance(ch, VerbsChannel)

        def refuse(*args: object) -> None:
            raise pv().pyverbs_error.PyverbsError("Failed to post send. Errno: 22, Invalid argument")

        ch._qp.post_rdma = refuse  # type: ignore[method-assign]
        with pytest.raises(TensorWireError):
            await asyncio.wait_for(b.read(h, out=np.empty_like(kv)), 30)
        assert ch.state is ChannelState.BROKEN


async def test_a_rendezvous_request_the_server_has_no_memory_for_is_dropped_and_the_node_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message on the RPC request tag beyond the server's credit (rendezvous) that the server
    has no memory for (tests/test_out_of_memory.py runs this for tcp and ucx in a capped child;
    here the allocation is refused in-process). Its receive fails with the channel open and
    the RPC server lets it go with ``Channel.discard``, which verbs refused for a rendezvous
    message not pulled yet ("its sender can abort it"), and a recv with ``keep=False`` needs
    memory for it too: the request reader stopped for good, and the peer's next call waited
    unread until its deadline. Now it is dropped unread (FIN, dropped: no READ), the sender's
    send completes, and the node serves on."""
    big = 8 * MiB
    real = Arrival.allocate

    def allocate(self: Arrival, on_device: bool = False) -> None:
        if self.nbytes >= big:
            raise TransferError(f"no memory for {self.nbytes} bytes (simulated)")
        real(self, on_device)

    monkeypatch.setattr(Arrival, "allocate", allocate)
    limits = Limits(recv_buffer_bytes=MiB)  # an 8 MiB message goes rendezvous
    async with (
        tensorwire.start("127.0.0.1:0", transports=("verbs",), limits=limits, **EMULATED) as server,
        tensorwire.start("127.0.0.1:0", transports=("verbs",), limits=limits, **EMULATED) as client,
    ):

        @server.method("ping")
        async def ping() -> int:
            return 1

        peer = await client.connect(server.address)
        await server.accept()
        assert await asyncio.wait_for(peer.call("ping", _deadline=30), 40) == 1
        bogus = asyncio.ensure_future(peer._send_own(np.zeros(big, np.uint8), tag=REQUEST_TAG))
        try:
            await asyncio.sleep(1.0)
            assert await asyncio.wait_for(peer.call("ping", _deadline=20), 30) == 1
            receipt = await asyncio.wait_for(bogus, 20)  # let go there: nothing waits on it
            assert receipt.protocol == "rendezvous"
        finally:
            bogus.cancel()
