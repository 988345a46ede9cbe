"""Configuration is checked where it is given: a wrong node option, limit, address or call limit
is a ConfigurationError saying what is allowed, raised by start(), the constructor or connect(),
never a hang, a spinning watchdog or a foreign error later; the values at each bound work."""

from __future__ import annotations

import asyncio
import math
import socket
from typing import Any

import numpy as np
import pytest

import tensorwire
from tensorwire import ConfigurationError, Limits, NodeConfig
from tensorwire.rpc import CallLimits
from tensorwire.testing import connected_pair

pytestmark = pytest.mark.timeout(60)

U32, U64 = 1 << 32, 1 << 64
MIN_CHUNK = 4096  # Limits.MIN_CHUNK_BYTES
MIN_LEASE, MAX_LEASE = 0.05, 4294967.0  # NodeConfig.MIN_/MAX_LEASE_SECONDS (lease_ms is a uint32)


def test_bounds_are_the_documented_ones() -> None:
    assert Limits.MIN_CHUNK_BYTES == MIN_CHUNK
    assert (NodeConfig.MIN_LEASE_SECONDS, NodeConfig.MAX_LEASE_SECONDS) == (MIN_LEASE, MAX_LEASE)
    assert MAX_LEASE * 1000 < U32 <= (MAX_LEASE + 1) * 1000


# -- Limits -----------------------------------------------------------------------------------------
BAD_LIMITS = [
    ("recv_buffer_bytes", -1),
    ("recv_buffer_bytes", 1.5),
    ("recv_buffer_bytes", U64),
    ("recv_buffer_bytes", True),
    ("max_unexpected", 0),  # every send would wait for a slot forever
    ("max_unexpected", -1),
    ("max_unexpected", U32),  # a uint32 in the wire's limits record
    ("max_unexpected", "4"),
    ("max_unexpected", np.array([64, 64])),  # a bare TypeError from operator.index
    ("max_unexpected", np.array(64.0)),  # (a 0-d float array: TypeError too)
    ("max_message_bytes", -1),
    ("max_message_bytes", U64),
    ("max_message_bytes", 1e6),
    ("max_header_bytes", U32),
    ("max_header_bytes", U64),
    ("chunk_bytes", 0),  # ValueError from range() in every send
    ("chunk_bytes", -1),  # every send hung
    ("chunk_bytes", 1),  # a frame header per byte
    ("chunk_bytes", MIN_CHUNK - 1),
    ("chunk_bytes", 1.5),
    ("chunk_bytes", U64),
    ("inline_bytes", -1),
    ("inline_bytes", None),
    ("handshake_seconds", 0),  # every connect failed
    ("handshake_seconds", -1),
    ("handshake_seconds", math.nan),
    ("handshake_seconds", math.inf),
    ("handshake_seconds", "10"),
    ("handshake_seconds", False),
]


