"""Peers that come and go for days: after each one has left, a long-lived node's own tables are
back where they began (a closed peer, and one that just stops and is reaped by its lease)."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from _polling import awhile, eventually

import tensorwire
from tensorwire import Node

_UCX = pytest.param(
    "ucx",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
)
_CYCLES = 6


def _tables(node: Node, transport: str) -> dict[str, int]:
    """The sizes of what the node keeps per peer or session (zero once every peer has left)."""
    t: Any = node.transports[transport]
    return {
        "peers": len(node.peers),
        "sessions": len(node._sessions),
        "leases": len(node._leases),
        "incoming": len(node._incoming),
        "opening": len(node._opening),
        "exposure sessions": sum(len(e.given) for e in node.exposures._by_name.values()),
        "pending": len(t.sessions),
        "channels": len(getattr(t, "_channels", ())),
        "ucx keys": len(getattr(t, "_keys", ())),
    }


async def _visit(server: Node, transport: str, *, leave: str) -> None:
    """A fresh client node connects, sends, calls, reads the exposed tensor one-sided where the
    transport can, and leaves: ``close``, or ``vanish`` (it stops renewing its lease and goes
    silent, as a killed or frozen process: the server must reap it by the lease)."""
    client = await tensorwire.start(transports=(transport,), lease_seconds=server.config.lease_seconds)
    try:
        peer = await client.connect(server.address)
        await peer.send(np.ones(1 << 18, np.float32), tag="x")
        assert float((await peer.call("add1", np.ones(4, np.float32)))[0]) == 2.0
        h = await peer.lookup("exposed")
        assert h.direct == (transport == "ucx")
        assert (await peer.read(h))[5] == 5
        if leave == "close":
            await peer.aclose()
            return
        peer._stop_renewing()  # silent from now on; the channel stays up until the server reaps it
        await eventually(lambda: not server._leases, seconds=10)
    finally:
        client.abort()
        await client.aclose()


@pytest.mark.parametrize("leave", ["close", "vanish"])
@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])
async def test_a_node_holds_nothing_for_peers_that_left(transport: str, leave: str) -> None:
    async with tensorwire.start(transports=(transport,), lease_seconds=0.5) as server:
        server.expose(np.arange(1 << 16, dtype=np.float32), name="exposed")

        @server.method("add1")
        async def add1(a: Any) -> Any:
            return a + 1

        baseline = _tables(server, transport)
        assert not any(baseline.values()), baseline
        for _ in range(_CYCLES):
            await _visit(server, transport, leave=leave)
            peer = await server.accept()
            await peer.recv(tag="x")
            await peer.aclose()
        await awhile(lambda: _tables(server, transport) == baseline, seconds=10)
        assert _tables(server, transport) == baseline
