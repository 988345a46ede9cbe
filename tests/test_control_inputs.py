"""Odd input at the control plane's edges: secrets that must never be printed, handle names that
cannot travel, refusals that must say which side falls short, a control port already taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import pytest
from _loopbacks import has_ipv6_loopback
from _polling import eventually
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tensorwire
from tensorwire import ConfigurationError, Limits, NodeConfig, metrics
from tensorwire.control import PROTOCOL_VERSION, Offer, _server, choose
from tensorwire.control._pb import control_pb2, control_pb2_grpc
from tensorwire.control._server import SERVICE
from tensorwire.transports import Capabilities, Session

SECRET = "hunter2-do-not-print"


def test_secrets_appear_in_no_repr_and_no_error() -> None:
    """A config's repr showed its auth_token, a Session's its secret, and a token refused for its
    type or encoding was quoted in the error: ``TENSORWIRE_TOKEN`` holding a byte that is not
    UTF-8 made ``tensorwire serve`` and ``doctor`` print the token."""
    assert SECRET not in repr(NodeConfig(auth_token=SECRET))
    for bad in (SECRET.encode(), SECRET + "\udcff"):
        with pytest.raises(ConfigurationError, match="auth_token") as info:
            NodeConfig(auth_token=bad)
        assert SECRET not in str(info.value)
    secret = b"\x01s3cret-session-bytes"
    session = Session("sid", secret, "a", "b", Limits())
    assert repr(secret) not in repr(session) and "s3cret" not in repr(session)
    assert session.secret == secret


async def test_an_auth_token_grpc_metadata_cannot_carry_is_refused_at_start() -> None:
    """A stock gRPC client presents the token as ``authorization: Bearer <token>`` metadata, and
    start() took any length and any character: a 20 KB or 1 MB token made a node no such client
    could ever call (RESOURCE_EXHAUSTED, "received metadata size exceeds hard limit"), 9 KB one
    that refused a random part of the calls (gRPC's 8 KiB soft limit), 5 MB one whose own peers'
    handshakes failed with "Received message larger than max", and a newline, a tab or "é" one
    that no client could send ("Illegal header value"). Each is refused at start, by length or
    by character, and the error never shows the token."""
    limit = NodeConfig.MAX_AUTH_TOKEN_CHARS
    assert limit == 4096
    for n in (limit + 1, 20_000, 1 << 20):
        with pytest.raises(ConfigurationError, match=rf"auth_token is {n} characters long; the limit is {limit}"):
            tensorwire.start("127.0.0.1:0", auth_token="s" * n)
    for bad, kind in (
        (SECRET + "\n", "a newline at position 21 of 21"),
        ("\r" + SECRET, "a newline at position 1"),
        (SECRET + "\t", "a control character"),
        (SECRET + "\x00", "a control character"),
        (SECRET + "\x7f", "a control character"),
        (SECRET + "\u00e9", "a non-ASCII character"),
    ):
        with pytest.raises(ConfigurationError, match=f"auth_token has {kind}.*printable ASCII") as info:
            tensorwire.start("127.0.0.1:0", auth_token=bad)
        assert SECRET not in str(info.value)
    # a token at the limit, spaces and punctuation included, works both ways it travels
    token = ("a ~!Z9-_." * limit)[:limit]
    async with (
        tensorwire.start("127.0.0.1:0", auth_token=token, transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", auth_token=token, transports=("tcp",)) as client,
    ):
        peer = await client.connect(server.address)
        assert peer.remote_node == server.node_id
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            for _ in range(5):
                await stub.ListMethods(
                    control_pb2.ListMethodsRequest(), timeout=5, metadata=[("authorization", "Bearer " + token)]
                )


async def test_a_name_utf8_cannot_carry_is_refused_by_expose_and_lookup() -> None:
    """expose() took a name with a lone surrogate, which no peer could ever look up, and
    lookup() of one raised the codec's UnicodeEncodeError."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as owner,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as reader,
    ):
        with pytest.raises(ConfigurationError, match="UTF-8"):
            owner.expose(np.zeros(4), name="w\ud800")
        assert "w\ud800" not in owner.exposures._by_name
        peer = await reader.connect(owner.address)
        with pytest.raises(ConfigurationError, match="UTF-8"):
            await peer.lookup("w\ud800")
        owner.expose(np.arange(4.0), name="w\u00e9\U0001f600")  # any name UTF-8 carries is fine
        handle = await peer.lookup("w\u00e9\U0001f600")
        assert np.array_equal(await peer.read(handle), np.arange(4.0))


