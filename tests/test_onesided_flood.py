"""Owner-assisted one-sided service in bounded memory: a peer that floods requests and never takes
the answers, and honest peers whose heavy concurrent use must never wait for good on that bound."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from _polling import eventually

import tensorwire
from tensorwire import _onesided
from tensorwire.testing import connected_pair

# what an owner runs for one peer's requests and notices (_drain_later's: before the bound)
_SERVING = {"_serve_one", "_acknowledge", "_drain_within", "_drain_later.<locals>.drain"}


_UCX = pytest.param(
    "ucx",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
    ),
)


def _serving() -> int:
    return sum(1 for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") in _SERVING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "inproc", _UCX])  # (ucx: requests a direct peer never sends)
@pytest.mark.parametrize("op", ["read", "write", "revoke", "drop"])
async def test_a_peer_that_never_takes_its_answers_costs_the_owner_a_bounded_number_of_tasks(
    transport: str, op: str
) -> None:
    """A peer sends owner-assisted requests (reads whose answers it never pulls, writes whose
    payloads never come, revocation notices whose acknowledgements it never takes, notes to drop
    messages that never come) as fast as it can. The owner started a task for each as it read it,
    with no bound: 20 000 such reads left 19 974 tasks alive (+182 MiB). Now it runs at most
    ``_MAX_SERVED`` of them and leaves the rest unread, holding the peer's message slots, so the
    peer's further sends wait."""
    limits = tensorwire.Limits(max_unexpected=16, recv_buffer_bytes=4096)
    async with connected_pair(transport, limits=limits) as (a, b):
        n = 1 << 16  # past b's credit: a read's answer waits for a go-ahead b never gives
        a.node.expose(np.zeros(n, np.uint8), name="x")
        h = await b.lookup("x")
        region = [{"name": "x", "generation": h.generation, "offset": 0, "shape": [n]}]

        async def ask(i: int) -> None:
            reply, data = _onesided._tags()
            if op == "revoke":  # as an owner would (b exposes nothing: a only acknowledges)
                req = {"op": "revoke", "name": f"t{i}", "generation": 1, "reply": reply}
            else:
                req = {"op": op, "regions": region, "reply": reply, "data": data}
            await b._send_own(req, tag=_onesided._OPS_TAG)

        flood = [asyncio.ensure_future(ask(i)) for i in range(4 * _onesided._MAX_SERVED)]

        def unread() -> int:
            return len(a.channel.mailbox._arrived.get(_onesided._OPS_TAG, ()))

        try:
            # every request taken (the old owner), or the owner at its bound with more waiting
            await eventually(
                lambda: all(f.done() for f in flood) or (_serving() >= _onesided._MAX_SERVED and unread() > 0), 20
            )
            await asyncio.sleep(0.2)  # time for more to be read, were any to be
            assert _serving() <= _onesided._MAX_SERVED
            assert unread() > 0 and not all(f.done() for f in flood), "the flood was taken whole"
        finally:
            for f in flood:
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


@contextlib.asynccontextmanager
async def _star(
    transport: str, limits: tensorwire.Limits, n: int
) -> AsyncIterator[list[tuple[tensorwire.Peer, tensorwire.Peer]]]:
    """An owner node and ``n`` nodes joined to it: (owner's peer, other's peer) for each."""
    async with contextlib.AsyncExitStack() as stack:
        owner = await stack.enter_async_context(tensorwire.start("127.0.0.1:0", transports=(transport,), limits=limits))
        pairs = []
        for _ in range(n):
            node = await stack.enter_async_context(
                tensorwire.start("127.0.0.1:0", transports=(transport,), limits=limits)
            )
            theirs = await node.connect(owner.address)
            pairs.append((await owner.accept(), theirs))
        yield pairs


