"""The staged-TCP channel under concurrency: many sends and recvs on many tags, cancelled at
random, with the peer's message slots scarce, so that sends wait for slots and overtake nothing;
and the listener closed while it accepts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import random
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire.testing import connected_pair
from tensorwire.transports import Limits, TransportContext
from tensorwire.transports.tcp import TcpTransport
from tensorwire.transports.tcp._transport import _open_any

pytestmark = pytest.mark.timeout(60)


async def test_sends_waiting_for_a_message_slot_keep_their_order_on_the_tag() -> None:
    """Sends started one after another on a tag while the peer's two message slots are taken wait
    for slots; a send started later must not take a slot that came back ahead of them. Before, a
    later send found the returned slot first (the fast path, or a slow-path send that needed no
    wait) and went ahead: 197 of 200 messages arrived out of order."""
    async with connected_pair("tcp", limits=tensorwire.Limits(max_unexpected=2)) as (a, b):
        n = 200
        sends = []

        async def receive() -> list[int]:
            return [int((await asyncio.wait_for(b.recv(tag="t"), 5))[0]) for _ in range(n)]

        receiving = asyncio.ensure_future(receive())
        for i in range(n):
            sends.append(asyncio.ensure_future(a.send(np.array([i]), tag="t")))
            await asyncio.sleep(0)
        got = await asyncio.wait_for(receiving, 20)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        assert got == list(range(n)), f"{sum(g != i for i, g in enumerate(got))} messages out of order"


async def test_a_send_begun_as_a_slot_comes_back_does_not_take_it_from_a_send_on_another_tag_that_waits() -> None:
    """The peer's one message slot comes back (it took "f0") while "f1" waits for it, and a send
    on "f2", begun just before the credit frame is read, runs before the woken "f1" does: the
    slot is "f1"'s, which waited first. Before, "f2" took it (the send fast path) and "f1" waited
    on; a receiver that takes them in order (a pipeline stage, whose schedule check counts on
    that) held "f2" unreceived and waited for "f1" for good (seen as an activation missing from
    a pipeline test's stage 1, F3 held where F2 was due)."""
    async with connected_pair("tcp", limits=tensorwire.Limits(max_unexpected=1)) as (a, b):
        window = a.channel._window
        await a.send(np.zeros(4), tag="f0")  # takes the one slot, held at b unreceived
        waiting = asyncio.ensure_future(a.send(np.ones(4), tag="f1"))
        await eventually(lambda: bool(window._waiters), 5, pause=0)
        later: list[asyncio.Future[object]] = []
        grant = window.grant

        def grant_after_a_send_begins(credit: int, slots: int) -> None:
            if slots and not later:  # the next microbatch's send, begun a moment before
                later.append(asyncio.ensure_future(a.send(np.full(4, 2.0), tag="f2")))
            grant(credit, slots)

        window.grant = grant_after_a_send_begins  # type: ignore[method-assign]
        assert (await asyncio.wait_for(b.recv(tag="f0"), 5))[0] == 0
        np.testing.assert_array_equal(await asyncio.wait_for(b.recv(tag="f1"), 5), np.ones(4))
        np.testing.assert_array_equal(await asyncio.wait_for(b.recv(tag="f2"), 5), np.full(4, 2.0))
        await asyncio.wait_for(asyncio.gather(waiting, *later), 5)
        assert later


_SIZES = (0, 8, 1000, 20_000, 300_000, 2_000_000)  # empty, small, eager, rendezvous past the 1 MiB credit


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_sends_and_recvs_cancelled_on_many_tags_lose_duplicate_and_reorder_nothing(seed: int) -> None:
    """Six tags, each with a sender that starts 40 sends (some of them cancelled a few loop turns
    later) and a receiver whose recvs are cancelled at random: per tag, what arrives is whole, in
    the order it was sent, without duplicates, and every send that completed arrives. The peer
    grants 3 message slots, so sends wait for them. Before, 5 or 6 tags of every seed came out
    of order (a send that found a slot free went before the ones waiting for it)."""
    limits = tensorwire.Limits(max_unexpected=3, recv_buffer_bytes=1 << 20)
    ntags, per_tag = 6, 40
    completed: dict[int, set[int]] = {t: set() for t in range(ntags)}
    got: dict[int, list[int]] = {t: [] for t in range(ntags)}

    def message(t: int, i: int, rng: random.Random) -> dict[str, object]:
        return {"i": i, "x": np.full(rng.choice(_SIZES), (t * 7 + i) % 251, np.uint8)}

    async with connected_pair("tcp", limits=limits) as (a, b):

        async def sender(t: int) -> None:
            rng = random.Random(seed * 100 + t)
            started = []
            for i in range(per_tag):
                send = asyncio.ensure_future(a.send(message(t, i, rng), tag=t))
                started.append((i, send))
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
                    if rng.random() < 0.5:
                        send.cancel()
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.uniform(0, 0.003))
            for i, send in started:
                try:
                    await send
                    completed[t].add(i)
                except asyncio.CancelledError:
                    pass
            await a.send({"i": -1}, tag=t)

        async def receiver(t: int) -> None:
            rng = random.Random(seed * 1000 + t)
            while True:
                recv = asyncio.ensure_future(b.recv(tag=t))
                if rng.random() < 0.4:
                    for _ in range(rng.randrange(6)):
                        await asyncio.sleep(0)
                    recv.cancel()
                try:
                    m = await recv
                except asyncio.CancelledError:
                    continue
                if m["i"] == -1:
                    return
                assert (m["x"] == (t * 7 + m["i"]) % 251).all(), f"tag {t}: message {m['i']} corrupted"
                got[t].append(m["i"])

        async with asyncio.timeout(45):
            await asyncio.gather(*[receiver(t) for t in range(ntags)], *[sender(t) for t in range(ntags)])
    for t in range(ntags):
        assert got[t] == sorted(set(got[t])), f"tag {t}: reordered or duplicated: {got[t]}"
        assert completed[t] <= set(got[t]), f"tag {t}: completed sends lost: {sorted(completed[t] - set(got[t]))}"