@pytest.mark.parametrize(("field", "value"), BAD_LIMITS, ids=[f"{f}={v!r}" for f, v in BAD_LIMITS])
def test_limits_reject(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Limits(**{field: value})


SMALLEST = {
    "recv_buffer_bytes": 0,  # valid: every message waits for its recv (rendezvous)
    "max_unexpected": 1,
    "max_header_bytes": Limits.MIN_HEADER_BYTES,
    "chunk_bytes": MIN_CHUNK,
    "inline_bytes": 0,
}


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_limits_at_their_bounds_work(transport: str) -> None:
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        Limits(chunk_bytes=MIN_CHUNK - 1)
    lim = Limits(**SMALLEST, handshake_seconds=5)  # type: ignore[arg-type]
    assert type(lim.handshake_seconds) is float
    big = Limits(max_unexpected=U32 - 1, max_header_bytes=U32 - 1, recv_buffer_bytes=U64 - 1)
    for limits in (lim, big):
        async with connected_pair(transport, limits=limits) as (a, b):
            for i in range(3):
                x = np.arange(100_000 + i, dtype=np.float32)  # many 4 KiB chunks
                recv = asyncio.ensure_future(b.recv(tag=i))
                await a.send(x, tag=i)
                assert np.array_equal(await recv, x)
                recv = asyncio.ensure_future(a.recv(tag=i))
                await b.send(x, tag=i)
                assert np.array_equal(await recv, x)


async def test_max_message_bytes_zero_allows_header_only_messages() -> None:
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        Limits(max_message_bytes=-1)
    async with connected_pair("tcp", limits=Limits(max_message_bytes=0)) as (a, b):
        await a.send({"s": "hello", "n": 3}, tag=1)
        assert await b.recv(tag=1) == {"s": "hello", "n": 3}
        with pytest.raises(tensorwire.MessageRefused, match="0-byte limit"):
            await a.send(np.ones(1), tag=1)


# -- node options -------------------------------------------------------------------------------------
BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("lease_seconds", {"lease_seconds": 0}),  # the watchdog spun a core and declared every peer dead
    ("lease_seconds", {"lease_seconds": -1}),
    ("lease_seconds", {"lease_seconds": 1e-3}),
    ("lease_seconds", {"lease_seconds": MIN_LEASE / 2}),
    ("lease_seconds", {"lease_seconds": math.nan}),
    ("lease_seconds", {"lease_seconds": math.inf}),
    ("lease_seconds", {"lease_seconds": 1e9}),  # lease_ms is a uint32: every handshake failed
    ("lease_seconds", {"lease_seconds": MAX_LEASE + 1}),
    ("lease_seconds", {"lease_seconds": "3"}),
    ("lease_seconds", {"lease_seconds": True}),
    ("goodbye_seconds", {"goodbye_seconds": 0}),
    ("goodbye_seconds", {"goodbye_seconds": -1}),
    ("goodbye_seconds", {"goodbye_seconds": math.nan}),
    ("goodbye_seconds", {"goodbye_seconds": 61}),  # every close would wait it out for a stuck node
    ("goodbye_seconds", {"goodbye_seconds": "1"}),
    ("connect_timeout", {"connect_timeout": 0}),  # a serving node could never accept a peer
    ("connect_timeout", {"connect_timeout": -1}),
    ("connect_timeout", {"connect_timeout": math.nan}),
    ("connect_timeout", {"connect_timeout": math.inf}),
    ("connect_timeout", {"connect_timeout": 1e12}),  # past what a gRPC deadline carries
    ("connect_timeout", {"connect_timeout": "5"}),
    ("checksum", {"checksum": 2}),  # broke every tcp connection
    ("checksum", {"checksum": "true"}),
    ("checksum", {"checksum": "no"}),
    ("checksum", {"checksum": 1}),
    ("checksum", {"checksum": None}),
    ("transports", {"transports": None}),
    ("transports", {"transports": ()}),
    ("transports", {"transports": [1]}),
    ("transports", {"transports": ["TCP"]}),
    ("transports", {"transports": ("tcp", "nosuch")}),
    ("transports", {"transports": 5}),
    ("transports", {"transports": [["tcp"]]}),  # a bare TypeError: unhashable type: 'list'
    ("transports", {"transports": ("tcp", {"ucx"})}),
    ("tls", {"tls": "cert.pem"}),
    ("limits", {"limits": {"max_unexpected": 5}}),
    ("limits", {"limits": None}),
    ("ucx_options", {"ucx_options": ["TLS"]}),
    ("ucx_options", {"ucx_options": {"RNDV_THRESH": 5}}),
    ("ucx_options", {"ucx_options": {5: "x"}}),
    ("ucx_options", {"ucx_options": {"UCX_TLS": "tcp"}}),  # start(): "ucx_config: pass TLS='...' as a string"
    ("ucx_options", {"ucx_options": {"TLS": "tcp\0,cma"}}),  # UCX took "tcp" alone
    ("ucx_options", {"ucx_options": {"TL\0S": "tcp"}}),
    ("auth_token", {"auth_token": 123}),
    ("auth_token", {"auth_token": b"token"}),
    ("auth_token", {"auth_token": ""}),  # would "require" a token every client has
    ("auth_token", {"auth_token": "\ud800"}),
    ("node_id", {"node_id": 5}),
    ("node_id", {"node_id": ""}),
]