@pytest.mark.timeout(60)
async def test_a_lookup_of_a_name_expose_refuses_is_refused_before_the_round_trip() -> None:
    """expose() takes names of 1 to 256 characters, but lookup() sent any name to the owner: one
    of 300 came back HandleNotFound, one of 5 MB as gRPC's RESOURCE_EXHAUSTED in a
    ControlPlaneError after sending it. Both, and the empty name, are the caller's mistake."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as owner,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as reader,
    ):
        peer = await reader.connect(owner.address)
        for name in ("", "x" * 257, "x" * 5_000_000):
            with pytest.raises(ConfigurationError, match="at most 256 characters"):
                owner.expose(np.zeros(2), name=name)
            with pytest.raises(ConfigurationError, match="at most 256 characters"):
                await peer.lookup(name)
        owner.expose(np.arange(3.0), name="x" * 256)  # the longest name still travels
        assert np.array_equal(await peer.read(await peer.lookup("x" * 256)), np.arange(3.0))


def test_require_refusals_say_which_side_falls_short() -> None:
    """A client whose ucx has an RDMA lane asked a server whose ucx has shared memory only for
    require="rdma": the refusal said ucx "moves bytes through the kernel's TCP stack", which
    neither side's ucx does, and did not say which side lacked RDMA."""
    shm = Capabilities(lanes=("sysv/memory", "cma/memory"))
    nic = Capabilities(rdma=True, gpudirect=True, lanes=("rc_mlx5/mlx5_0:1", "cma/memory"))
    server = {"ucx": Offer("ucx", 1, b"s", shm)}
    client = {"ucx": Offer("ucx", 1, b"c", nic)}
    ok = lambda name, addr: None
    with pytest.raises(tensorwire.NegotiationError) as info:
        choose(["ucx"], server, client, {}, {}, "rdma", ok, local_name="server s1", remote_name="client c1")
    assert "no RDMA lane on server s1 (sysv/memory, cma/memory)" in str(info.value)
    assert "TCP stack" not in str(info.value)
    with pytest.raises(tensorwire.NegotiationError, match=r"on client c1 \(no GPUDirect\)"):
        choose(["ucx"], client, server, {}, {}, "gpudirect", ok, local_name="s", remote_name="client c1")
    # a client's lanes come from its handshake: 32 of 100 KB made a 3 MB refusal (and log line)
    huge = {"ucx": Offer("ucx", 1, b"c", Capabilities(lanes=tuple(f"{i}" + "x" * 100_000 for i in range(32))))}
    with pytest.raises(tensorwire.NegotiationError) as info:
        choose(["ucx"], {"ucx": Offer("ucx", 1, b"s", nic)}, huge, {}, {}, "rdma", ok, remote_name="client c1")
    assert len(str(info.value)) < 1000 and "and 24 more" in str(info.value), str(info.value)[:300]
    # and where the transport cannot reach it (each side's lanes are named, within the same bounds)
    unreachable = lambda name, addr: "UCX cannot create an endpoint to the peer: Destination is unreachable"
    with pytest.raises(tensorwire.NegotiationError) as info:
        choose(["ucx"], {"ucx": Offer("ucx", 1, b"s", shm)}, huge, {}, {}, "any", unreachable, remote_name="client c1")
    assert len(str(info.value)) < 1000 and "and 24 more" in str(info.value), str(info.value)[:300]
    assert "(server lists sysv/memory, cma/memory; client c1 lists 0xxx" in str(info.value), str(info.value)[:300]


