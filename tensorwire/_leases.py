"""Renewing the leases of the sessions a node opened: one control call per lease period for all
the sessions with one node (RenewLeases), however many peers share it. And ending them early: a
node that closes says goodbye to the nodes of its sessions (Leave, ``say_goodbye``).

Renewed one call per session, hundreds of peers at a short lease were thousands of gRPC calls
a second; the calls queued behind each other, came back past their deadlines, and live peers
were declared dead (150 peers at a 0.5 s lease in one process: 35 to 121 of 150 within 6 s).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import weakref
from typing import TYPE_CHECKING

from .control._auth import heartbeat_proof, leave_proof
from .control._client import ControlClient, SessionLost
from .control._server import MAX_RENEWALS
from .errors import ClosedResourceError, PeerDisconnected, TensorWireError

if TYPE_CHECKING:
    from ._node import Node
    from ._peer import Peer

log = logging.getLogger(__name__)

__all__ = [
    "GOODBYE_SECONDS",
    "NODES_HERE",
    "Goodbye",
    "Renewals",
    "plan_goodbye",
    "renewals_for",
    "say_goodbye",
    "send_goodbye",
]

# the most a closing node waits for the nodes of its sessions to hear its goodbye, by default
# (NodeConfig.goodbye_seconds): a dead or unreachable one delays the close this long at most
# for each step, and then learns of it at the lease
GOODBYE_SECONDS = 0.5

# the nodes of this process by instance id (each adds itself as it is made): an inproc peer's
# goodbye reaches the node of its other end through it, with no call (``plan_goodbye``)
NODES_HERE: weakref.WeakValueDictionary[str, Node] = weakref.WeakValueDictionary()


def renewals_for(node: Node, target: str, lease: float) -> Renewals:
    """The renewals of ``node``'s sessions with the node at ``target`` (the address its peers
    connected to) whose lease is ``lease``; made at the first such session."""
    key = (target, lease)
    renewals = node._renewals.get(key)
    if renewals is None:
        renewals = node._renewals[key] = Renewals(node, target, lease)
    return renewals


class Renewals:
    """Renews every third of ``lease``, counted from the last renewal sent (one held up by a
    stall of our own loop goes out at once), the lease of each member peer's session, and
    declares the server dead for a peer whose renewals keep failing for a lease. Time our own
    loop was stalled is not the server's silence: in a sleep, or past a failed call's deadline
    (its failure could not be read sooner; both ends in one process stall together). Ends,
    and leaves its node, when its last member leaves."""

    def __init__(self, node: Node, target: str, lease: float) -> None:
        self.node = node
        self.target = target
        self.lease = lease
        # member -> when a renewal of its session was last answered (or it joined)
        self._members: dict[Peer, float] = {}
        self.calls = 0  # RenewLeases calls made (each renews up to MAX_RENEWALS sessions)
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"tensorwire-leases {target}")

    def add(self, peer: Peer) -> None:
        """Renew ``peer``'s session from now on, at the next renewal of the others (within a
        third of a lease)."""
        self._members[peer] = time.monotonic()

    def discard(self, peer: Peer) -> None:
        """Stop renewing ``peer``'s session (it closed, or its channel failed)."""
        if self._members.pop(peer, None) is not None and not self._members:
            self._end()

    def _end(self) -> None:
        if self.node._renewals.get((self.target, self.lease)) is self:
            del self.node._renewals[(self.target, self.lease)]
        self.task.cancel()

    async def _run(self) -> None:
        interval = self.lease / 3
        sent = time.monotonic()
        while self._members:
            wait = max(0.0, sent + interval - time.monotonic())
            before = time.monotonic()
            await asyncio.sleep(wait)
            lag = time.monotonic() - before - wait
            if lag > interval:  # our own loop stalled: that time is not the server's silence
                for peer in self._members:
                    self._members[peer] += lag
            sent = time.monotonic()
            batch = [peer for peer in self._members if not peer.closed]
            chunks = [batch[i : i + MAX_RENEWALS] for i in range(0, len(batch), MAX_RENEWALS)]
            if len(chunks) == 1:
                await self._renew(chunks[0], sent, interval)
            else:
                await asyncio.gather(*(self._renew(chunk, sent, interval) for chunk in chunks))

    async def _renew(self, batch: list[Peer], sent: float, interval: float) -> None:
        """One RenewLeases call for ``batch``; a renewal the server answered proves its session
        alive as of when it was sent."""
        try:
            lost, refused = await self._call(batch, interval)
        except TensorWireError as exc:
            late = max(0.0, time.monotonic() - sent - interval)  # read late: our own stall
            self._failed(batch, late, str(exc))
            return
        now = time.monotonic()
        unrenewed = []
        for peer in batch:
            assert peer.session is not None
            sid = peer.session.id
            if sid in lost:  # the server no longer knows the session: the peer is gone
                self.discard(peer)
                peer._session_lost(SessionLost(f"{self.target} no longer knows this session"))
            elif sid in refused:
                unrenewed.append(peer)
            elif peer in self._members:
                self._members[peer] = now
                peer._confirmed = max(peer._confirmed, sent)
        if unrenewed:
            self._failed(unrenewed, 0.0, "it refused the session's proof")

    async def _call(self, batch: list[Peer], deadline: float) -> tuple[set[str], set[str]]:
        """The call goes over the control connection of a member still open; one that closed
        under the call (its peer closed) hands it to another."""
        renewals = []
        for peer in batch:
            assert peer.session is not None
            renewals.append((peer.session.id, heartbeat_proof(peer.session.secret, peer.session.id)))
        while True:
            via = next((p for p in self._members if not p.closed and p._control is not None), None)
            if via is None or via._control is None:
                raise ClosedResourceError(f"no open control connection to {self.target} is left")
            self.calls += 1
            try:
                return await via._control.renew_leases(renewals, deadline)
            except ClosedResourceError:
                if not via.closed:
                    raise

    def _failed(self, batch: list[Peer], late: float, why: str) -> None:
        """Renewals of ``batch`` failed: declare the server dead for those unanswered for a lease."""
        now = time.monotonic()
        for peer in batch:
            last_ok = self._members.get(peer)
            if last_ok is None:
                continue
            last_ok = self._members[peer] = last_ok + late
            if now - last_ok > self.lease:
                self.discard(peer)
                peer.channel.fail(
                    PeerDisconnected(f"{self.target} did not answer lease renewals for {self.lease} s ({why})")
                )