@pytest.mark.parametrize(
    ("field", "options"), BAD_OPTIONS, ids=[f"{k}={v!r}" for _, o in BAD_OPTIONS for k, v in o.items()]
)
async def test_node_options_reject(field: str, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=field):
        tensorwire.start("127.0.0.1:0", **options)
    with pytest.raises(ConfigurationError, match=field):
        NodeConfig(**options)


async def test_node_id_has_a_length_limit() -> None:
    """A node's name travels in every handshake: one past 256 characters is refused where it is
    given (a multi-MB one used to fail only at connect, deep in gRPC); one at the limit works."""
    for n in (257, 10_000, 4 << 20):
        with pytest.raises(ConfigurationError, match=rf"node_id is {n} characters long .*the limit is 256"):
            NodeConfig(node_id="n" * n)
        with pytest.raises(ConfigurationError, match="node_id"):
            tensorwire.start("127.0.0.1:0", node_id="n" * n)
    assert NodeConfig.MAX_NODE_ID_CHARS == 256
    name = "\u00e9" * 256  # characters, not bytes: 512 bytes of UTF-8
    async with connected_pair("tcp", node_id=name) as (a, b):
        assert a.node.node_id == name and b.remote_node == name


async def test_config_must_be_a_node_config() -> None:
    with pytest.raises(ConfigurationError, match="NodeConfig"):
        tensorwire.start("127.0.0.1:0", config={"lease_seconds": 1.0})  # type: ignore[arg-type]


async def test_lease_at_its_bounds() -> None:
    with pytest.raises(ConfigurationError, match="lease_seconds"):
        NodeConfig(lease_seconds=0)
    for lease in (MIN_LEASE, MAX_LEASE):
        async with connected_pair("tcp", lease_seconds=lease) as (a, b):
            await a.send(np.ones(10), tag=1)
            assert np.array_equal(await b.recv(tag=1), np.ones(10))
            assert b.node.config.lease_seconds == lease and type(b.node.config.lease_seconds) is float


async def test_checksum_takes_numpy_bools() -> None:
    cfg = NodeConfig(checksum=np.True_)  # type: ignore[arg-type]
    assert cfg.checksum is True
    async with connected_pair("tcp", checksum=np.True_) as (a, b):
        assert a.node.config.checksum is True
        assert a.channel.checksum is True and b.channel.checksum is True
        x = np.arange(10_000.0)
        await a.send(x, tag=1)
        assert np.array_equal(await b.recv(tag=1), x)
    assert NodeConfig(checksum=np.False_).checksum is False  # type: ignore[arg-type]


def test_a_ucx_option_named_with_its_prefix_is_told_to_drop_it() -> None:
    from tensorwire.transports.ucx import ucx_config

    with pytest.raises(ConfigurationError, match=r"without the UCX_ prefix: \{'TLS': 'tcp'\}, not 'UCX_TLS'"):
        NodeConfig(ucx_options={"UCX_TLS": "tcp"})
    prefixed = r"ucx_config takes names without the UCX_ prefix: TLS='tcp', not UCX_TLS"  # was "pass TLS as a string"
    with pytest.raises(ConfigurationError, match=prefixed), ucx_config(UCX_TLS="tcp"):
        pass
    with (
        pytest.raises(ConfigurationError, match=r"pass TLS='...' as a string \(without NUL\)"),
        ucx_config(TLS="tcp\0"),
    ):
        pass


def test_node_config_normalizes() -> None:
    cfg = NodeConfig(transports=["tcp"], connect_timeout=np.float32(2), ucx_options={"TLS": "tcp"})  # type: ignore[arg-type]
    assert cfg.transports == ("tcp",)
    assert type(cfg.connect_timeout) is float and cfg.connect_timeout == 2.0
    assert cfg.ucx_options == {"TLS": "tcp"}
    with pytest.raises(ConfigurationError, match="transports must be a sequence"):
        NodeConfig(transports="tcp")  # type: ignore[arg-type]