def _open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets through /proc/self/fd")
@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_connection_accepted_as_the_transport_closes_is_closed_not_left_waiting(turns: int) -> None:
    """A client connects, and the transport closes ``turns`` loop turns later: at 1 or 2 turns the
    close met the accept half done. Before, the close cancelled the task awaiting
    ``loop.sock_accept`` after the socket was accepted: the socket stayed open, held only by the
    accept's result, and the client waited for a CHALLENGE until its ``connect_timeout``."""
    loop = asyncio.get_running_loop()
    before = _open_sockets()
    ctx = TransportContext(node_id="n", host="127.0.0.1", limits=Limits())
    caps = TcpTransport.probe()
    assert caps is not None
    transport = TcpTransport(ctx, caps)
    host, _, port = (await transport.listen()).decode().rpartition(":")
    await asyncio.sleep(0)  # the listener is being watched
    client = socket.create_connection((host, int(port)))  # loopback: done, waiting in the backlog
    try:
        client.setblocking(False)
        for _ in range(turns):
            await asyncio.sleep(0)
        await transport.aclose()
        try:
            async with asyncio.timeout(10):
                with contextlib.suppress(ConnectionResetError):
                    while await loop.sock_recv(client, 4096):  # perhaps a CHALLENGE, then the close
                        pass
        except TimeoutError:
            pytest.fail("the accepted connection was left open: its client waits for a CHALLENGE that never comes")
    finally:
        client.close()
    assert _open_sockets() == before


async def test_a_small_payload_read_through_the_read_ahead_buffer_is_not_reported_direct() -> None:
    """A payload under 64 KiB is read through SockIO's read-ahead buffer and copied into its
    recv's out=, even when that recv was posted first (a pytree goes the general way, not the
    express one): its receipt said ``direct``. A large one lands mostly straight in place."""
    from tensorwire.testing import exchange

    async with connected_pair("tcp") as (a, b):
        for n, direct in ((32 * 1024, False), (4 << 20, True)):
            src = {"x": np.full(n, 3, np.uint8), "y": np.arange(4.0)}
            out = {"x": np.empty(n, np.uint8), "y": np.empty(4)}
            got, _, received = await exchange(a, b, src, out, "recv-first")
            assert got is out and (out["x"] == 3).all()
            assert received.direct is direct and not received.staged, (n, received)