async def test_a_control_port_in_use_is_named() -> None:
    """Starting a node on a port another node serves said only gRPC's "Failed to bind ... set
    GRPC_VERBOSITY=debug to see detailed error message"."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as first:
        with pytest.raises(ConfigurationError, match="in use") as info:
            async with tensorwire.start(first.address, transports=("tcp",)):
                pass
        assert first.address in str(info.value)
        assert "GRPC_VERBOSITY" not in str(info.value)


async def test_a_taken_port_of_localhost_in_capitals_is_refused_before_grpc_tries(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """gRPC binds both loopbacks for "LOCALHOST" as for "localhost", but the check that refuses
    a taken port before gRPC sees it knew the name in lower case only: "LOCALHOST:P" with P
    taken printed gRPC's own "Failed to add port to server" line on stderr beside the error."""
    async with tensorwire.start("localhost:0", transports=("tcp",)) as first:
        port = first.address.rpartition(":")[2]
        capfd.readouterr()
        for host in ("localhost", "LOCALHOST", "LocalHost"):
            with pytest.raises(ConfigurationError, match=f"cannot bind the control plane to {host}:{port}: .*in use"):
                async with tensorwire.start(f"{host}:{port}", transports=("tcp",)):
                    pass
        assert "Failed to add port" not in capfd.readouterr().err


def _free_at(addr: str, port: int) -> bool:
    """Whether a listener could bind (addr, port) now (as gRPC binds: SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError:
            return False
    return True


async def _serves_control(addr: str, port: int) -> bool:
    host = f"[{addr}]" if ":" in addr else addr
    async with grpc.aio.insecure_channel(f"{host}:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_localhost_with_a_port_another_listener_holds_on_one_loopback_is_refused() -> None:
    """gRPC binds "localhost:P" on 127.0.0.1 and on ::1 and is content with one: with [::1]:P
    another listener's, the node started, served on 127.0.0.1 alone and called itself
    localhost:P, and a client that dialled that name on ::1 reached the other listener. Each
    loopback must be free; the refusal names the one that is not, and leaves nothing bound."""
    for _ in range(20):  # a port free on 127.0.0.1 whose ::1 twin this test holds
        other = socket.create_server(("::1", 0), family=socket.AF_INET6)
        port = other.getsockname()[1]
        if _free_at("127.0.0.1", port):
            break
        other.close()
    else:
        pytest.skip("no port free on 127.0.0.1 whose ::1 twin was free too")
    with other:
        with pytest.raises(ConfigurationError, match=rf"localhost:{port}: \[::1\]:{port}: .*in use"):
            async with tensorwire.start(f"localhost:{port}", transports=("tcp",)):
                pass
        assert _free_at("127.0.0.1", port), "the refused start kept 127.0.0.1's port"


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_localhost_port_0_whose_port_is_taken_on_the_other_loopback_takes_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "localhost:0": gRPC takes a port P on 127.0.0.1 and binds [::1]:P too if it can; where
    another listener held [::1]:P the node served on one loopback under the name of both
    (a CI run: a bench client reached another test's listener). Here another listener takes
    [::1]:P just after the node took P on 127.0.0.1 (the kernel's choice of P cannot be steered
    otherwise): the node gives P back and serves on both loopbacks at another port."""
    why_unbindable = _server._why_unbindable
    held: list[socket.socket] = []

    def racing(host: str, port: int) -> str | None:
        if host == "::1" and not held:
            held.append(socket.create_server(("::1", port), family=socket.AF_INET6))
        return why_unbindable(host, port)

    monkeypatch.setattr(_server, "_why_unbindable", racing)
    try:
        async with tensorwire.start("localhost:0", transports=("tcp",)) as node:
            port = int(node.address.rpartition(":")[2])
            (other,) = held
            taken = other.getsockname()[1]
            assert port != taken
            assert _free_at("127.0.0.1", taken), "the port given back is still bound on 127.0.0.1"
            for addr in ("127.0.0.1", "::1"):
                assert await _serves_control(addr, port), addr
    finally:
        for sock in held:
            sock.close()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.timeout(30)