# -- addresses ---------------------------------------------------------------------------------------
BAD_START = [
    None,
    5000,
    b"127.0.0.1:0",
    "127.0.0.1:99999",  # served at 34463 (wrapped)
    "127.0.0.1:65536",
    "127.0.0.1:-1",  # served at 65535
    "127.0.0.1:+5",
    "127.0.0.1: 0",
    "127.0.0.1:1_0",
    "127.0.0.1:\u0663",  # an Arabic-Indic digit three
    "::1:0",  # an IPv6 host goes in brackets
    "[::1:0",
    "[]:0",
]


@pytest.mark.parametrize("address", BAD_START, ids=repr)
async def test_start_rejects_bad_addresses(address: Any) -> None:
    with pytest.raises(ConfigurationError, match="address"):
        tensorwire.start(address)


BAD_CONNECT = [None, 123, "localhost", "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:x", "::1:5000", b"127.0.0.1:1"]


async def test_connect_rejects_bad_addresses_and_timeouts() -> None:
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        for address in BAD_CONNECT:
            with pytest.raises(ConfigurationError, match="address"):
                await node.connect(address)  # type: ignore[arg-type]
        for timeout in ("5", 0, -1, math.nan, math.inf, True):
            with pytest.raises(ConfigurationError, match="connect_timeout"):
                await node.connect("127.0.0.1:1", connect_timeout=timeout)  # type: ignore[arg-type]
        for transports in ([["tcp"]], ["tcp", None]):  # the first was a bare TypeError (unhashable)
            with pytest.raises(ConfigurationError, match=r"unknown transport .* in transports; known: inproc"):
                await node.connect("127.0.0.1:1", transports=transports)  # type: ignore[arg-type]
        assert node.peers == []


async def _one_message(client: tensorwire.Node, server: tensorwire.Node, address: str, **options: Any) -> Any:
    """Connect ``client`` to ``server`` at ``address``, send one message across; what arrives."""
    peer = await client.connect(address, **options)
    other = await server.accept()
    await peer.send(np.ones(4), tag=1)
    return await other.recv(tag=1)