async def test_a_device_message_its_sender_withdrew_writes_nothing_into_out_after_the_recv_is_cancelled() -> None:
    """A recv into a "device" out= (the host engine, copies slower than the network) whose sender
    cancels part way waits for the next message; the user then cancels it. The copies of the
    withdrawn message's chunks queued into out= must not run after that cancellation returns.
    Before, the landing of the withdrawn message was dropped as it was: its copies kept writing
    into out= (7 chunks here) after the cancel returned, and its lane was never given back."""
    from tensorwire._peer import tag_id
    from tensorwire.memory import HostEngine
    from tensorwire.tensors import EngineArray

    src_engine, dst_engine = HostEngine(), HostEngine(copy_delay=0.01)
    src_engine.pool("out").configure(64 << 10, 8)
    dst_engine.pool("in").configure(64 << 10, 8)
    n = 64 << 20
    try:
        async with connected_pair("tcp", limits=tensorwire.Limits(recv_buffer_bytes=0)) as (a, b):
            out = EngineArray(dst_engine, np.zeros(n, np.uint8))
            recv = asyncio.ensure_future(b.recv(tag="t", out=out))
            await asyncio.sleep(0.05)
            send = asyncio.ensure_future(a.send(EngineArray(src_engine, np.ones(n, np.uint8)), tag="t"))
            await asyncio.sleep(0.15)  # part way: the receiver's copies lag behind the socket
            send.cancel()
            with pytest.raises(asyncio.CancelledError):
                await send
            # the ABORT came: the recv waits for the next message (its copies into out= still queued)
            await eventually(lambda: b.channel.mailbox.has_posted(tag_id("t")), 20, 0.0005)
            assert not recv.done()
            recv.cancel()
            with pytest.raises(asyncio.CancelledError):
                await recv
            landed = out.array.copy()
            assert 0 < landed.sum() < n
            await asyncio.sleep(0.3)  # longer than a pool's worth of queued copies
            assert np.array_equal(out.array, landed), "out= was written after the recv's cancel returned"
            assert dst_engine._lanes, "the withdrawn message's lane was never given back"
    finally:
        src_engine.close()
        dst_engine.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


_NO_IPV6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")