async def test_a_start_cancelled_during_its_bind_leaves_no_port_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose start was cancelled (or that closed) while it bound its control plane
    closed a gRPC server that had bound a port and never started: gRPC's stop does nothing to
    such a server, and the port stayed bound (listening, never accepting) for the process's
    life, garbage collection or not. Its close now starts it first, so that its stop frees it."""
    why_unbindable = _server._why_unbindable
    bound: list[int] = []
    checking = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(host: str, port: int) -> str | None:
        if host == "::1" and port != 0 and not bound:  # (127.0.0.1:port is bound by now)
            bound.append(port)
            loop.call_soon_threadsafe(checking.set)
        return why_unbindable(host, port)

    monkeypatch.setattr(_server, "_why_unbindable", slow)
    starting = asyncio.ensure_future(tensorwire.start("localhost:0", transports=("tcp",)))
    await asyncio.wait_for(checking.wait(), 10)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    (port,) = bound
    assert _free_at("127.0.0.1", port), "the cancelled start left 127.0.0.1's port bound"


@pytest.mark.timeout(30)
async def test_a_node_that_closes_while_its_control_plane_starts_leaves_nothing_running() -> None:
    """The node's stop under its control plane's start (a node aborted, or its loop ending, as
    it starts): the start says the node is closed, gRPC's server is stopped once its start has
    finished, and no task of the control plane is left waiting (its sweep watch was made after
    the stop, and waited uncancelled until the loop's end)."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        before = set(asyncio.all_tasks())
        control = _server.ControlServer(node)
        starting = asyncio.ensure_future(control.start("127.0.0.1", 0))
        await asyncio.sleep(0)  # (bound, and waiting for gRPC's start)
        await control.stop(0)
        with pytest.raises(tensorwire.ClosedResourceError, match="node is closed"):
            await starting
        assert control.port and _free_at("127.0.0.1", control.port)
        left = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
        assert not left, left


async def test_a_handshake_cannot_make_the_node_repeat_megabytes(caplog: pytest.LogCaptureFixture) -> None:
    """Transport names and reasons in a handshake come back in refusals, in ``peer.path`` and in
    the node's log: 32 names of 100 KB made a 3 MB log line per handshake and a refusal too big
    for gRPC's trailers (the client got RESOURCE_EXHAUSTED: "Stream removed")."""
    async with tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as node:
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            huge = control_pb2.HandshakeRequest(
                protocol_version=PROTOCOL_VERSION, node_id="x", preference=[f"{i}" + "x" * 100_000 for i in range(32)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(huge, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 64 characters" in (info.value.details() or "")
            long_require = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, require="r" * 10_000)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(long_require, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # a long reason is repeated clipped (this session's data connection never opens:
            # the node gives up on it when it closes)
            req = control_pb2.HandshakeRequest(
                protocol_version=PROTOCOL_VERSION, node_id="x", preference=["inproc", "tcp"]
            )
            req.offers.add(name="tcp", version=node.offers["tcp"].version, address=node.offers["tcp"].address)
            req.unavailable.add(name="inproc", reason="r" * 1_000_000)
            resp = await stub.Handshake(req, timeout=5)
            assert resp.chosen.name == "tcp"
            ((name, reason),) = [(p.name, p.reason) for p in resp.passed_over]
            assert name == "inproc" and reason.endswith("rrr...") and len(reason) < 400
    assert max(len(r.getMessage()) for r in caplog.records) < 2000


async def test_a_handshake_cannot_make_the_node_hold_megabytes() -> None:
    """A handshake's node id and control address were taken at any length, up to gRPC's 4 MB
    message: the session waiting for its data connection keeps both, and the address is where
    lookups dial back (and what their errors quote). 150 handshakes with 1.9 MB of each took
    this node from 58 to 662 MiB. Refused now beyond what an honest client sends (an instance id
    past 64 characters too), and a client with the longest node id it may have still connects."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node,
        tensorwire.start("127.0.0.1:0", transports=("tcp",), node_id="n" * NodeConfig.MAX_NODE_ID_CHARS) as client,
    ):
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            for field in ("node_id", "control_address", "instance_id"):
                req = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, **{field: "x" * 100_000})
                req.offers.add(name="tcp", version=node.offers["tcp"].version, address=node.offers["tcp"].address)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Handshake(req, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert "at most 256 characters" in (info.value.details() or "")
        assert not node._opening, "a refused handshake left a session waiting"
        peer = await client.connect(node.address)
        assert (await node.accept()).remote_node == client.node_id
        await peer.send(1, tag="t")


@pytest.mark.parametrize(
    "address", ["nonsense", "node-b", "node-b:0", "node-b:70000", "unix:/tmp/s:1", "[zz::1]:7", "a b:7"]
)
async def test_a_handshake_whose_control_address_cannot_be_dialled_is_refused(address: str) -> None:
    """The control address a client gives is where the accepting node dials back (its lookups,
    its goodbye as it closes). One that is no 'host:port' was taken, and the session opened:
    the first lookup then failed late, in gRPC's words ('errors resolving unix:/tmp/s:1: ...'),
    and the goodbye quietly. Refused at the handshake now, naming the address; a client that
    gives none (no lookups back to it) still connects."""
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            req = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, node_id="x", control_address=address)
            req.offers.add(name="tcp", version=node.offers["tcp"].version, address=node.offers["tcp"].address)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(req, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"control address {address!r}" in (info.value.details() or "")
            assert not node._opening, "a refused handshake left a session waiting"
            req.control_address = ""
            assert (await stub.Handshake(req, timeout=5)).session_id


@contextlib.asynccontextmanager
async def _session_and_stub() -> AsyncIterator[tuple[tensorwire.Node, tensorwire.Peer, Any]]:
    """A server node, a client's peer with a session there, and a raw Control stub to the
    server: what a client without the session secret could send, beside one that has it."""
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        peer = await client.connect(server.address)
        await server.accept()
        async with grpc.aio.insecure_channel(server.address) as ch:
            yield server, peer, control_pb2_grpc.ControlStub(ch)


async def test_only_the_sessions_peer_can_renew_its_lease() -> None:
    """A heartbeat named only the session id, which travels in the clear in the data plane's
    hello (TLS or not): anyone who saw it could keep a frozen or dead peer alive for good. A
    renewal now proves the session secret; one without the proof is refused and renews nothing."""
    from tensorwire.control._auth import heartbeat_proof

    async with _session_and_stub() as (server, peer, stub):
        assert peer.session is not None
        sid = peer.session.id
        for proof in (b"", heartbeat_proof(b"a guess", sid), heartbeat_proof(peer.session.secret, sid + "x")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(control_pb2.HeartbeatRequest(session_id=sid, proof=proof), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
        good = heartbeat_proof(peer.session.secret, sid)
        resp = await stub.Heartbeat(control_pb2.HeartbeatRequest(session_id=sid, proof=good), timeout=5)
        assert resp.lease_ms == int(server.config.lease_seconds * 1000)


async def test_a_client_that_keeps_sending_bad_proofs_cannot_fill_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Every refused heartbeat, lookup or handshake was a warning of its own: a client without
    the session secret could write a line per request for ever. The control plane now logs the
    first 20 in 10 s and counts the rest."""
    async with _session_and_stub() as (_, peer, stub):
        assert peer.session is not None
        bad = control_pb2.HeartbeatRequest(session_id=peer.session.id, proof=b"guess")
        for _ in range(60):
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Heartbeat(bad, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Lookup(control_pb2.LookupRequest(session_id=peer.session.id, name="x"), timeout=5)
    refusals = [r for r in caplog.records if "bad proof" in r.getMessage()]
    assert 1 <= len(refusals) <= 20, len(refusals)


async def test_handshakes_refused_for_require_cannot_fill_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A handshake the node cannot meet (require=, no shared transport) was logged at info once
    per handshake, unlimited, each with the client's reasons (up to 32 of 300 characters): the
    only control-plane refusal not held to 20 lines in 10 s. Now it is, and each is counted."""
    caplog.set_level(logging.INFO, logger="tensorwire.control._server")
    before = metrics.snapshot().refusals.get("control", 0)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            req = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, node_id="f", preference=["verbs"])
            for _ in range(60):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Handshake(req, timeout=5)
    lines = [r for r in caplog.records if "no transport satisfies" in r.getMessage()]
    assert 1 <= len(lines) <= 20, len(lines)
    assert all(r.levelno == logging.INFO for r in lines)
    assert metrics.snapshot().refusals.get("control", 0) - before == 60


async def test_handshakes_that_never_open_a_data_connection_cannot_fill_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that handshakes and never opens the data connection made the node warn once per
    handshake, unlimited: 2000 handshakes in a second gave 2000 lines. The first 20 in 10 s are
    logged now, and every one is counted (tensorwire_refusals_total{kind="control"})."""
    before = metrics.snapshot().refusals.get("control", 0)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), connect_timeout=0.2) as node:
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            req = control_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, node_id="f", preference=["tcp"])
            req.offers.add(name="tcp", version=node.offers["tcp"].version, address=node.offers["tcp"].address)
            for _ in range(3):
                await asyncio.gather(*[stub.Handshake(req, timeout=10) for _ in range(20)])
        await eventually(lambda: not node._opening, seconds=20)
    lines = [r for r in caplog.records if "never opened its data connection" in r.getMessage()]
    assert 1 <= len(lines) <= 20, len(lines)
    assert metrics.snapshot().refusals.get("control", 0) - before == 60


@contextlib.asynccontextmanager
async def _answering(
    server: tensorwire.Node, change: Callable[[Any], None], asking: Callable[[Any], None] | None = None
) -> AsyncIterator[str]:
    """The address of a control plane that passes every handshake (and lease renewal) on to
    ``server`` and hands the server's answer through ``change`` on its way back: a broken or
    hostile server whose sessions are real, so that a connect that takes its answer succeeds.
    ``asking`` changes each handshake request on its way in (what such a server ignores)."""
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = control_pb2_grpc.ControlStub(ch)

        class Changing(control_pb2_grpc.ControlServicer):
            async def Handshake(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
                if asking is not None:
                    asking(request)
                resp = await stub.Handshake(request, timeout=5)
                change(resp)
                return resp

            async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
                return await stub.Heartbeat(request, timeout=5)

        proxy = grpc.aio.server()
        control_pb2_grpc.add_ControlServicer_to_server(Changing(), proxy)  # type: ignore[no-untyped-call]
        port = proxy.add_insecure_port("127.0.0.1:0")
        await proxy.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await proxy.stop(None)


def _setting(**fields: Any) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        for name, value in fields.items():
            setattr(resp, name, value)

    return change


def _choosing(name: str, version: int | None = None) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        resp.chosen.name = name
        if version is not None:
            resp.chosen.version = version

    return change


# what a server's handshake answer may not hold, and what the refusal says
_UNANSWERABLE: dict[str, tuple[Callable[[Any], None], str]] = {
    "lease-1ms": (_setting(lease_ms=1), "a lease of 1 ms; a node's lease is 50 ms to 4294967000 ms"),
    "lease-49-days": (_setting(lease_ms=(1 << 32) - 1), "a lease of 4294967295 ms"),
    "node-id-3MB": (_setting(server_node_id="n" * 3_000_000), "a node id of 3000000 characters; .* at most 256"),
    "instance-id-empty": (_setting(server_instance_id=""), "an instance id of 0 characters; one is 1 to 64"),
    "instance-id-3MB": (_setting(server_instance_id="i" * 3_000_000), "an instance id of 3000000 characters"),
    "protocol-version": (_setting(protocol_version=PROTOCOL_VERSION + 1), rf"version {PROTOCOL_VERSION + 1}, .*"),
    "tcp-version": (_choosing("tcp", 99), "chose tcp version 99, and this node's tcp is version 1"),
    "not-in-the-order": (_choosing("inproc"), r"chose 'inproc', not in this connect's order \('tcp',\)"),
    "session-id-empty": (_setting(session_id=""), "a session id of 0 bytes; one is 1 to 128 bytes"),
    "session-id-129": (_setting(session_id="s" * 129), "a session id of 129 bytes"),
    "secret-empty": (_setting(session_secret=b""), "a session secret of 0 bytes, not 32"),
    "secret-1MB": (_setting(session_secret=bytes(1 << 20)), "a session secret of 1048576 bytes, not 32"),
}


@pytest.mark.parametrize("what", list(_UNANSWERABLE))
async def test_a_handshake_answer_no_honest_server_gives_is_refused(what: str) -> None:
    """The client took a server's handshake answer as it came, where the server checks every
    client's request: a lease of 1 ms had it renew every 0.3 ms and break the peer within a
    second; a server node id of 3 MB (the server refuses a client's past 256 characters), a
    session id no data connection carries, an empty secret, another protocol version or another
    version of the chosen transport, or a transport this connect did not ask for, were all taken.
    Each is a NegotiationError now that names what was wrong, and the client connects through
    the same server when it answers honestly."""
    change, message = _UNANSWERABLE[what]
    async with (
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as server,
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as client,
    ):
        async with _answering(server, change) as address:
            with pytest.raises(tensorwire.NegotiationError, match=message) as info:
                await client.connect(address, transports=("tcp",))
            assert len(str(info.value)) < 500
            assert not client.peers
        async with _answering(server, lambda resp: None) as address:
            peer = await client.connect(address, transports=("tcp",))
            await peer.send(1, tag="t")
            assert await (await server.accept()).recv(tag="t") == 1


async def test_a_handshake_answer_says_what_it_passed_over_within_bounds(caplog: pytest.LogCaptureFixture) -> None:
    """What the server passed over is only reported (in ``peer.path``, and the log): it was kept
    whole, 100 reasons of 30,000 characters in every path and log line. Now at most 32 reasons
    (a handshake names at most 32 transports), each clipped to 1000 characters, and the connect
    goes on."""

    def pass_over(resp: Any) -> None:
        for i in range(100):
            resp.passed_over.add(name=f"t{i}" + "n" * 100, reason="r" * 30_000)

    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
        _answering(server, pass_over) as address,
    ):
        peer = await client.connect(address)
        assert len(peer.path.passed_over) == 32
        assert all(len(n) <= 64 and len(r) <= 1000 for n, r in peer.path.passed_over)
        assert peer.path.passed_over[0][1].endswith("rrr...")
    assert max(len(r.getMessage()) for r in caplog.records) < 40_000


async def test_a_protocol_version_mismatch_names_both_versions_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of another protocol version is refused by the server, whose refusal said "this
    node speaks 6": read by the client, "this node" was the client's own. Both directions now
    name the server's version and the client's, each as whose it is."""
    older = PROTOCOL_VERSION - 1
    async with (
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        monkeypatch.setattr(tensorwire._node, "PROTOCOL_VERSION", older)  # the client speaks an older one
        with pytest.raises(
            tensorwire.NegotiationError,
            match=rf"version {older} is refused: this server speaks version {PROTOCOL_VERSION}",
        ):
            await client.connect(server.address)
        monkeypatch.undo()
        async with _answering(server, _setting(protocol_version=older)) as address:  # the server, an older one
            with pytest.raises(
                tensorwire.NegotiationError,
                match=rf"{address} speaks control protocol version {older}, and this node version {PROTOCOL_VERSION}",
            ):
                await client.connect(address)


def _ignoring_require(request: Any) -> None:
    request.require = ""  # (what a server that ignores require= sees: any transport will do)


def _ignoring_require_and_order(request: Any) -> None:
    _ignoring_require(request)
    request.preference[:] = ["tcp"]  # (and one that puts tcp first, whatever the client's order)


# how a server that ignores require= asks itself, and what the refusal says of the transport it chose
_SHORT_OF_REQUIRE: dict[str, tuple[Callable[[Any], None], str]] = {
    # inproc: only the client's side says it moves bytes by RDMA
    "inproc": (_ignoring_require, r"inproc, .*: inproc has no RDMA lane on 127\.0\.0\.1:\d+ \(in-process copy\)"),
    # tcp: RDMA on neither side
    "tcp": (_ignoring_require_and_order, r"tcp, .*: tcp has no RDMA lane on this node \(tcp\)"),
}


@pytest.mark.parametrize("chosen", list(_SHORT_OF_REQUIRE))
async def test_a_handshake_answer_short_of_require_is_refused(chosen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server applies ``require=``; the client took whatever transport the answer named. A
    server that ignores it (broken, hostile, or faked) had a connect with require="rdma" go
    over a path with no RDMA: the connect succeeded. Now the client judges the chosen transport
    by both sides' capabilities, as the server does, and refuses it with a NegotiationError
    naming the field and the policy; an honest server refuses the same connect itself, and the
    answer is taken without require=. (This machine has no RDMA NIC: the client's inproc says
    it has one, so that require="rdma" gets past the client's own check before asking.)"""
    asking, message = _SHORT_OF_REQUIRE[chosen]
    async with (
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as server,
        tensorwire.start("127.0.0.1:0", transports=("inproc", "tcp")) as client,
    ):
        inproc = client.offers["inproc"]
        rdma = Capabilities(rdma=True, lanes=("rc_mlx5/mlx5_0:1",))
        monkeypatch.setitem(client.offers, "inproc", Offer("inproc", inproc.version, inproc.address, rdma))
        async with _answering(server, lambda resp: None, asking) as address:
            with pytest.raises(
                tensorwire.NegotiationError, match=rf"handshake with chosen transport {message}"
            ) as info:
                await client.connect(address, require="rdma")
            assert "does not satisfy require='rdma'" in str(info.value) and "ignored require=" in str(info.value)
            assert len(str(info.value)) < 500
            assert not client.peers
            peer = await client.connect(address)  # require="any": any transport will do
            assert peer.path.transport == chosen
        with pytest.raises(tensorwire.NegotiationError, match="no transport satisfies require='rdma'"):
            await client.connect(server.address, require="rdma")  # an honest server refuses it itself
