"""A ucx send's receipt says what UCX did with its payload (``Receipt.route``): the protocol UCX
selected for the request and the lanes that protocol used, not every lane of the endpoint.

Over shared memory the endpoint has sysv, posix and cma lanes; a large payload goes by one of
them (cma, a single copy by the kernel, where this machine lets processes read each other's
memory). Over UCX's tcp transport alone it goes over tcp lanes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

import tensorwire
from tensorwire.testing import connected_pair

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
    pytest.mark.timeout(60),
]

MiB = 1 << 20
LARGE = 8 * MiB  # past the size from which a send asks UCX (_channel._ROUTE_FROM)
TLS = {"default": None, "tcp": "tcp", "sm": "sm,self"}


@contextlib.contextmanager
def _tls(tls: str | None) -> Iterator[None]:
    if tls is None:
        yield
        return
    from tensorwire.transports.ucx import ucx_config

    with ucx_config(TLS=tls):
        yield


@pytest.fixture(params=list(TLS), ids=[f"ucx-tls={t}" for t in TLS])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[tensorwire.Peer, tensorwire.Peer]]:
    with _tls(TLS[request.param]):
        async with connected_pair("ucx") as peers:
            yield peers


async def _exchange(
    a: tensorwire.Peer, b: tensorwire.Peer, src: object, out: object
) -> tuple[tensorwire.Receipt, tensorwire.Receipt]:
    recv = asyncio.ensure_future(b.recv_with_receipt(tag="x", out=out))
    sent = await a.send(src, tag="x")
    _, got = await recv
    return sent, got


async def test_a_large_send_names_the_protocol_and_lanes_ucx_used(
    pair: tuple[tensorwire.Peer, tensorwire.Peer],
) -> None:
    a, b = pair
    endpoint = a.channel.lanes
    x = np.random.default_rng(1).integers(0, 256, LARGE, dtype=np.uint8)
    out = np.empty_like(x)
    sent, got = await _exchange(a, b, x, out)
    assert np.array_equal(out, x)
    # the lanes of this message, among the endpoint's
    assert sent.lanes and set(sent.lanes) <= set(endpoint), (sent, endpoint)
    if all(lane.startswith("tcp/") for lane in endpoint):
        assert all(lane.startswith("tcp/") for lane in sent.lanes), sent
    else:
        # shared memory: one lane of the three carried it, and where the endpoint has cma
        # (processes may read each other's memory here) UCX's zero-copy read took it
        assert len(sent.lanes) < len(endpoint), (sent, endpoint)
        if "cma/memory" in endpoint:
            assert sent.lanes == ("cma/memory",) and "zero-copy" in sent.route, sent
    # and what UCX called its protocol
    assert sent.route.startswith("rendezvous"), sent
    # UCX keeps no protocol on a receive (a release build): the receiver claims only its endpoint
    assert got.route == "" and got.lanes == b.channel.lanes, got


async def test_what_ucx_is_not_asked_keeps_the_endpoint_lanes(pair: tuple[tensorwire.Peer, tensorwire.Peer]) -> None:
    """A small payload (not asked: what asking costs) and a message that has one beside a large
    one claim no route: the endpoint's lanes, as before."""
    a, b = pair
    endpoint = a.channel.lanes
    for src in ([np.ones(64 << 10, np.uint8)], [np.ones(LARGE, np.uint8), np.ones(64 << 10, np.uint8)]):
        out = [np.empty_like(s) for s in src]
        sent, _ = await _exchange(a, b, src, out)
        assert all(np.array_equal(o, s) for o, s in zip(out, src, strict=True))
        assert sent.route == "" and sent.lanes == endpoint, sent


async def test_a_large_read_and_write_name_the_protocol_and_lanes_ucx_used(
    pair: tuple[tensorwire.Peer, tensorwire.Peer],
) -> None:
    """A get or put of 4 MiB or more asks UCX too: a read, a write, a batch of two, and a read
    of 40 MiB (over cma in 16 MiB pieces, each asked) say the protocol and the lanes UCX used.
    What UCX says agrees with tensorwire's own label: a get UCX emulates (over tcp lanes:
    "software emulation") is "one-sided-emulated", one over cma ("zero-copy") is "one-sided"."""
    a, b = pair
    endpoint = b.channel.lanes
    x = np.random.default_rng(2).integers(0, 256, 6 * LARGE, dtype=np.uint8)
    a.node.expose(x, name="x")
    h = await b.lookup("x")
    assert h.direct
    said = {}
    got, said["read"] = await b.read_with_receipt(h[:LARGE])
    assert np.array_equal(got, x[:LARGE])
    _, said["batch"] = await b.read_many_with_receipt([h[LARGE : 2 * LARGE], h[2 * LARGE : 3 * LARGE]])
    got, said["pieces"] = await b.read_with_receipt(h[LARGE:])
    assert np.array_equal(got, x[LARGE:])
    said["write"] = await b.write(h[:LARGE], np.full(LARGE, 7, np.uint8))
    said["write batch"] = await b.write_many(
        [h[LARGE : 2 * LARGE], h[2 * LARGE : 3 * LARGE]], [np.full(LARGE, 8, np.uint8)] * 2
    )
    assert (x[:LARGE] == 7).all() and (x[LARGE : 3 * LARGE] == 8).all()
    for what, r in said.items():
        assert r.protocol in ("one-sided", "one-sided-emulated"), (what, r)
        assert r.route and r.lanes and set(r.lanes) <= set(endpoint), (what, r, endpoint)
        if all(lane.startswith("tcp/") for lane in endpoint):
            assert all(lane.startswith("tcp/") for lane in r.lanes), (what, r)
        elif "cma/memory" in endpoint:
            assert r.lanes == ("cma/memory",) and r.route == "zero-copy", (what, r)
        if what.startswith("read") or what in ("batch", "pieces"):
            # (a put over tcp lanes is UCX's "zero-copy" put of its tcp transport, which the
            # owner's worker still writes into memory: "one-sided-emulated" all the same)
            assert ("emulation" in r.route) == (r.protocol == "one-sided-emulated"), (what, r)


async def test_a_small_one_sided_operation_keeps_the_endpoint_lanes(
    pair: tuple[tensorwire.Peer, tensorwire.Peer],
) -> None:
    """A get or put under 4 MiB is not asked (what asking costs), nor is a batch that has one
    beside a large one: no route, the endpoint's lanes, as before."""
    a, b = pair
    endpoint = b.channel.lanes
    x = np.ones(LARGE + (64 << 10), np.uint8)
    a.node.expose(x, name="x")
    h = await b.lookup("x")
    _, small = await b.read_with_receipt(h[: 64 << 10])
    wrote = await b.write(h[: 64 << 10], np.zeros(64 << 10, np.uint8))
    _, mixed = await b.read_many_with_receipt([h[: 64 << 10], h[64 << 10 :]])
    for r in (small, wrote, mixed):
        assert r.route == "" and r.lanes == endpoint, r