_WIDTHS = (16, 4096, 1 << 17, 1 << 19)  # bytes per row: eager, and past the credit (rendezvous)
_ROWS = 25  # rows of each width each peer writes, and reads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
@pytest.mark.parametrize("bound", ["as-shipped", "tightest"])
async def test_heavy_concurrent_honest_use_from_two_peers_completes(
    transport: str, bound: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two peers each run 200 owner-assisted reads and writes of mixed sizes at once, a few of
    them cancelled part way, while the owner reads from both: all complete, with the right bytes,
    and leave nothing behind (the owner's unexposes return, its service tasks end). A cap on the
    owner's service that stops reading requests could leave a write's payload stuck behind
    requests nobody reads; ``tightest`` sets the bounds to the least ``serve_ops``'s argument
    allows, so the owner is at its cap much of the time, and the peers' few message slots fill."""
    if bound == "tightest":
        monkeypatch.setattr(_onesided, "_MAX_ASKED", 4)
        monkeypatch.setattr(_onesided, "_MAX_SERVED", 5)
    limits = tensorwire.Limits(max_unexpected=4, recv_buffer_bytes=1 << 16)
    rng = np.random.default_rng(0)
    async with _star(transport, limits, 2) as pairs:
        owner = pairs[0][0].node
        sources = {w: rng.integers(0, 256, (_ROWS, w), np.uint8) for w in _WIDTHS}
        for w, src in sources.items():
            owner.expose(src, name=f"r{w}")  # what the peers read
        targets = {}
        for p in range(len(pairs)):
            for w in _WIDTHS:
                targets[p, w] = np.zeros((_ROWS, w), np.uint8)
                owner.expose(targets[p, w], name=f"w{p}-{w}")  # what peer p writes
        backs = []
        for _, theirs in pairs:  # what the owner reads of each peer, meanwhile
            back = rng.integers(0, 256, (50, 4096), np.uint8)
            theirs.node.expose(back, name="back")
            backs.append(back)

        jobs: list[tuple[str, asyncio.Future[Any], Any]] = []
        for p, (mine, theirs) in enumerate(pairs):
            for w in _WIDTHS:
                rh, wh = await theirs.lookup(f"r{w}"), await theirs.lookup(f"w{p}-{w}")
                for i in range(_ROWS):
                    row = np.full(w, (p * 31 + i) % 251 + 1, np.uint8)
                    jobs.append(("write", asyncio.ensure_future(theirs.write(wh[i], row)), (p, w, i)))
                    jobs.append(("read", asyncio.ensure_future(theirs.read(rh[i])), (w, i)))
            bh = await mine.lookup("back")
            for i in range(50):
                jobs.append(("back", asyncio.ensure_future(mine.read(bh[i])), (p, i)))
        rng.shuffle(jobs)  # (the peers' calls interleave)
        cancelled = set()
        for k in range(0, len(jobs), 23):  # a few given up on, once under way
            await asyncio.sleep(0)
            jobs[k][1].cancel()
            cancelled.add(k)
        async with asyncio.timeout(60):
            await asyncio.gather(*(f for _, f, _ in jobs), return_exceptions=True)
        for k, (kind, f, where) in enumerate(jobs):
            if k in cancelled and f.cancelled():
                continue
            assert f.exception() is None, (kind, where, f.exception())
            if kind == "write":
                p, w, i = where
                assert (targets[p, w][i] == (p * 31 + i) % 251 + 1).all(), (p, w, i)
            elif kind == "read":
                w, i = where
                assert np.array_equal(f.result(), sources[w][i]), (w, i)
            else:
                p, i = where
                assert np.array_equal(f.result(), backs[p][i]), (p, i)
        async with asyncio.timeout(30):  # nothing still moves into or out of any tensor
            for name in [f"r{w}" for w in _WIDTHS] + [f"w{p}-{w}" for p, w in targets]:
                await owner.unexpose(name)
            for _, theirs in pairs:
                await theirs.node.unexpose("back")
        await eventually(lambda: _serving() == 0, 30)