@_NO_IPV6
async def test_a_node_on_every_ipv4_interface_takes_tcp_peers_over_ipv6_too() -> None:
    """At 0.0.0.0 the control plane takes IPv6 clients too (gRPC listens on '*'), but the tcp
    data listener took IPv4 only: a connect to [::1]:P failed with "tcp data connection to
    ::1:Q failed". Both families now reach it, each at its own address. Both sides' lane text
    named an IPv6 peer without brackets ("tcp x1 stream ::1:41949"), which is no address one
    can read the port from: it is "[::1]:41949", as the README writes addresses."""
    async with (
        tensorwire.start("0.0.0.0:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = server.address.rsplit(":", 1)[1]
        for address, host in ((f"[::1]:{port}", "[::1]"), (f"127.0.0.1:{port}", "127.0.0.1")):
            async with asyncio.timeout(20):
                peer = await client.connect(address)
                there = await server.accept()
                assert peer.path.transport == "tcp", peer.path
                assert there.path.lanes[0].startswith(f"tcp x1 stream {host}:"), there.path
                assert re.fullmatch(rf"tcp x1 stream {re.escape(host)}:[0-9]+", peer.path.lanes[0]), peer.path
                await peer.send(np.arange(5.0), tag=1)
                assert np.array_equal(await there.recv(tag=1), np.arange(5.0))
                await peer.aclose()


@pytest.mark.parametrize("serving", ["0.0.0.0", pytest.param("[::]", marks=_NO_IPV6)])
async def test_an_ipv4_peer_of_a_node_on_every_interface_is_seen_at_its_plain_ipv4_address(serving: str) -> None:
    """A wildcard listener that took IPv4 peers on an IPv6 socket (Linux's '::' does, and so did
    the dual-stack 0.0.0.0 listener of c204c99) saw them as '::ffff:127.0.0.1', which the
    accepting side's peer path then showed. What the tcp transport reports names IPv4 peers in
    the IPv4 form, on both sides."""
    async with (
        tensorwire.start(f"{serving}:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = server.address.rsplit(":", 1)[1]
        async with asyncio.timeout(20):
            peer = await client.connect(f"127.0.0.1:{port}")
            there = await server.accept()
            await peer.send(np.arange(3), tag="t")
            assert np.array_equal(await there.recv(tag="t"), np.arange(3))
        assert peer.path.lanes[0].startswith("tcp x1 stream 127.0.0.1:"), peer.path
        assert there.path.lanes[0].startswith("tcp x1 stream 127.0.0.1:"), there.path
        for seen in (peer.path, peer.remote_address, repr(peer), there.path, there.remote_address, repr(there)):
            assert "ffff" not in str(seen), seen
        sock = there.channel._io.sock  # type: ignore[attr-defined]
        assert (sock.getpeername()[0], sock.getsockname()[0]) == ("127.0.0.1", "127.0.0.1")


def _ipv6_only_name() -> str | None:
    """A name this machine resolves to ::1 and to no IPv4 address (Debian's /etc/hosts has
    ``ip6-localhost``), or None."""
    for name in ("ip6-localhost", "ip6-loopback", "localhost6", "localhost"):
        try:
            infos = socket.getaddrinfo(name, 1, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found = {(family, addr[0]) for family, _, _, _, addr in infos}
        if (socket.AF_INET6, "::1") in found and all(family == socket.AF_INET6 for family, _ in found):
            return name
    return None


_IPV6_NAME = _ipv6_only_name() if _ipv6_loopback() else None


@pytest.mark.skipif(
    _IPV6_NAME is None,
    reason="no name resolves to ::1 alone here (no 'ip6-localhost' in /etc/hosts) or no IPv6 loopback",
)
async def test_a_node_on_every_interface_reached_by_an_ipv6_only_name_gets_a_tcp_data_path() -> None:
    """The control plane reached a '[::]' node at an IPv6-only name and the data connection dials
    that name too (the wildcard names no host), but the tcp transport looked a host without a
    colon up as IPv4 only. A name of ::1 then went to 127.0.0.1 (glibc's files backend maps
    ::1 to it for IPv4 lookups) or failed (musl); a name of any other IPv6 address failed with
    "Name or service not known". The name is now resolved in both families and its addresses
    tried in turn: the data connection arrives from ::1, the address the name stands for."""
    assert _IPV6_NAME is not None
    async with (
        tensorwire.start("[::]:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = server.address.rsplit(":", 1)[1]
        async with asyncio.timeout(20):
            peer = await client.connect(f"{_IPV6_NAME}:{port}")
            there = await server.accept()
            assert peer.path.transport == "tcp", peer.path
            assert there.path.lanes[0].startswith("tcp x1 stream [::1]:"), there.path
            await peer.send(np.arange(4.0), tag=1)
            assert np.array_equal(await there.recv(tag=1), np.arange(4.0))
            await there.send(np.arange(3), tag=2)
            assert np.array_equal(await peer.recv(tag=2), np.arange(3))


@pytest.mark.parametrize("serving", ["127.0.0.1", "0.0.0.0"])
async def test_a_node_reached_as_localhost_gets_a_tcp_data_path(serving: str) -> None:
    """'localhost' goes through the resolver: on 0.0.0.0 the data connection dials that name (the
    wildcard names no host), on 127.0.0.1 the address the node offers; both carry tensors."""
    async with (
        tensorwire.start(f"{serving}:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = server.address.rsplit(":", 1)[1]
        async with asyncio.timeout(20):
            peer = await client.connect(f"localhost:{port}")
            there = await server.accept()
            assert peer.path.transport == "tcp", peer.path
            await peer.send(np.arange(6.0), tag="x")
            assert np.array_equal(await there.recv(tag="x"), np.arange(6.0))
            await there.send(np.arange(2), tag="y")
            assert np.array_equal(await peer.recv(tag="y"), np.arange(2))


async def test_a_node_started_on_a_host_name_serves_its_tcp_data_path_there() -> None:
    """A node started on a name ('localhost') binds its tcp listener at an address the name
    resolves to and offers the name, which a peer dials; tensors go both ways."""
    async with (
        tensorwire.start("localhost:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        resolved = {addr[0] for *_, addr in socket.getaddrinfo("localhost", 1, type=socket.SOCK_STREAM)}
        listeners = server.transports["tcp"]._listeners  # type: ignore[attr-defined]
        assert listeners and {sock.getsockname()[0] for sock in listeners} <= resolved, listeners
        assert server.offers["tcp"].address.decode().startswith("localhost:"), server.offers["tcp"]
        async with asyncio.timeout(20):
            peer = await client.connect(server.address)
            there = await server.accept()
            assert peer.path.transport == "tcp", peer.path
            await peer.send(np.arange(5.0), tag="x")
            assert np.array_equal(await there.recv(tag="x"), np.arange(5.0))
            await there.send(np.arange(2), tag="y")
            assert np.array_equal(await peer.recv(tag="y"), np.arange(2))


# run in a private mount namespace whose /etc/hosts names ::1 alone and ::1 with 127.0.0.1
# (this machine's /etc/hosts is not touched): the real resolver, real sockets
_NAMED_HOSTS = "127.0.0.1 localhost\n::1 tw-v6-only\n::1 tw-both\n127.0.0.1 tw-both\n"
_NAMED_SCRIPT = """
import asyncio, socket, sys
import numpy as np
import tensorwire

async def main(name, families):
    async with (
        tensorwire.start(f"{name}:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        bound = sorted(s.getsockname()[0] for s in server.transports["tcp"]._listeners)
        assert bound == families, bound
        assert len({s.getsockname()[1] for s in server.transports["tcp"]._listeners}) == 1
        assert server.offers["tcp"].address.decode().startswith(name + ":"), server.offers["tcp"]
        async with asyncio.timeout(20):
            peer = await client.connect(server.address)
            there = await server.accept()
            assert peer.path.transport == "tcp", peer.path
            await peer.send(np.arange(4.0), tag=1)
            assert np.array_equal(await there.recv(tag=1), np.arange(4.0))
            await there.send(np.arange(3), tag=2)
            assert np.array_equal(await peer.recv(tag=2), np.arange(3))
    print("ok", name, bound)

asyncio.run(main(sys.argv[1], sys.argv[2:]))
"""


def _private_hosts_file_works() -> bool:
    """Whether ``unshare -rm`` (a user and mount namespace) can bind-mount a hosts file here."""
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount --bind /dev/null /etc/hosts"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@pytest.mark.skipif(
    not (_ipv6_loopback() and _private_hosts_file_works()),
    reason="no IPv6 loopback, or no 'unshare -rm' to give a test its own /etc/hosts (and none of this "
    "machine's names resolves to ::1 alone)",
)
@pytest.mark.parametrize(("name", "families"), [("tw-v6-only", ["::1"]), ("tw-both", ["127.0.0.1", "::1"])])
def test_a_node_started_on_a_name_binds_its_tcp_listener_at_the_names_addresses(
    name: str, families: list[str], tmp_path: pathlib.Path
) -> None:
    """The tcp listener took a host name for IPv4 because it has no colon: a name of ::1 alone
    was bound at 127.0.0.1 (glibc's files backend maps ::1 to it for an IPv4 lookup), not at the
    address the name stands for, or failed to start the node (musl, or a name of another IPv6
    address); a name of both families served IPv4 alone. The name is now resolved: the listener binds
    where it resolves to, each family on one port, and a peer dialling the name gets through."""
    hosts = tmp_path / "hosts"
    hosts.write_text(_NAMED_HOSTS)
    script = tmp_path / "named.py"
    script.write_text(_NAMED_SCRIPT)
    command = f'mount --bind "{hosts}" /etc/hosts && exec "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, sys.executable, str(script), name, *families],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _refusing() -> socket.socket:
    """A bound socket that does not listen: a connect to its port is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def test_a_name_whose_first_address_refuses_is_reached_at_the_next() -> None:
    """Each address of a name is tried in turn; the error of a name none of whose addresses takes
    the connection names each address and why it failed."""
    with _refusing() as refusing, socket.create_server(("127.0.0.1", 0)) as listening:
        bad = ("127.0.0.1", refusing.getsockname()[1])
        good = ("127.0.0.1", listening.getsockname()[1])
        tried: list[str] = []
        async with asyncio.timeout(10):
            sock = await _open_any("h", [(socket.AF_INET, bad), (socket.AF_INET, good)], tried)
        with sock:
            assert sock.getpeername() == good
        assert tried == [f"127.0.0.1:{bad[1]}", f"127.0.0.1:{good[1]}"]
        with pytest.raises(OSError, match=rf"no address of h took it: 127\.0\.0\.1:{bad[1]}: Connection refused; "):
            await _open_any("h", [(socket.AF_INET, bad), (socket.AF_INET, bad)], [])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets through /proc/self/fd")
async def test_an_address_that_does_not_answer_holds_up_the_next_by_a_moment_not_the_deadline() -> None:
    """An address whose SYNs are dropped (here: a listener whose backlog is full) would hold a
    one-at-a-time connect until the caller's deadline; the next address is tried alongside it
    after a moment, the first to answer wins, and the silent attempt's socket is closed."""
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(socket.socket())
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        listening = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        for _ in range(8):  # fill the backlog until a connect is left waiting
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            try:
                async with asyncio.timeout(0.5):
                    await loop.sock_connect(filler, full.getsockname())
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel took every connection to a listener with a full backlog")
        before = _open_sockets()
        tried: list[str] = []
        async with asyncio.timeout(10):  # the silent address alone would wait out SYN retries
            sock = await _open_any(
                "h", [(socket.AF_INET, full.getsockname()), (socket.AF_INET, listening.getsockname())], tried
            )
        with sock:
            assert sock.getpeername() == listening.getsockname()
        assert len(tried) == 2
        assert _open_sockets() == before