async def test_addresses_at_their_bounds_work() -> None:
    with pytest.raises(ConfigurationError, match="port"):
        tensorwire.start("localhost:65536")
    async with (
        tensorwire.start("localhost:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        port = int(server.address.rpartition(":")[2])
        got = await _one_message(client, server, f"localhost:{port}", connect_timeout=np.float64(10))
        assert np.array_equal(got, np.ones(4))


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6(), reason="no IPv6 loopback here")
async def test_ipv6_in_brackets_works() -> None:
    with pytest.raises(ConfigurationError, match="brackets"):
        tensorwire.start("::1:0")
    async with (
        tensorwire.start("[::1]:0", transports=("tcp",)) as server,
        tensorwire.start("127.0.0.1:0", transports=("tcp",)) as client,
    ):
        assert server.address.startswith("[::1]:")
        got = await _one_message(client, server, server.address)
        assert np.array_equal(got, np.ones(4))


# 192.0.2.1 is TEST-NET-1 (RFC 5737): never a local address; 256.1.1.1 does not resolve
@pytest.mark.parametrize("host", ["192.0.2.1", "256.1.1.1"])
@pytest.mark.parametrize("transports", [("tcp",), None])
async def test_a_host_that_cannot_be_bound_is_a_configuration_error(host: str, transports: Any) -> None:
    options = {} if transports is None else {"transports": transports}
    with pytest.raises(ConfigurationError, match=host.replace(".", r"\.")) as info:
        async with tensorwire.start(f"{host}:0", **options):
            pass
    assert isinstance(info.value.__cause__, OSError)


# -- CallLimits --------------------------------------------------------------------------------------
BAD_CALL_LIMITS = [
    ("max_concurrent", math.nan),  # every call hung
    ("max_concurrent", 1.5),
    ("max_concurrent", "4"),  # TypeError later
    ("max_concurrent", True),
    ("max_concurrent", np.array([4])),  # a bare TypeError from operator.index
    ("max_inflight_bytes", math.nan),
    ("max_inflight_bytes", math.inf),
    ("max_inflight_bytes", U64),  # reported in a uint64 field (GetMethods)
    ("max_inflight_bytes", "1"),
    ("max_arg_bytes", math.nan),
    ("max_arg_bytes", 1.0),
    ("max_arg_bytes", U64),
]


@pytest.mark.parametrize(("field", "value"), BAD_CALL_LIMITS, ids=[f"{f}={v!r}" for f, v in BAD_CALL_LIMITS])
def test_call_limits_reject(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        CallLimits(**{field: value})


async def test_call_limits_at_their_bounds_work() -> None:
    async with connected_pair("tcp") as (a, b):

        @b.node.method("add")
        async def add(x: int, y: int) -> int:
            return x + y

        with pytest.raises(ConfigurationError, match="max_arg_bytes"):
            b.node.method("nan", max_arg_bytes=math.nan)(add)
        with pytest.raises(ConfigurationError, match="max_concurrent"):
            CallLimits(max_concurrent=math.nan)
        b.node.methods.limits = CallLimits(max_concurrent=1, max_inflight_bytes=1, max_arg_bytes=0)
        assert await asyncio.gather(*[a.call("add", i, 1) for i in range(4)]) == [1, 2, 3, 4]
        b.node.methods.limits = CallLimits(max_concurrent=np.int64(2), max_inflight_bytes=U64 - 1)  # type: ignore[arg-type]
        assert type(b.node.methods.limits.max_concurrent) is int
        assert await a.call("add", 1, 1) == 2


@pytest.mark.parametrize("address", ["[::1]", "[fe80::1]"])
async def test_an_ipv6_address_without_a_port_is_said_to_lack_it(address: str) -> None:
    # it said "write an IPv6 host in brackets", of a host already in brackets
    with pytest.raises(ConfigurationError, match=r"has no port: write HOST:PORT"):
        tensorwire.start(address)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        with pytest.raises(ConfigurationError, match=r"has no port"):
            await node.connect(address)


# hosts gRPC reads as something else: a URI's query or fragment ("?", "#": it dialled the host
# at port 443, whatever port was written), a path or user ("/", "@"), percent-escapes ("%"), a
# list (","), or an IPv4 address or a name in brackets (a late "Unparsable name")
MISREAD_HOSTS = ["127.0.0.1?", "localhost#x", "127.0.0.1/x", "user@127.0.0.1", "%31%32%37.0.0.1", "a,b",
                 "[127.0.0.1]", "[localhost]", "[]", "[::1]x", "élan"]  # fmt: skip


@pytest.mark.parametrize("host", MISREAD_HOSTS)
async def test_an_address_whose_host_grpc_would_misread_is_refused(host: str) -> None:
    with pytest.raises(ConfigurationError, match="the host must be"):
        tensorwire.start(f"{host}:0")
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",), connect_timeout=5) as node:
        port = node.address.rpartition(":")[2]
        with pytest.raises(ConfigurationError, match="the host must be"):
            await node.connect(f"{host}:{port}")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "127.0.0.1", "[::1]", "[::1%lo]", "my_host-1.local"])
def test_hosts_that_are_names_or_addresses_are_taken(host: str) -> None:
    from tensorwire._checks import split_address

    assert split_address(f"{host}:5000") == (host.removeprefix("[").removesuffix("]"), 5000)


@pytest.mark.parametrize("address", ["a\x00b:5000", "127.0.0.1\x00evil:5000", "host name:5000", "a\tb:5000", "x\x7f:1"])
async def test_an_address_with_a_control_character_or_a_space_is_refused(address: str) -> None:
    # gRPC cut a host at its NUL byte: connect("a\x00b:5000") dialled host "a"
    with pytest.raises(ConfigurationError, match="control character or a space"):
        tensorwire.start(address)
    async with tensorwire.start("127.0.0.1:0", transports=("tcp",)) as node:
        with pytest.raises(ConfigurationError, match="control character or a space"):
            await node.connect(address)
