"""Lease renewal at scale: a node renews all its sessions with another node in one control call
per renewal period (RenewLeases), so many peers at a short lease stay alive."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire._leases import GOODBYE_SECONDS, say_goodbye
from tensorwire._node import Node
from tensorwire._peer import tag_id
from tensorwire.control._auth import heartbeat_proof, leave_proof
from tensorwire.control._client import ControlClient
from tensorwire.control._server import MAX_RENEWALS, _Servicer
from tensorwire.errors import PeerDisconnected
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits
from tensorwire.transports._base import ChannelState

# the transports whose sends wait on the peer for a slot or a go-ahead (CTS, inproc: the pull)
# that a goodbye ends, and whose other end hears it: all of them (inproc's, said with no call)
_EVERY_TRANSPORT = [
    "inproc",
    "tcp",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
    ),
]
PEERS = 200
LEASE = 1.0


def _count_calls(monkeypatch: pytest.MonkeyPatch, calls: collections.Counter[str]) -> None:
    """Count the lease renewal calls every node of this process serves (set before it starts:
    gRPC takes the servicer's methods then)."""
    for name in ("Heartbeat", "RenewLeases"):
        method = getattr(_Servicer, name, None)
        if method is None:
            continue

        def counting(orig: Callable[..., Awaitable[Any]], name: str) -> Callable[..., Awaitable[Any]]:
            async def serve(self: _Servicer, request: Any, context: Any) -> Any:
                calls[name] += 1
                return await orig(self, request, context)

            return serve

        monkeypatch.setattr(_Servicer, name, counting(method, name))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_many_peers_at_a_short_lease_stay_alive_on_a_few_calls(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 peers of one node with another at a 1 s lease: each renewal period is one call for
    all of them, and none is declared dead. (One call per session each third of a lease, 600
    calls a second, came back late and killed live peers: 150 at 0.5 s, 35 to 121 of them.)"""
    calls: collections.Counter[str] = collections.Counter()
    _count_calls(monkeypatch, calls)
    renewed: collections.Counter[str] = collections.Counter()
    renew = Node._renew

    def counting_renew(self: Node, session_id: str) -> bool:
        renewed[session_id] += 1
        return renew(self, session_id)

    monkeypatch.setattr(Node, "_renew", counting_renew)
    async with (
        tensorwire.start("127.0.0.1:0", transports=(transport,), lease_seconds=LEASE) as server,
        tensorwire.start("127.0.0.1:0", transports=(transport,), lease_seconds=LEASE) as client,
    ):
        peers: list[tensorwire.Peer] = []
        for _ in range(0, PEERS, 25):
            peers += await asyncio.gather(*(client.connect(server.address) for _ in range(25)))
        accepted = [await server.accept() for _ in range(PEERS)]
        calls.clear()
        renewed.clear()
        sessions = [p.session.id for p in peers if p.session is not None]
        # six renewals of every session: two whole leases
        await eventually(lambda: all(renewed[s] >= 6 for s in sessions) or any(p.closed for p in peers), seconds=60)
        dead = [p for p in peers + accepted if p.closed]
        assert not dead, f"{len(dead)} live peers declared dead: {dead[0].channel.mailbox.failure}"
        # about 6 calls renewed them all (a few more: renewals of the last ones to connect)
        assert sum(calls.values()) < PEERS, calls
        for p in peers:
            await p.send(b"x")
        for a in accepted:
            assert await a.recv() == b"x"


async def test_renew_leases_answers_for_each_session() -> None:
    """A session the server does not know, or whose proof is wrong, is said so in the answer
    and does not stop the renewal of the others in the same call."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        good = await client.connect(server.address)
        other = await client.connect(server.address)
        await server.accept()
        await server.accept()
        assert good.session is not None and other.session is not None
        before = server._leases[good.session.id][0]
        control = ControlClient(server.address)
        try:
            await asyncio.sleep(0.05)
            lost, refused = await control.renew_leases(
                [
                    (good.session.id, heartbeat_proof(good.session.secret, good.session.id)),
                    (other.session.id, b"not the proof"),
                    ("no-such-session", b"x"),
                ],
                deadline=10,
            )
        finally:
            await control.aclose()
        assert lost == {"no-such-session"}
        assert refused == {other.session.id}
        assert server._leases[good.session.id][0] > before


async def test_a_session_the_server_forgot_fails_alone() -> None:
    """One session of a batch the server no longer knows (it declared it dead) fails its peer
    with PeerDisconnected; the others renewed in the same call stay open."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=0.3) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peers = [await client.connect(server.address) for _ in range(3)]
        for _ in peers:
            await server.accept()
        victim = peers[1]
        assert victim.session is not None
        del server._leases[victim.session.id]  # as when its lease ran out there
        with pytest.raises(tensorwire.PeerDisconnected, match="no longer knows"):
            await asyncio.wait_for(victim.recv(tag="never"), 10)
        renewals = peers[0]._renewals
        assert renewals is not None
        calls = renewals.calls
        await eventually(lambda: renewals.calls >= calls + 3, seconds=10)
        assert not peers[0].closed and not peers[2].closed


async def test_renew_leases_refuses_a_call_too_large() -> None:
    """Each renewal costs the server an HMAC: one call may not ask for more than MAX_RENEWALS
    (a node splits its own renewals into calls of that many)."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server:
        control = ControlClient(server.address)
        try:
            with pytest.raises(tensorwire.ControlPlaneError, match="INVALID_ARGUMENT"):
                await control.renew_leases([("s", b"p")] * (MAX_RENEWALS + 1), deadline=10)
            assert await control.renew_leases([("s", b"p")] * MAX_RENEWALS, deadline=10) == ({"s"}, set())
        finally:
            await control.aclose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closer", ["client", "server"])
async def test_a_closing_node_says_goodbye_once_per_node(closer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that closes tells the node of its sessions in one Leave call for all of them
    (whichever side connected), and each of those sessions ends there for that reason before
    the data connection's own close arrives. A session named with a heartbeat's proof (which
    travels on the wire) is not ended."""
    calls: collections.Counter[str] = collections.Counter()
    _count_calls(monkeypatch, calls)
    monkeypatch.setattr(_Servicer, "Leave", _counted(_Servicer.Leave, calls, "Leave"))
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as client,
    ):
        connected = [await client.connect(server.address) for _ in range(3)]
        accepted = [await server.accept() for _ in range(3)]
        control = ControlClient(server.address)
        try:
            first = connected[0]
            assert first.session is not None
            sid, secret = first.session.id, first.session.secret
            assert await control.leave([(sid, heartbeat_proof(secret, sid))], deadline=5) == 0
        finally:
            await control.aclose()
        assert not any(p.channel.ended.done() for p in accepted)
        leaving, staying = (client, accepted) if closer == "client" else (server, connected)
        await leaving.aclose()
        assert calls["Leave"] == 2  # (the refused one above, and the goodbye)
        for peer in staying:
            await eventually(peer.channel.ended.done)
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                peer.channel.ended.result()


@pytest.mark.timeout(60)
async def test_a_closing_nodes_goodbye_outlives_the_close_of_the_peer_it_rides_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A closing node says goodbye over the control connection of one of its peers of that node.
    That peer, closed alone meanwhile (by the user, or as its channel ended), closed its control
    connection under the call: the goodbye was cancelled, and the node's other sessions there
    never heard it (remote_closing False; a send waiting on them would have waited for the data
    connection's close). The peer's close now waits for the node's goodbye, as for its own."""
    entered, gate = asyncio.Event(), asyncio.Event()
    leave = _Servicer.Leave

    async def held(self: _Servicer, request: Any, context: Any) -> Any:
        entered.set()
        await gate.wait()
        return await leave(self, request, context)

    monkeypatch.setattr(_Servicer, "Leave", held)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as client,
    ):
        connected = [await client.connect(server.address) for _ in range(2)]
        accepted = {p.session.id: p for p in [await server.accept() for _ in range(2)] if p.session is not None}
        staying = [accepted[p.session.id] for p in connected[1:] if p.session is not None]
        closing = asyncio.ensure_future(client.aclose())
        await asyncio.wait_for(entered.wait(), 5)  # (its goodbye is under way, over the first peer's connection)
        alone = asyncio.ensure_future(connected[0].aclose())
        await eventually(lambda: connected[0].closed)
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(closing, alone), 10)
        for peer in staying:
            assert peer.remote_closing, "the node's goodbye was lost"
            await eventually(peer.channel.ended.done)
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                peer.channel.ended.result()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closing", ["node", "connected peer", "accepted peer"])
async def test_a_goodbye_nobody_answers_delays_the_close_a_moment(
    closing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node, or a peer closed alone, whose goodbye is never answered (the other node is
    stuck) still closes: the goodbye gives up after GOODBYE_SECONDS, and the other side learns
    as before. The peer's own operations end at the call, not after the goodbye."""

    async def stuck(self: _Servicer, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(_Servicer, "Leave", stuck)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        connected = await client.connect(server.address)
        accepted = await server.accept()
        peer = accepted if closing == "accepted peer" else connected
        recv = asyncio.ensure_future(peer.recv(tag="never"))
        await asyncio.sleep(0.05)
        ended: list[str] = []
        recv.add_done_callback(lambda _: ended.append("recv"))
        close = asyncio.ensure_future(client.aclose() if closing == "node" else peer.aclose())
        close.add_done_callback(lambda _: ended.append("close"))
        async with asyncio.timeout(10 * GOODBYE_SECONDS):  # (a hang guard)
            await close
        if closing != "node":  # (the recv at the channel's close, the close after the goodbye gave up)
            assert ended == ["recv", "close"]
            with pytest.raises(tensorwire.ClosedResourceError):
                await recv
        recv.cancel()
        await asyncio.gather(recv, return_exceptions=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closing", ["connected peer", "accepted peer"])
@pytest.mark.parametrize("goodbye_seconds", [None, 6.0])
async def test_a_slow_goodbye_is_heard_within_goodbye_seconds(
    closing: str, goodbye_seconds: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A goodbye that takes 1.5 s to be answered (a slow control plane: an emulated guest on a
    loaded host took over GOODBYE_SECONDS) is heard where both nodes give it
    ``goodbye_seconds=6``: the other end says ``remote_closing``. With the default (0.5 s) the
    closing end gave it up, and the other end, whose channel closed first, forgot the session
    before the goodbye came: it looked gone without one, and so it still does by default."""
    leave = _Servicer.Leave

    async def slow(self: _Servicer, request: Any, context: Any) -> Any:
        await asyncio.sleep(1.5)
        return await leave(self, request, context)

    monkeypatch.setattr(_Servicer, "Leave", slow)
    opts: dict[str, Any] = {"transports": ("tcp",)}
    if goodbye_seconds is not None:
        opts["goodbye_seconds"] = goodbye_seconds
    async with tensorwire.start("127.0.0.1:0", **opts) as server, tensorwire.start("127.0.0.1:0", **opts) as client:
        connected = await client.connect(server.address)
        accepted = await server.accept()
        closed, other = (accepted, connected) if closing == "accepted peer" else (connected, accepted)
        async with asyncio.timeout(20):  # (a hang guard)
            await closed.aclose()
        await eventually(lambda: other.closed, seconds=10)
        assert other.remote_closing is (goodbye_seconds is not None), repr(other)


@pytest.mark.timeout(60)
async def test_a_closing_nodes_inproc_peers_hear_its_goodbye_before_its_calls_to_other_nodes_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A closing node tells its inproc peers' other ends at once (no call: that node is in this
    process), not after its Leave calls to other nodes, here one that is never answered (held
    for GOODBYE_SECONDS). Before, inproc peers were told nothing: the other end's sends went on,
    delivered to a node that was closing, until that call gave up and the close reached the
    channel, and it then said closed with ``remote_closing`` False, as for a crash."""

    async def stuck(self: _Servicer, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(_Servicer, "Leave", stuck)
    async with (
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp"), lease_seconds=20) as leaving,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as silent,
        tensorwire.start("127.0.0.1:0", transports=("inproc",), lease_seconds=20) as near,
    ):
        await leaving.connect(silent.address)
        await silent.accept()
        inproc = await near.connect(leaving.address)
        await leaving.accept()
        assert inproc.path.transport == "inproc", inproc.path
        closing = asyncio.ensure_future(leaving.aclose())
        await eventually(lambda: inproc.remote_closing or closing.done())
        assert not closing.done(), "the inproc peer heard no goodbye while the node's call to another one waited"
        assert " closing (it said goodbye) " in repr(inproc), repr(inproc)
        with pytest.raises(PeerDisconnected, match="said goodbye"):
            await asyncio.wait_for(inproc.send(np.ones(8, np.uint8), tag="late"), 5)
        await asyncio.wait_for(closing, 10)
        assert inproc.closed and inproc.remote_closing, repr(inproc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["both ways", "two names"])
async def test_a_goodbye_is_one_call_per_node_whatever_its_address(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node of the sessions, not the address that reached it, gets one Leave call, over a
    control connection the closing node already has to it: one connected to by one name
    ("localhost:port") that connected back giving another (its address, "127.0.0.1:port"), or
    connected to by two names. Grouped by address, each name was a call of its own, and the
    peers we accepted opened a new control connection for theirs (old: 2 calls, 1 opened)."""
    calls: collections.Counter[str] = collections.Counter()
    monkeypatch.setattr(_Servicer, "Leave", _counted(_Servicer.Leave, calls, "Leave"))
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as staying,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as leaving,
    ):
        port = staying.address.rpartition(":")[2]
        await leaving.connect(f"localhost:{port}")
        await staying.accept()
        if how == "both ways":
            await staying.connect(leaving.address)
            await leaving.accept()
        else:
            await leaving.connect(staying.address)
            await staying.accept()
        ends = [p.channel.ended for p in staying.peers]
        opened = 0
        init = ControlClient.__init__

        def counting_init(self: ControlClient, *args: Any, **kwargs: Any) -> None:
            nonlocal opened
            opened += 1
            init(self, *args, **kwargs)

        monkeypatch.setattr(ControlClient, "__init__", counting_init)
        await leaving.aclose()
        assert (calls["Leave"], opened) == (1, 0)
        for ended in ends:
            await eventually(ended.done)
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                ended.result()


@pytest.mark.timeout(60)
async def test_a_goodbye_leaves_a_channel_this_side_is_closing_to_its_own_close() -> None:
    """A goodbye that comes while this side's own close of the channel is under way (its
    goodbye frame waits behind a send the other node, stopped, does not take) leaves the
    channel to that close: what ends with it says ClosedResourceError, as for any close of our
    own, not that the peer closed. (It said "peer ... closed (it said goodbye)".)"""
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _SERVE_ONE, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    try:
        address = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
        async with tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as node:
            peer = await node.connect(address)
            assert peer.session is not None
            os.kill(child.pid, signal.SIGSTOP)  # (it reads nothing from now on)
            send = asyncio.ensure_future(peer.send(np.zeros(32 << 20, np.uint8)))  # (more than the buffers hold)
            closing = asyncio.ensure_future(peer.aclose())
            await eventually(lambda: peer.channel.state is ChannelState.CLOSING)
            ended = peer.channel.ended
            control = ControlClient(node.address)
            try:
                sid, secret = peer.session.id, peer.session.secret
                await control.leave([(sid, leave_proof(secret, sid))], deadline=5)
            finally:
                await control.aclose()
            os.kill(child.pid, signal.SIGCONT)
            await closing
            await asyncio.gather(send, return_exceptions=True)
            with pytest.raises(tensorwire.ClosedResourceError):
                ended.result()
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


# a node that serves one peer until it is killed
_SERVE_ONE = """
import asyncio
import tensorwire

async def main():
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as node:
        print(node.address, flush=True)
        await node.accept()
        await asyncio.Event().wait()

asyncio.run(main())
"""


def _counted(
    orig: Callable[..., Awaitable[Any]], calls: collections.Counter[str], name: str
) -> Callable[..., Awaitable[Any]]:
    async def serve(self: _Servicer, request: Any, context: Any) -> Any:
        calls[name] += 1
        return await orig(self, request, context)

    return serve


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _EVERY_TRANSPORT)
async def test_sends_waiting_for_the_receiver_end_at_its_goodbye(transport: str) -> None:
    """A send waiting on the other node (a rendezvous message's go-ahead, CTS, that its recv
    sends; a message slot it gives back) ends when that node says goodbye, with the goodbye's
    PeerDisconnected, as one-sided operations do; a send begun after it raises it at once. It
    waited for the data connection's close before, which a reader parked behind a busy stream
    may not see until the lease (here the node says goodbye and keeps the connection open)."""
    # everything rendezvous (no credit), one message slot for the user's messages
    limits = Limits(recv_buffer_bytes=0, max_unexpected=1)
    async with connected_pair(transport, limits=limits, lease_seconds=20) as (a, b):
        cts = asyncio.ensure_future(a.send(np.ones(1 << 20, np.uint8), tag="big"))  # takes the slot, waits for CTS
        await eventually(lambda: b.channel.mailbox.oldest(tag_id("big")) is not None)  # (its header came)
        slot = asyncio.ensure_future(a.send(np.ones(8, np.uint8), tag="small"))  # waits for a slot
        await asyncio.sleep(0.05)
        assert not cts.done() and not slot.done()
        await say_goodbye(b.node, [b])  # (the Leave call a closing node makes; b stays open)
        await asyncio.wait([cts, slot], timeout=5)
        for send in (cts, slot):
            assert send.done(), "a send waiting on the peer outlived its goodbye"
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                send.result()
        with pytest.raises(PeerDisconnected, match="said goodbye"):
            await asyncio.wait_for(a.send(np.ones(1 << 20, np.uint8), tag="later"), 5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _EVERY_TRANSPORT)
async def test_a_small_send_after_the_goodbye_raises_and_what_came_before_is_received(transport: str) -> None:
    """After the other node said goodbye, a small eager send (the one-frame fast path, which
    waits for nothing) raises the goodbye's PeerDisconnected, where it returned a receipt for
    bytes the closing node would drop; a message that came before it is still received."""
    async with connected_pair(transport, lease_seconds=20) as (a, b):
        await b.send(np.arange(4, dtype=np.int64), tag="before")
        await eventually(lambda: a.channel.mailbox.oldest(tag_id("before")) is not None)
        await say_goodbye(b.node, [b])  # (the Leave call a closing node makes; b stays open)
        await eventually(lambda: a.channel.ended.done())
        for _ in range(2):  # (the first might have been the one to notice)
            with pytest.raises(PeerDisconnected, match="said goodbye"):
                await asyncio.wait_for(a.send(np.ones(8, np.uint8), tag="after"), 5)
        got = await asyncio.wait_for(a.recv(tag="before"), 5)
        np.testing.assert_array_equal(got, np.arange(4, dtype=np.int64))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _EVERY_TRANSPORT)
async def test_a_peer_whose_node_said_goodbye_says_it_is_closing(transport: str) -> None:
    """Once the other node said goodbye, the peer says so (``remote_closing``, and "closing (it
    said goodbye)" in its repr) while its channel is still open (``closed`` False): a message
    that came before is still received. Its node's close then closes it. Before, the peer said
    "open" until the data connection closed, while a send begun then raised PeerDisconnected."""
    async with connected_pair(transport, lease_seconds=20) as (a, b):
        await b.send(np.arange(4, dtype=np.int64), tag="before")
        await eventually(lambda: a.channel.mailbox.oldest(tag_id("before")) is not None)
        assert " open " in repr(a), repr(a)
        await say_goodbye(b.node, [b])  # (the Leave call a closing node makes, answered: b stays open)
        assert not a.closed and " closing (it said goodbye) " in repr(a), repr(a)
        assert a.remote_closing and not b.remote_closing  # (b said it, and heard none)
        got = await asyncio.wait_for(a.recv(tag="before"), 5)
        np.testing.assert_array_equal(got, np.arange(4, dtype=np.int64))
        await b.node.aclose()  # (its goodbye is said: the close on the data connection alone)
        await eventually(lambda: a.closed)
        assert a.remote_closing and " closed " in repr(a), repr(a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", _EVERY_TRANSPORT)
@pytest.mark.parametrize("closer", ["connected", "accepted"])
async def test_the_other_end_of_a_peer_closed_alone_says_it_said_goodbye(transport: str, closer: str) -> None:
    """A peer closed alone says goodbye, and its ``aclose()`` returns once the other node has
    answered: by then the other end says so (``remote_closing``), whichever of the goodbye and
    the close on the data connection got there first. Before, the close on the data connection
    came first (tcp: every time here), the node forgot the session, and the goodbye that came
    after it was passed over: ``remote_closing`` stayed False, as for a peer gone without one."""
    async with connected_pair(transport, lease_seconds=20) as (a, b):
        closing, other = (a, b) if closer == "connected" else (b, a)
        pending = asyncio.ensure_future(other.recv(tag="never"))
        await eventually(lambda: other.channel.mailbox.in_flight == 1)
        await closing.aclose()
        await eventually(lambda: other.closed)
        assert other.remote_closing, repr(other)
        with pytest.raises(PeerDisconnected):
            await asyncio.wait_for(pending, 5)
        assert not closing.remote_closing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closer", ["client", "server"])
async def test_a_peer_closed_alone_says_goodbye_for_its_session_only(
    closer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer closed on its own (not its node) says goodbye for its one session (one Leave
    call, whichever side connected): that session ends there for that reason, the others with
    that node stay open (here the close on the data connection is not held up, and may get
    there first: which of the two ends it is a race). The node's close then says goodbye for the two left in one call,
    neither naming the closed one again nor making a call of its own for each peer it closes
    (3 peers to one node: 1 call, then 1 more). Before, a peer closed alone made no call."""
    calls: collections.Counter[str] = collections.Counter()
    monkeypatch.setattr(_Servicer, "Leave", _counted(_Servicer.Leave, calls, "Leave"))
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), lease_seconds=20) as client,
    ):
        connected = [await client.connect(server.address) for _ in range(3)]
        accepted = [await server.accept() for _ in range(3)]
        by_session = {p.session.id: p for p in accepted if p.session is not None}
        pairs = [(c, by_session[c.session.id]) for c in connected if c.session is not None]
        assert len(pairs) == 3
        leaving_node, closing = (client, pairs[0][0]) if closer == "client" else (server, pairs[0][1])
        others = [s if closer == "client" else c for c, s in pairs]
        await closing.aclose()
        assert calls["Leave"] == 1, "a peer closed alone did not say goodbye"
        await eventually(others[0].channel.ended.done)
        with pytest.raises(PeerDisconnected):  # (its goodbye, or the close on the data connection before it)
            others[0].channel.ended.result()
        assert not any(p.channel.ended.done() for p in others[1:])
        assert not any(c.closed or s.closed for c, s in pairs[1:])
        await leaving_node.aclose()
        assert calls["Leave"] == 2  # (one for the peer alone, one for the node's two left)
        for peer in others:
            await eventually(peer.channel.ended.done)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("sayer", ["connected", "accepted"])
async def test_a_goodbye_on_a_node_connected_to_itself_reaches_the_other_end(sayer: str, transport: str) -> None:
    """A node connected to itself holds both ends of one session, under one id. A goodbye said
    for one end (the Leave call a closing peer makes) ends the other end, as between two nodes:
    that one says it is closing and its sends raise the goodbye's PeerDisconnected; the end that
    said it does not. The server looked the session up by id alone and took whichever end was
    adopted last: as often as not the one saying goodbye, which then raised "peer ... closed (it
    said goodbye)" on its own sends while the other end heard nothing."""
    async with tensorwire.start("127.0.0.1:0", transports=(transport,), lease_seconds=20) as node:
        connected = await node.connect(node.address)
        accepted = await node.accept()
        assert connected.path.transport == transport, connected.path
        assert connected.session is not None and accepted.session is not None
        assert connected.session.id == accepted.session.id
        saying, other = (connected, accepted) if sayer == "connected" else (accepted, connected)
        await say_goodbye(node, [saying])  # (the Leave call a closing peer makes; it stays open)
        assert other.remote_closing, "the other end did not hear the goodbye"
        assert not saying.remote_closing, "the end that said goodbye was told it"
        await saying.send(np.ones(8, np.uint8), tag="x")  # (its own sends go on)
        with pytest.raises(PeerDisconnected, match="said goodbye"):
            await asyncio.wait_for(other.send(np.ones(8, np.uint8), tag="y"), 5)