# one Leave call to one node: the address called, the name its TLS certificate must carry where a
# new connection checks another than TLSConfig.server_name (Peer._control_name), the control
# connection to call it over (None: a new one to that address, closed after it), and the sessions
# named with their proofs
Goodbye = tuple[str, str | None, ControlClient | None, list[tuple[str, bytes]]]


def plan_goodbye(peers: list[Peer]) -> list[Goodbye]:
    """The calls that tell the nodes of ``peers`` their sessions end (``send_goodbye`` makes
    them): one per node, not per address (one reached by two names, "localhost:5000" and
    "127.0.0.1:5000", or connected to by us and to us, is one call), over the control connection
    one of its peers has where any has one. Synchronous, so a close plans it before its channel
    closes (after, the peer is closed and its control connection winding down). Each peer is
    planned once (``Peer._said_goodbye``): a node's close names all its peers in one call per
    node, and their closes after it pass them over; a peer closed alone names its own session.
    An inproc peer's goodbye is no call: its other end is in this process, and is told here, at
    once (``_say_in_process``), before the channel closes and before any call to another node."""
    calls: dict[str, Goodbye] = {}
    for peer in peers:
        session = peer.session
        if peer._said_goodbye or peer.closed or session is None:
            continue
        peer._said_goodbye = True
        if peer.path.transport == "inproc":
            _say_in_process(peer)
            continue
        control = peer._control if peer._control is not None and not peer._control._closed else None
        target = control.target if control is not None else peer._control_address
        if not target:
            continue
        key = peer.remote_instance or target
        first, name, via, sessions = calls.get(key, (target, peer._control_name, None, []))
        if via is None and control is not None:
            first, via = target, control
        sessions.append((session.id, leave_proof(session.secret, session.id)))
        calls[key] = (first, name, via, sessions)
    return list(calls.values())


def _say_in_process(peer: Peer) -> None:
    """Tell the other end of inproc ``peer`` that its session ends, as the Leave call a peer over
    another transport makes (``Node._peer_left`` there): its node is in this process, found by
    its instance id, and the session's secret, which both ends hold, stands for the call's proof.
    (Both nodes run on this loop: inproc joins no others, ``InprocTransport.accepts``.)"""
    node = NODES_HERE.get(peer.remote_instance)
    session = peer.session
    if node is None or session is None:
        return
    other = node._leaving_peer(session.id)
    if other is None or other._closed or other.session is None:
        return  # (a peer that node closes ends with its own ClosedResourceError)
    if hmac.compare_digest(other.session.secret, session.secret):
        node._peer_left(other)


async def send_goodbye(node: Node, calls: list[Goodbye]) -> None:
    """Make the Leave calls ``plan_goodbye`` planned, all at once, within ``goodbye_seconds``
    each (twice that in all, with closing the connections opened for them). The nodes called
    end those sessions' channels then (``Node._peer_left``), where they would otherwise wait
    for the close on the data connection, which their kernel may not see for long: behind more
    bytes than the socket buffers hold, while their reader is parked (a busy consumer stream)
    or stopped, it stays here until they read again, and the lease told. Best effort, never
    raises (but CancelledError): a node that does not answer in time learns of the close as
    before. A control connection named in a call must stay open until this returns (the peer
    that owns it waits: ``Peer._close_control``)."""
    if not calls:
        return
    seconds = node.config.goodbye_seconds

    async def leave(
        target: str, name: str | None, via: ControlClient | None, sessions: list[tuple[str, bytes]]
    ) -> None:
        client = via
        try:
            if client is None:  # (in the try: a TLS node reads its files here, which may have gone)
                client = ControlClient(target, node.config.tls, seconds, name)
            for i in range(0, len(sessions), MAX_RENEWALS):  # (as the renewals: a server takes that many a call)
                await client.leave(sessions[i : i + MAX_RENEWALS], seconds)
        except Exception as exc:  # (it is gone, or closing too: it learns as before)
            log.debug("goodbye to %s (%d sessions) failed: %r", target, len(sessions), exc)
        finally:
            if via is None and client is not None:
                await client.aclose()

    try:
        async with asyncio.timeout(seconds * 2):  # (the calls' deadlines, and the closes)
            await asyncio.gather(*(leave(t, name, via, sessions) for t, name, via, sessions in calls))
    except TimeoutError:
        log.debug("goodbyes to %d nodes took over %s s", len(calls), seconds * 2)


async def say_goodbye(node: Node, peers: list[Peer]) -> None:
    """Tell the nodes of ``peers`` that their sessions with ``node`` end (it is closing): one
    Leave call per node (``plan_goodbye``), made and awaited (``send_goodbye``)."""
    await send_goodbye(node, plan_goodbye(peers))
